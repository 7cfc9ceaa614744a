"""`baton data check`: every row group of a job's data read and checked as a run reads it
(`feed.read_unit`: nulls, NaNs, lengths, classes and token ids, undecodable pages, files
missing where a read runs), before a long run meets one of them hours in. The footers are
checked first (`baton validate` does as much); the rows then by one Ray Data read task a row
group (`feed.unit_tasks`, as a run's reads), spread over the cluster's nodes, each returning
one line (the row group and what is wrong with it, or nothing) instead of its rows: the
whole corpus passes through the readers, never through the driver or the object store."""

from __future__ import annotations

from typing import Iterator

import pyarrow as pa

from baton.data.feed import Columns, _execute, _ray_data, read_unit, unit_tasks
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

    _ray_data()
    units = manifest.units
    bundles, _ = _execute(unit_tasks(units, lambda u, home: _checked(manifest.root, u, columns, home),
                                     spread))
    for bundle in bundles:
        for ref in bundle.block_refs:
            table = ray.get(ref)
            for uid, why in zip(table.column("uid").to_pylist(), table.column("why").to_pylist()):
                if why:
                    yield units[uid], why
