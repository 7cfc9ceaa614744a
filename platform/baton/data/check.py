"""`baton data check`: every row group of a job's data read and checked as a run reads it
(`feed.read_unit`: nulls, NaNs, lengths, classes and token ids, undecodable pages, files
missing where a read runs), before a long run meets one of them hours in. The footers are
checked first (`baton validate` does as much); the rows then by one Ray Data read task a row
group, spread over the cluster's nodes as a run's reads are, each returning one line (the
row group and what is wrong with it, or nothing) instead of its rows: the whole corpus passes
through the readers, never through the driver or the object store."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa

from baton.data.feed import Columns, _execute, _ray_data, read_unit
from baton.data.manifest import Manifest, Unit
from baton.errors import DataError


def _checked(root: str, unit: Unit, columns: Columns, home: str) -> pa.Table:
    """One row group read and checked: (its uid, what is wrong or "")."""
    try:
        read_unit(root, unit, columns, home)
        why = ""
    except DataError as e:
        why = str(e).splitlines()[0]
    return pa.table({"uid": [unit.uid], "why": [why]})


def bad_row_groups(manifest: Manifest, columns: Columns, spread: bool = True) -> Iterator[tuple[Unit, str]]:
    """Each row group of `manifest` whose rows a run would refuse, with why, in manifest
    order (as the reads end)."""
    import ray
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    from baton.data.feed import READ_CONCURRENCY

    ray_data = _ray_data()
    home = ray.get_runtime_context().get_node_id()
    root, units = manifest.root, manifest.units

    class Checks(Datasource):
        def estimate_inmemory_data_size(self):
            return None

        @property
        def supports_distributed_reads(self) -> bool:
            return spread

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None):
            return [ReadTask(lambda u=u: [_checked(root, u, columns, home)],
                             BlockMetadata(num_rows=1, size_bytes=None, exec_stats=None,
                                           input_files=(u.file,)))
                    for u in units]

    dataset = ray_data.read_datasource(Checks(), override_num_blocks=len(units), num_cpus=0,
                                       concurrency=min(READ_CONCURRENCY, len(units)))
    bundles, _ = _execute(dataset)
    for bundle in bundles:
        for ref in bundle.block_refs:
            table = ray.get(ref)
            for uid, why in zip(table.column("uid").to_pylist(), table.column("why").to_pylist()):
                if why:
                    yield units[uid], why
