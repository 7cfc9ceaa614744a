"""The data feed: the coordinator's collaborator that turns the cursor into batches.

The driver holds the manifest, the order and a window of object references, never rows. Ray
Data reads the units (Parquet row groups) of the current epoch in the order's unit sequence,
starting at the unit the cursor needs: one read task per row group, in order, with Ray Data's
backpressure bounding how far it runs ahead in the object store. Each step's `Batch` names
its samples by manifest position and carries references to the units that hold them; workers
fetch those units from the object store (shared memory on their node) and take their own rows.

`streaming_split` is not used: it hands blocks to whichever consumer asks first, so which
replica trains on which sample would not be reproducible, and its iterators cannot seek.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from baton import storage
from baton.data.manifest import Manifest, Unit
from baton.data.order import Cursor, EpochOrder
from baton.errors import DataError

# Read tasks ask for no CPU: the workers hold the CPUs (all of them on a small machine), and a
# task asking for any would never be scheduled beside them. Decoding a row group is cheap next
# to a training step; the concurrency cap bounds how many run at once.
READ_CONCURRENCY = 4
# How far Ray Data may read ahead of what the feed holds, in shuffle blocks (bytes estimated
# from the files' sizes). Unbounded, it reads as far as its share of the object store (30 % of
# RAM by default): on a 2 GB corpus that was the whole corpus, read while training and halving
# its throughput on 2 cores (benchmarks/data_stream.py).
READ_AHEAD_BLOCKS = 1
MIN_READ_AHEAD_BYTES = 32 * 2**20

TOKENS, IDS = "tokens", "id"  # the columns of a unit as the workers see it


@dataclass
class Batch:
    """One global batch: manifest positions in training order, the units holding them
    (uid -> (position of the unit's first row, the unit's block references)), and the uids of
    every unit the feed still holds: a worker keeps those it has fetched (a later step of the
    block needs them again) and lets go of the rest, so the object store can free them."""

    positions: np.ndarray
    units: dict[int, tuple[int, list]]
    window: frozenset = frozenset()

    def __len__(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class Columns:
    token: str
    id: Optional[str]
    width: int  # tokens per row: seq_len + 1
    vocab_size: int


def read_unit(root: str, unit: Unit, columns: Columns) -> pa.Table:
    """One row group, checked, with the columns renamed to what the workers read. Bad rows
    raise DataError naming the file and row group."""
    fs = storage.resolve(root)[0]
    wanted = [columns.token] + ([columns.id] if columns.id else [])
    with fs.open_input_file(unit.file) as f:
        table = pq.ParquetFile(f).read_row_group(unit.row_group, columns=wanted)
    where = f"data.path: {unit.file} row group {unit.row_group}"
    tokens = table.column(columns.token).combine_chunks()
    if not pa.types.is_list(tokens.type) and not pa.types.is_fixed_size_list(tokens.type) \
            and not pa.types.is_large_list(tokens.type):
        raise DataError(f"{where}: data.token_column {columns.token!r} holds {tokens.type}, "
                        "not lists of token ids")
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    if tokens.null_count or (lengths != columns.width).any():
        raise DataError(f"{where}: every token row must hold {columns.width} tokens "
                        f"(model.seq_len + 1); found lengths {sorted(set(lengths.tolist()))[:5]} "
                        f"and {tokens.null_count} null rows")
    values = tokens.flatten()
    if len(values):
        low, high = pc.min_max(values).values()
        if low.as_py() < 0 or high.as_py() >= columns.vocab_size:
            raise DataError(f"{where}: token ids lie in [{low}, {high}] but model.vocab_size is "
                            f"{columns.vocab_size}; set model.vocab_size: {high.as_py() + 1} or more")
    out = {TOKENS: tokens}
    if columns.id:
        out[IDS] = table.column(columns.id).combine_chunks()
    return pa.table(out)


def _read_units(root: str, units: list[Unit], columns: Columns, read_ahead_bytes: int):
    """A Ray Data dataset of `units`, one read task (and one block) each, in this order, that
    holds at most about `read_ahead_bytes` of blocks not yet taken."""
    import ray
    from ray.data._internal.execution.interfaces import ExecutionResources
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class UnitSource(Datasource):
        def estimate_inmemory_data_size(self) -> Optional[int]:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda u=u: [read_unit(root, u, columns)],
                             BlockMetadata(num_rows=u.rows, size_bytes=None, exec_stats=None,
                                           input_files=(u.file,)))
                    for u in units]

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # blocks come out in the units' order
    ctx.execution_options.resource_limits = ExecutionResources.for_limits(
        object_store_memory=read_ahead_bytes)
    return ray.data.read_datasource(UnitSource(), override_num_blocks=len(units), num_cpus=0,
                                    concurrency=min(READ_CONCURRENCY, len(units)))


class DataFeed:
    """Batches for the coordinator. Holds the references of the units from the first one the
    current batch may need up to the last one read; a batch behind that window (a recovery
    rewound the cursor), in another epoch, or far ahead restarts the read there."""

    def __init__(self, manifest: Manifest, order: EpochOrder, columns: Columns):
        self.manifest, self.order, self.columns = manifest, order, columns
        self.epoch: Optional[int] = None
        self.held: dict[int, list] = {}  # index in the epoch's unit order -> block references
        self.next_index = 0  # the index the reader yields next
        self.reader: Optional[Iterator] = None
        self.executor = None  # Ray Data's, stopped when the feed seeks or closes
        self.rows_read = 0  # rows of the units read so far: what seeks cost
        per_sample = manifest.bytes / max(1, manifest.num_samples)
        self.read_ahead_bytes = max(MIN_READ_AHEAD_BYTES,
                                    int(READ_AHEAD_BLOCKS * order.block_size * per_sample))
        self.restarts = 0

    def prime(self, cursor: Cursor, global_batch: int) -> None:
        """Read (and check) the units of the batch at `cursor` now: bad rows there are
        refused before the run has written anything."""
        self._hold(cursor.epoch, *self._span(cursor, global_batch))

    def next_batch(self, cursor: Cursor, global_batch: int) -> Batch:
        epoch = cursor.epoch
        self._hold(epoch, *self._span(cursor, global_batch))
        positions = self.order.next_batch(cursor, global_batch)
        perm = self.order.unit_order(epoch)[0]
        by_uid = {int(perm[i]): refs for i, refs in self.held.items()}
        units = {}
        for uid in np.unique(self.manifest.unit_of(positions)).tolist():
            units[uid] = (self.manifest.units[uid].offset, by_uid[uid])
        return Batch(positions, units, frozenset(by_uid))

    def _span(self, cursor: Cursor, global_batch: int) -> tuple[int, int]:
        stop = min(cursor.consumed + global_batch, self.manifest.num_samples)
        return self.order.units_for(cursor.epoch, cursor.consumed, stop)

    def _hold(self, epoch: int, first: int, last: int) -> None:
        behind = epoch != self.epoch or first < min(self.held, default=self.next_index)
        if behind or first > self.next_index:  # a seek: read from `first`, not through to it
            self._restart(epoch, first)
        for i in [i for i in self.held if i < first]:
            del self.held[i]
        while self.next_index < last:
            bundle = _reading(next, self.reader, None)
            if bundle is None:
                raise DataError(f"data.path: the data ended early: unit {self.next_index} of epoch "
                                f"{epoch} was never read (did the files change under it?)")
            self.held[self.next_index] = list(bundle.block_refs)
            self.rows_read += bundle.num_rows()
            self.next_index += 1

    def _restart(self, epoch: int, first: int) -> None:
        self.close()
        perm = self.order.unit_order(epoch)[0]
        units = [self.manifest.units[int(u)] for u in perm[first:]]
        dataset = _read_units(self.manifest.root, units, self.columns, self.read_ahead_bytes)
        self.reader, self.executor = _reading(_execute, dataset)
        self.epoch, self.next_index, self.held = epoch, first, {}
        self.restarts += 1
        logging.getLogger(__name__).debug("data: reading epoch %d from unit %d", epoch, first)

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(force=True)
        self.reader, self.executor, self.held = None, None, {}


def _execute(dataset) -> tuple[Iterator, object]:
    """The dataset's bundles and the executor producing them. Ray Data (2.60) stops an
    executor when its iterator is exhausted, and the public `iter_internal_ref_bundles` keeps
    no handle to it: a feed that seeks would leave the old read running. Its private
    `_execute_to_iterator` returns the executor; without it, the public call."""
    run = getattr(dataset, "_execute_to_iterator", None)
    if run is None:
        return iter(dataset.iter_internal_ref_bundles()), None
    bundles, _, executor = run(capture_executor=False)
    return iter(bundles), executor


def _reading(fn, *args):
    """`fn(*args)`, with a failed read task (bad rows, a file gone) as one DataError line."""
    try:
        return fn(*args)
    except DataError as e:  # Ray's RayTaskError(DataError) is one too, traceback and all
        raise DataError(_first_line(e)) from None
    except Exception as e:
        if type(e).__module__.startswith("ray"):
            raise DataError(f"data.path: reading failed: {_first_line(e)}") from None
        raise


def _first_line(error: Exception) -> str:
    """The message of the error a read task raised, without Ray's wrapping."""
    text = str(error)
    for line in text.splitlines():
        if "DataError:" in line:
            return line.split("DataError:", 1)[1].strip()
    return (text.strip().splitlines() or [type(error).__name__])[-1][:500]
