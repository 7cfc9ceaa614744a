"""The data feed: the coordinator's collaborator that turns the cursor into batches.

The driver holds the manifest, the order and a window of object references, never rows. Ray
Data reads the units (Parquet row groups) of the current epoch in the order's unit sequence,
one read task per row group, spread across the cluster's nodes (data.read: spread; driver
keeps them on the driver's node): one finite execution per shuffle block, started a block
ahead and consumed as it goes by a thread of the feed, so the object store holds about the
current block and the next. Each step's `Batch` names its samples by manifest position and
carries references to the units that hold them; workers fetch those units from the object
store (shared memory on their node, or pulled from the node that read them) and take their
own rows.

Why one execution per block and not one long, backpressured one: Ray Data 2.60's scheduling
loop waits in `ray.wait` only while tasks run; an execution held back by its memory budget has
none, and its thread spins (measured: a whole core of the driver, and training at half speed
on 2 cores). A finite execution is never held back: it reads its block and ends.

`streaming_split` is not used: it hands blocks to whichever consumer asks first, so which
replica trains on which sample would not be reproducible, and its iterators cannot seek.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from baton import storage
from baton.data.manifest import Manifest, Unit
from baton.data.order import Cursor, EpochOrder, rebased
from baton.errors import DataError, reason
from baton.tasks import LOSS_MASK

# Read tasks ask for no CPU: the workers hold the CPUs (all of them on a small machine), and a
# task asking for any would never be scheduled beside them. Decoding a row group is cheap next
# to a training step; the concurrency cap bounds how many run at once (and the idle read
# workers Ray keeps on each node: ray_settings.py).
READ_CONCURRENCY = 4

TOKENS, IDS = "tokens", "id"  # the columns of a unit as the workers see it
# a unit whose rows cannot be read as the job says, as a read task returns it (`read_marked`):
# an empty table, the reason in its metadata, and whether it may be skipped
BAD, SKIPPABLE = b"baton.bad", b"baton.skippable"


class Elsewhere(DataError):
    """A file the driver listed is missing on the node where a read ran: no row's fault, so
    never skipped as bad rows are (data.skip_bad_row_groups)."""


@dataclass
class Batch:
    """One global batch: manifest positions in training order, the units holding them
    (uid -> (position of the unit's first row, the unit's block references)), and the uids of
    every unit the feed still holds: a worker keeps those it has fetched (a later step of the
    block needs them again) and lets go of the rest, so the object store can free them."""

    positions: np.ndarray
    units: dict[int, tuple[int, Optional[list]]]  # references None: the workers hold the unit
    window: frozenset = frozenset()

    def __len__(self) -> int:
        return len(self.positions)


class UnitsSent:
    """The units whose references one world's workers already hold, so that a batch carries
    the references of new units only. Each worker's `UnitRows` keeps a unit while it is in the
    batch or the feed's window, and this keeps the same set, batch by batch in the order the
    workers use them. A batch of the quick-start job touched about 20 units, and each
    reference sent is serialised by the coordinator and registered by the worker as borrowed:
    sending each once took the driver's CPU from 4.7 to 3.7-4.0 ms a step on 2 cores
    (benchmarks/step_cpu.py). A new world starts empty."""

    def __init__(self):
        self.uids: set[int] = set()

    def strip(self, batch: Batch) -> Batch:
        units = {u: (offset, None if u in self.uids else refs) for u, (offset, refs) in batch.units.items()}
        self.uids = (self.uids & batch.window) | set(batch.units)
        return Batch(batch.positions, units, batch.window)


@dataclass(frozen=True)
class Field:
    """One entry of a batch as the task sees it, read from one or more Parquet columns (several
    are concatenated: features)."""

    name: str
    sources: tuple[str, ...]
    shape: tuple[int, ...]  # of one row: () for a scalar, (n,) for n values, a tensor's shape
    dtype: str  # "int64" | "float32"
    high: Optional[int] = None  # values must lie in [0, high): token ids, class labels
    key: str = ""  # the spec key that names it, for messages
    padded: bool = False  # lists of any length up to shape[0], padded with 0; NAME_mask says which


@dataclass(frozen=True)
class Columns:
    fields: tuple[Field, ...]
    id: Optional[str]
    # a language model's end-of-document token, where each row's documents attend each to
    # itself alone (data.document_mask: the job's data.eod_token, or its corpus's)
    eod: Optional[int] = None

    def shapes(self) -> dict:
        """name -> (row shape, torch dtype): what a padding row looks like."""
        import torch

        out = {}
        for f in self.fields:
            out[f.name] = (f.shape, getattr(torch, f.dtype))
            if f.padded:
                out[f"{f.name}_mask"] = (f.shape, torch.bool)
        return out


def token_columns(token: str, id_column: Optional[str], width: int, vocab_size: int,
                  loss_mask: Optional[str] = None, eod: Optional[int] = None) -> Columns:
    """A language model's rows: `width` token ids each (seq_len + 1), and as many 0s and 1s
    of its loss mask where it has one; `eod`: where its documents end (data.document_mask)."""
    fields = (Field(TOKENS, (token,), (width,), "int64", vocab_size, "data.token_column"),)
    if loss_mask is not None:
        fields += (Field(LOSS_MASK, (loss_mask,), (width,), "int64", 2, "data.loss_mask_column"),)
    return Columns(fields, id_column, eod)


def read_marked(root: str, unit: Unit, columns: Columns, home: Optional[str] = None) -> pa.Table:
    """`read_unit` as the run's reads call it: a unit whose rows are bad, or whose file is
    missing where the read runs, is a table of no rows with why in its metadata (`bad`), not
    an exception. A read task's exception is Ray Data's to log: 140 lines of its traceback and
    retry advice came before baton's one line, and it ended the whole read."""
    try:
        return read_unit(root, unit, columns, home)
    except DataError as e:
        return pa.table({}).replace_schema_metadata(
            {BAD: str(e).encode(), SKIPPABLE: b"" if isinstance(e, Elsewhere) else b"1"})


def bad(table: pa.Table) -> Optional[tuple[str, bool]]:
    """Why a unit read by `read_marked` holds no rows, and whether it may be left out
    (data.skip_bad_row_groups: bad rows may, a file missing on a node may not); None: it holds
    its rows."""
    metadata = table.schema.metadata or {}
    if table.num_rows or BAD not in metadata:
        return None
    return metadata[BAD].decode(), bool(metadata.get(SKIPPABLE))


def read_unit(root: str, unit: Unit, columns: Columns, home: Optional[str] = None) -> pa.Table:
    """One row group, checked, with the columns renamed to what the workers read. Bad rows
    raise DataError naming the file and row group. `home`: the driver's node, where the run
    listed the files, when this runs in a read task that may be on another node."""
    fs = storage.resolve(root)[0]
    wanted = list(dict.fromkeys([c for f in columns.fields for c in f.sources]
                                + ([columns.id] if columns.id else [])))
    width = max(1, sum(math.prod(f.shape) for f in columns.fields))
    where = f"data.path: {unit.file} row group {unit.row_group}"
    try:
        with fs.open_input_file(unit.file) as f:
            # in batches of about 1 MiB of values: decoding a list column a whole row group at
            # a time takes 10-20 times the row group's size (measured: 49-85 MB of Arrow memory
            # for a 4.4 MB row group, 15 MB in batches of 1,024 rows, and faster)
            file = pq.ParquetFile(f)
            batches = list(file.iter_batches(max(64, 2**20 // width), row_groups=[unit.row_group],
                                             columns=wanted, use_threads=False))
            table = pa.Table.from_batches(batches) if batches else \
                file.read_row_group(unit.row_group, columns=wanted)
    except (OSError, pa.ArrowException) as e:  # damaged pages, a file gone or cut short
        if isinstance(e, FileNotFoundError) and storage.is_local(fs) and home is not None:
            _not_here(unit.file, home)
        raise DataError(f"{where}: cannot be read ({reason(e)}): the file is "
                        "damaged, or changed after the run listed it; restore it, or remove it "
                        "(a resume then needs --rebase-data)") from None
    out = {}
    for f in columns.fields:
        out.update(_padded(table, f, where) if f.padded else {f.name: _field(table, f, where)})
    if columns.id:
        out[IDS] = table.column(columns.id).combine_chunks()
    return pa.table(out)


def _not_here(file: str, home: str) -> None:
    """A file the driver listed is missing where this read runs: on another node, perhaps a
    folder only the driver's node has (raises DataError saying so); on the driver's node, a
    file gone (returns, for the caller's message)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    if node == home:
        return
    ip = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node), node[:8])
    raise Elsewhere(f"data.path: {file} is missing on node {ip}, where a read ran (reads run "
                    "across the cluster's nodes): if the data is on the driver's node only, put "
                    "it where every node reads it (a volume mounted at the same path on each, "
                    "or s3://) or set data.read: driver; if the file was removed, restore it")


def _field(table: pa.Table, field: Field, where: str) -> pa.Array:
    """One field of a row group: a flat array (scalars) or fixed-size lists, checked."""
    parts = []
    for name in field.sources:
        column = table.column(name).combine_chunks()
        if isinstance(column.type, pa.BaseExtensionType):  # an Arrow tensor: its fixed-size lists
            column = column.storage
        if column.null_count:
            raise DataError(f"{where}: {field.key} {name!r} has {column.null_count} null rows")
        if _is_list(column.type):
            lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
            if field.name in (TOKENS, LOSS_MASK) and (lengths != field.shape[0]).any():
                what = ("token row must hold {} tokens" if field.name == TOKENS else
                        "loss mask row (data.loss_mask_column) must hold {} values").format(field.shape[0])
                raise DataError(f"{where}: every {what} (model.seq_len + 1); found lengths "
                                f"{sorted(set(lengths.tolist()))[:5]} and 0 null rows")
            if len(lengths) and (lengths != lengths[0]).any():
                raise DataError(f"{where}: {field.key} {name!r} holds lists of "
                                f"{sorted(set(lengths.tolist()))[:5]} values; every row must hold "
                                "as many")
            values, per_row = column.flatten(), (int(lengths[0]) if len(lengths) else 0)
        elif pa.types.is_integer(column.type) or pa.types.is_floating(column.type) \
                or pa.types.is_boolean(column.type):
            values, per_row = column, 1
        else:
            what = "lists of token ids" if field.name == TOKENS else "numbers or lists of numbers"
            raise DataError(f"{where}: {field.key} {name!r} holds {column.type}, not {what}")
        if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
                or pa.types.is_boolean(values.type)):
            raise DataError(f"{where}: {field.key} {name!r} holds lists of {values.type}, not numbers")
        if values.null_count:
            raise DataError(f"{where}: {field.key} {name!r} has {values.null_count} null values")
        parts.append(values.to_numpy(zero_copy_only=False).reshape(len(column), per_row))
    data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    if data.shape[1] != math.prod(field.shape):
        raise DataError(f"{where}: {field.key} gives {data.shape[1]} values a row, not "
                        f"{math.prod(field.shape)} as in the first row group (did the files change?)")
    if field.name == LOSS_MASK and data.dtype == bool:
        data = data.astype(np.uint8)
    if field.high is not None and data.size:
        if not np.issubdtype(data.dtype, np.integer):
            raise DataError(f"{where}: {field.key} holds {data.dtype} values; it must hold integers")
        low, high = int(data.min()), int(data.max())
        if low < 0 or high >= field.high:
            if field.name == TOKENS:
                raise DataError(f"{where}: token ids lie in [{low}, {high}] but model.vocab_size "
                                f"is {field.high}; set model.vocab_size: {high + 1} or more")
            if field.name == LOSS_MASK:
                raise DataError(f"{where}: {field.key} values lie in [{low}, {high}]; a loss mask "
                                "holds 1 where a token is a target, 0 where not")
            raise DataError(f"{where}: {field.key} values lie in [{low}, {high}] but the model has "
                            f"{field.high} classes (model.options.classes); labels must lie in "
                            f"[0, {field.high})")
    if field.dtype == "float32":  # integers stay as stored (token ids in 16 bits stay so)
        with np.errstate(over="ignore"):  # beyond float32's range: infinite, refused below
            data = data.astype(np.float32, copy=False)
        _finite(data.reshape(len(data), -1), field, where)
    flat = pa.array(data.reshape(-1))
    return flat if field.shape == () else pa.FixedSizeListArray.from_arrays(flat, data.shape[1])


def _finite(rows: np.ndarray, field: Field, where: str) -> None:
    """Float rows hold numbers: a NaN or an infinity (one beyond float32's range included) would
    make the loss NaN and end the run with a message about the learning rate instead."""
    bad = ~np.isfinite(rows).all(axis=1)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raise DataError(f"{where}: {field.key} holds NaN or infinite values in {int(bad.sum())} "
                        f"row{'s' * (int(bad.sum()) != 1)} (the first: row {first} of the row "
                        "group, counted from 0); drop or fill them")


def _padded(table: pa.Table, field: Field, where: str) -> dict:
    """A list column of any lengths up to `field.shape[0]`, padded with 0, and its mask."""
    [name] = field.sources
    column = table.column(name).combine_chunks()
    if column.null_count:
        raise DataError(f"{where}: {field.key} {name!r} has {column.null_count} null rows")
    most = field.shape[0]
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    if len(lengths) and lengths.max() > most:
        raise DataError(f"{where}: {field.key} {name!r} has a row of {int(lengths.max())} values, "
                        f"more than data.pad.{field.name} = {most}; raise it")
    values = column.flatten().to_numpy(zero_copy_only=False)
    if field.high is not None and values.size and (values.min() < 0 or values.max() >= field.high):
        raise DataError(f"{where}: {field.key} values lie in [{values.min()}, {values.max()}], "
                        f"outside [0, {field.high})")
    mask = np.arange(most)[None, :] < lengths[:, None]
    rows = np.zeros((len(lengths), most), dtype=np.float32 if field.dtype == "float32" else values.dtype)
    with np.errstate(over="ignore"):
        rows[mask] = values
    if field.dtype == "float32":
        _finite(rows, field, where)
    return {field.name: pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), most),
            f"{field.name}_mask": pa.FixedSizeListArray.from_arrays(pa.array(mask.reshape(-1)), most)}


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)


def _ray_data():
    """Ray Data, imported where the feed first reads through it (a block ahead of training;
    never, in a run whose first block holds all it trains on), not on the way to the first
    step: 0.6 s of the driver's CPU after `ray.init` on the 2-core machine. Its import sets
    its loggers' levels, so the feed sets them after it: the console is baton's progress line,
    not Ray Data's INFO lines for each read nor its warning that its progress bars are off."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # blocks come out in the units' order
    ctx.enable_progress_bars = False
    for name, level in (("ray.data", logging.WARNING), ("ray.data._internal.progress", logging.ERROR)):
        logging.getLogger(name).setLevel(level)
    return ray.data


def _read_units(root: str, units: list[Unit], columns: Columns, spread: bool):
    """A Ray Data dataset of `units`, one read task (and one block) each, in this order (Ray
    Data imported and set up by `_ray_data`, which the read called first; bad rows marked:
    `read_marked`). `spread`: the tasks run across the cluster's nodes (Ray Data's SPREAD),
    else on the driver's."""
    return unit_tasks(units, lambda u, home: read_marked(root, u, columns, home), spread)


def unit_tasks(units: list[Unit], read: Callable[[Unit, str], pa.Table], spread: bool):
    """A Ray Data dataset of one read task a unit, `read(unit, the driver's node)` its block,
    in this order (`_read_units`; `baton data check`'s)."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    home = ray.get_runtime_context().get_node_id()

    class UnitSource(Datasource):
        def estimate_inmemory_data_size(self) -> Optional[int]:
            return None

        @property
        def supports_distributed_reads(self) -> bool:
            # A block is stored on the node that read it. Spread: a node that is lost takes
            # its blocks along, and Ray reads them again (the driver owns them, and a read
            # task's output is rebuilt from its lineage: Ray starts that as soon as the node
            # is gone). Driver: every read on the driver's node (data.read: driver).
            return spread

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda u=u: [read(u, home)],
                             BlockMetadata(num_rows=u.rows, size_bytes=None, exec_stats=None,
                                           input_files=(u.file,)))
                    for u in units]

    return ray.data.read_datasource(UnitSource(), override_num_blocks=len(units), num_cpus=0,
                                    concurrency=min(READ_CONCURRENCY, len(units)))


class _Read:
    """One finite Ray Data execution: units [first, last) of an epoch's order, consumed on a
    thread of its own as they come (the feed waits for the ones it needs).

    `here`: read by that thread in this process instead, one unit at a time, each put in the
    object store before the next is read (one row group in this process's memory at a time).
    The first block after a start or a seek is read so: Ray Data's first execution in a job
    starts a read worker (a process, Ray Data's imports), 2-3 s on an idle 2-core machine and
    measured at 8-9 s while the workers' processes start beside it, all on the way to the
    first step; the driver has pyarrow loaded already and reads a block in well under a
    second. Later blocks, read a block ahead of training, go through Ray Data."""

    def __init__(self, feed: "DataFeed", epoch: int, first: int, last: int, here: bool = False):
        self.epoch, self.first, self.last = epoch, first, last
        feed.ranges_read.append((epoch, first, last))
        self.refs: dict[int, list] = {}  # index in the epoch's unit order -> block references
        self.bad: dict[int, str] = {}  # index -> why its rows were skipped (feed.skip_bad)
        self.rows = 0
        self.error: Optional[Exception] = None
        self.finished = False
        self.executor = None
        self.cancelled = False
        self._cond = threading.Condition()
        perm = feed.order.unit_order(epoch)[0]
        units = [feed.manifest.units[int(u)] for u in perm[first:last]]
        self._units, self._root, self._columns, self._here = units, feed.manifest.root, feed.columns, here
        self._spread, self._skip = feed.spread, feed.skip_bad > 0
        if not here:
            _ray_data()  # imported and set up on this thread, before the read's own starts
        self._thread = threading.Thread(target=self._run, name=f"baton-read-{epoch}-{first}",
                                        daemon=True)
        self._thread.start()

    def _blocks(self) -> Iterator[tuple[list, int, Optional[tuple[str, bool]]]]:
        """(block references, rows, `bad`'s verdict) of each unit, in order."""
        import ray

        if self._here:
            for unit in self._units:
                table = read_marked(self._root, unit, self._columns)
                if self.cancelled:  # closed meanwhile: Ray may be gone, and ray.put would start it again
                    return
                yield [ray.put(table)], table.num_rows, bad(table)
            return
        bundles, executor = _execute(_read_units(self._root, self._units, self._columns, self._spread))
        with self._cond:
            self.executor, cancelled = executor, self.cancelled
        if cancelled:  # while the execution started: cancel() could not stop it, stopped here
            if executor is not None:
                executor.shutdown(force=True)
            return
        for bundle in bundles:
            rows = bundle.num_rows()  # 0: skipped (every unit has rows), its reason in the block
            why = bad(ray.get(bundle.block_refs[0])) if not rows and bundle.block_refs else None
            yield list(bundle.block_refs), rows, why

    def _run(self) -> None:
        try:
            for index, (refs, rows, verdict) in zip(range(self.first, self.last), self._blocks()):
                if self.cancelled:
                    break
                if verdict is not None and not (self._skip and verdict[1]):
                    # the read ends here, as at a failed task: the units before it are served,
                    # and whoever waits for this one gets the error (`wait_for`)
                    self.error = DataError(verdict[0])
                    self.cancel()
                    break
                with self._cond:
                    if verdict is not None:
                        self.bad[index] = verdict[0]
                    self.refs[index] = refs
                    self.rows += rows
                    self._cond.notify_all()
        except Exception as e:  # a read task failed: surfaced to whoever waits (wait_for)
            self.error = e
        finally:
            with self._cond:
                self.finished = True
                self._cond.notify_all()

    def wait_for(self, index: int) -> list:
        with self._cond:
            self._cond.wait_for(lambda: index in self.refs or self.finished)
            if index in self.refs:
                return self.refs[index]
        if self.error is not None:
            raise as_data_error(self.error)
        raise DataError(f"data.path: the data ended early: unit {index} was never read (did the "
                        "files change under it?)")

    def cancel(self) -> None:
        """Stop reading, without waiting: an execution still starting (Ray Data's first one
        returns with its first block: a read worker's start, seconds on a busy machine) is
        stopped by the thread once it has started."""
        with self._cond:
            self.cancelled, executor = True, self.executor
        if executor is not None and not self.finished:
            executor.shutdown(force=True)

    def join(self) -> None:
        """Wait for the thread (a read here ends within one row group, a stopped execution at
        once), so that it never calls Ray after the run has shut it down: Ray's calls start a
        new Ray when there is none (ray.init by its auto-init), which a fault test's cluster
        then refused to shut down under (seen in CI: Ray Data's executor, stopped, cancelling
        its tasks after the test's ray.shutdown)."""
        self._thread.join(timeout=60)


class DataFeed:
    """Batches for the coordinator. Reads, one block at a time and one block ahead, the units
    from the first one the current batch may need; a batch behind what it holds (a recovery
    that resumes in an earlier block), in another epoch, or ahead of it restarts the reads
    there. Across an epoch's end too: once at most half a block (or one batch) of the epoch
    remains, the next epoch's first block is read, so its first batch does not wait for a read.

    A recovery keeps every read, so a world that resumes in the block it was training on reads
    nothing again: a block a lost node took along is rebuilt by Ray from its read task
    (`_read_units`), the rest are where they were. It used to stop the current epoch's reads,
    and the first batch after a recovery then read its block again: 0.4-0.8 s of the first
    step, the largest phase of a recovery served by a warm spare."""

    def __init__(self, manifest: Manifest, order: EpochOrder, columns: Columns, spread: bool = True,
                 skip_bad: int = 0):
        self.manifest, self.order, self.columns, self.spread = manifest, order, columns, spread
        # data.skip_bad_row_groups: how many units whose rows are bad may be left out (one left
        # out again in a later epoch is no new one); those left out, and the events not told yet
        self.skip_bad = skip_bad
        self.skipped: set[int] = set()
        self.untold: list[dict] = []
        self.epoch: Optional[int] = None
        self.reads: list[_Read] = []  # consecutive, in the epoch's unit order
        self.next_epoch: Optional[_Read] = None  # the next epoch's first block, read ahead
        self.dropped_below = 0  # units below this index are let go
        self.ranges_read: list[tuple[int, int, int]] = []  # (epoch, first, last) of every read
        self._rows_done = 0  # rows of reads already let go
        self._stopping: list[_Read] = []  # cancelled, their threads perhaps still running

    @staticmethod
    def cursor() -> Cursor:
        """Where a run starts in this feed's order."""
        return Cursor()

    @staticmethod
    def rebased(meta: dict) -> dict:
        """The cursor of checkpoint `meta` moved onto another corpus (order.rebased)."""
        return rebased(meta["cursor"])

    @staticmethod
    def enter(cursor: Cursor, step: int) -> None:
        """One corpus has no phases (a mix's do: `MixedFeed.enter`)."""
        return None

    @property
    def rows_read(self) -> int:
        """Rows of the units read so far by the current reads: what a seek costs."""
        ahead = [self.next_epoch] if self.next_epoch else []
        return self._rows_done + sum(r.rows for r in self.reads + ahead)

    def prime(self, cursor: Cursor, global_batch: int) -> None:
        """Read (and check) the units of the batch at `cursor` now: bad rows there are
        refused before the run has written anything."""
        self._hold(cursor.epoch, *self._span(cursor, global_batch))

    def next_batch(self, cursor: Cursor, global_batch: int, one_epoch: bool = False) -> Batch:
        """The next `global_batch` samples at `cursor` (fewer at the epoch's end), advancing
        it. With `skip_bad`, a bad unit's rows are left out and the batch is filled from the
        samples after them, within the epoch (into the next only if none is left, and never
        with `one_epoch`: a held-out pass's last batch may then hold none)."""
        epoch = cursor.epoch
        batch = self._draw(cursor, global_batch)
        while len(batch) < global_batch and self.skip_bad and (cursor.consumed or not len(batch)) \
                and not (one_epoch and cursor.epoch != epoch):
            more = self._draw(cursor, global_batch - len(batch))
            batch = Batch(np.concatenate([batch.positions, more.positions]),
                          {**batch.units, **more.units}, more.window)
        return batch

    def _draw(self, cursor: Cursor, global_batch: int) -> Batch:
        epoch = cursor.epoch
        held = self._hold(epoch, *self._span(cursor, global_batch))
        positions = self.order.next_batch(cursor, global_batch)
        perm = self.order.unit_order(epoch)[0]
        by_uid = {int(perm[i]): refs for i, refs in held.items()}
        uids = self.manifest.unit_of(positions)
        left_out = self._left_out(epoch, perm, set(np.unique(uids).tolist()))
        if left_out:
            kept = ~np.isin(uids, list(left_out))
            positions, uids = positions[kept], uids[kept]
        units = {}
        for uid in np.unique(uids).tolist():
            units[uid] = (self.manifest.units[uid].offset, by_uid[uid])
        return Batch(positions, units, frozenset(by_uid))

    def _left_out(self, epoch: int, perm: np.ndarray, uids: set[int]) -> set[int]:
        """Which of `uids` (of this batch) hold bad rows; each new one told (`untold`), or the
        run stopped past `skip_bad` of them."""
        found = {int(perm[index]): why for read in self.reads for index, why in read.bad.items()}
        for uid in sorted(uids & found.keys()):
            if uid in self.skipped:
                continue
            self.skipped.add(uid)
            if len(self.skipped) > self.skip_bad:
                raise DataError(f"{found[uid]} ({len(self.skipped)} row groups with bad rows, "
                                f"more than data.skip_bad_row_groups ({self.skip_bad}))")
            self.untold.append({"epoch": epoch, "unit": uid, "rows": self.manifest.units[uid].rows,
                                "why": found[uid], "skipped": len(self.skipped),
                                "limit": self.skip_bad})
        return uids & found.keys()

    def take_skipped(self) -> list[dict]:
        """The units left out since the last call, once each (`_left_out`)."""
        told, self.untold = self.untold, []
        return told

    def _span(self, cursor: Cursor, global_batch: int) -> tuple[int, int]:
        stop = min(cursor.consumed + global_batch, self.order.num_samples)
        if self.next_epoch is None and \
                self.order.num_samples - stop <= max(self.order.block_size // 2, global_batch):
            epoch = cursor.epoch + 1
            self.next_epoch = _Read(self, epoch, 0, self.order.block_units(epoch, 0)[1])
        return self.order.units_for(cursor.epoch, cursor.consumed, stop)

    def _hold(self, epoch: int, first: int, last: int) -> dict[int, list]:
        """Make sure units [first, last) are read (waiting for them), the next block's read
        has started, and nothing before `first` is held; return what is held."""
        start = self.reads[0].first if self.reads else None
        end = self.reads[-1].last if self.reads else None
        if epoch != self.epoch or start is None or first < max(start, self.dropped_below) or first > end:
            self._restart(epoch, first)
        self.dropped_below = first
        while self.reads and self.reads[0].last <= first:
            self._rows_done += self.reads[0].rows
            self.reads.pop(0)
        ahead = min(last + 1, len(self.order.uids))  # the read after `last` starts now
        while self.reads[-1].last < ahead:
            k = self._block_of(epoch, self.reads[-1].last)
            self.reads.append(_Read(self, epoch, self.reads[-1].last, self.order.block_units(epoch, k)[1]))
        held = {}
        for read in self.reads:
            for index in range(max(read.first, first), read.last):
                if index < last:
                    held[index] = read.wait_for(index)
                elif index in read.refs:
                    held[index] = read.refs[index]
        return held

    def _block_of(self, epoch: int, index: int) -> int:
        """The block in which unit `index` of the epoch's order ends."""
        perm, starts = self.order.unit_order(epoch)
        end = starts[index] + self.order.unit_rows[perm[index]]
        return int((end - 1) // self.order.block_size)

    def _restart(self, epoch: int, first: int) -> None:
        ahead, self.next_epoch = self.next_epoch, None
        # the read-ahead is where the run goes on; or it is of the epoch after this one, and
        # stays that wherever in this epoch the run goes on (a recovery used to cancel it, and
        # wait for its first block to do so); or it is closed with the rest
        resumed = later = None
        if ahead is not None and ahead.epoch == epoch and ahead.first <= first < ahead.last:
            resumed = ahead
        elif ahead is not None and ahead.epoch == epoch + 1:
            later = ahead
        else:
            self.next_epoch = ahead
        self.close(wait=False)
        self.next_epoch = later
        if resumed is not None:
            self.reads = [resumed]
        else:
            k = self._block_of(epoch, first)
            self.reads = [_Read(self, epoch, first, self.order.block_units(epoch, k)[1], here=True)]
        self.epoch, self.dropped_below = epoch, first
        logging.getLogger(__name__).debug("data: reading epoch %d from unit %d", epoch, first)

    def close(self, wait: bool = True) -> None:
        """Stop every read. `wait`: for their threads too, as before Ray shuts down; a seek or
        a recovery goes on while a cancelled read that was still starting ends."""
        for read in self.reads + ([self.next_epoch] if self.next_epoch else []):
            read.cancel()
            self._rows_done += read.rows
            self._stopping.append(read)
        self.reads, self.next_epoch = [], None
        if wait:
            for read in self._stopping:
                read.join()
        self._stopping = [read for read in self._stopping if not read.finished]


def _execute(dataset) -> tuple[Iterator, object]:
    """The dataset's bundles and the executor producing them, to stop it when the feed seeks
    (Ray Data stops an executor when its iterator is exhausted; the public
    `iter_internal_ref_bundles` keeps no handle). Without the private call, the public one."""
    run = getattr(dataset, "_execute_to_iterator", None)
    if run is None:
        return iter(dataset.iter_internal_ref_bundles()), None
    bundles, _, executor = run(capture_executor=False)
    return iter(bundles), executor


def as_data_error(error: Exception) -> Exception:
    """A failed task (a text file that cannot be read: `text.py`; a read that failed in Ray) as
    one DataError line, without Ray's wrapping and traceback (Ray's RayTaskError(DataError) is
    a DataError too); other errors as they are. (The run's reads raise no DataError: they mark
    the unit, `read_marked`.)"""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    for line in lines:
        if "DataError:" in line:  # (the line of the task's own exception)
            return DataError(line.split("DataError:", 1)[1].strip()[:500])
    if isinstance(error, DataError):
        return DataError(lines[0][:500])
    if type(error).__module__.startswith("ray"):
        return DataError(f"data.path: reading failed: {lines[-1][:500]}")
    return error
