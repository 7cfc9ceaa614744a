"""A worker's side of the feed: the units its steps use, fetched from the object store once
and read without copying (on a node, every worker maps the same shared-memory block)."""

from __future__ import annotations

import numpy as np

from baton.data.feed import IDS, Batch


class UnitRows:
    def __init__(self, shapes: dict):
        self.shapes = shapes  # column -> (row shape, torch dtype): what a batch holds
        self.wanted: dict[int, tuple[int, list]] = {}  # uid -> (offset, refs) of the current step
        self.held: dict[int, tuple] = {}  # uid -> (ids or None, {column: rows})
        self._offsets = np.zeros(0, dtype=np.int64)
        self._uids = np.zeros(0, dtype=np.int64)

    def use(self, batch: Batch) -> None:
        """The units of the step about to run. Units fetched earlier stay while the feed holds
        them (`batch.window`); the rest are let go."""
        keep = batch.window | set(batch.units)
        self.wanted = {u: v for u, v in self.wanted.items() if u in keep}
        for u, (offset, refs) in batch.units.items():
            if refs is not None:
                self.wanted[u] = (offset, refs)
            elif u not in self.wanted:  # the coordinator's `UnitsSent` and this disagree
                raise RuntimeError(f"the batch names unit {u} as held, and this worker does not hold it")
        self.held = {u: v for u, v in self.held.items() if u in keep}
        order = sorted(self.wanted, key=lambda u: self.wanted[u][0])
        self._uids = np.array(order, dtype=np.int64)
        self._offsets = np.array([self.wanted[u][0] for u in order], dtype=np.int64)

    def gather(self, positions: np.ndarray) -> tuple[np.ndarray, dict]:
        """(sample ids, {column: rows}) of these positions."""
        at = np.searchsorted(self._offsets, positions, side="right") - 1
        uids = self._uids[at]
        self._fetch(np.unique(uids).tolist())
        ids = np.empty(len(positions), dtype=np.int64)
        out: dict[str, np.ndarray] = {}
        for uid in np.unique(uids).tolist():
            mask = uids == uid
            local = positions[mask] - self.wanted[uid][0]
            unit_ids, unit_columns = self.held[uid]
            ids[mask] = unit_ids[local] if unit_ids is not None else positions[mask]
            for name, rows in unit_columns.items():
                if name not in out:
                    out[name] = np.empty((len(positions), *rows.shape[1:]), dtype=rows.dtype)
                out[name][mask] = rows[local]
        return ids, out

    def _fetch(self, uids: list[int]) -> None:
        import ray

        missing = [u for u in uids if u not in self.held]
        if not missing:
            return
        refs = [ref for u in missing for ref in self.wanted[u][1]]
        tables = iter(ray.get(refs))
        for u in missing:
            parts = [next(tables) for _ in self.wanted[u][1]]
            self.held[u] = _arrays(parts, self.shapes)


def _arrays(parts: list, shapes: dict) -> tuple:
    """(ids or None, {column: rows}) of one unit's blocks, zero-copy where Arrow allows."""
    import pyarrow as pa

    table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    columns = {}
    for name, (shape, _) in shapes.items():
        column = table.column(name).combine_chunks()
        values = column.flatten() if shape else column
        columns[name] = values.to_numpy(zero_copy_only=False).reshape(len(column), *shape)
    ids = (table.column(IDS).to_numpy().astype(np.int64, copy=False)
           if IDS in table.column_names else None)
    return ids, columns
