"""A worker's side of the feed: the units its steps use, fetched from the object store once
and read without copying (on a node, every worker maps the same shared-memory block)."""

from __future__ import annotations

import numpy as np

from baton.data.feed import IDS, TOKENS, Batch


class UnitRows:
    def __init__(self, width: int):
        self.width = width  # tokens per row
        self.wanted: dict[int, tuple[int, list]] = {}  # uid -> (offset, refs) of the current step
        self.held: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # uid -> (ids, tokens)
        self._offsets = np.zeros(0, dtype=np.int64)
        self._uids = np.zeros(0, dtype=np.int64)

    def use(self, batch: Batch) -> None:
        """The units of the step about to run. Units fetched earlier stay while the feed holds
        them (`batch.window`); the rest are let go."""
        keep = batch.window | set(batch.units)
        self.wanted = {u: v for u, v in self.wanted.items() if u in keep} | batch.units
        self.held = {u: v for u, v in self.held.items() if u in keep}
        order = sorted(self.wanted, key=lambda u: self.wanted[u][0])
        self._uids = np.array(order, dtype=np.int64)
        self._offsets = np.array([self.wanted[u][0] for u in order], dtype=np.int64)

    def gather(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sample ids, tokens (n, width)) of these positions."""
        at = np.searchsorted(self._offsets, positions, side="right") - 1
        uids = self._uids[at]
        self._fetch(np.unique(uids).tolist())
        ids = np.empty(len(positions), dtype=np.int64)
        tokens = None
        for uid in np.unique(uids).tolist():
            mask = uids == uid
            local = positions[mask] - self.wanted[uid][0]
            unit_ids, unit_tokens = self.held[uid]
            if tokens is None:
                tokens = np.empty((len(positions), self.width), dtype=unit_tokens.dtype)
            ids[mask] = unit_ids[local] if unit_ids is not None else positions[mask]
            tokens[mask] = unit_tokens[local]
        if tokens is None:
            tokens = np.zeros((0, self.width), dtype=np.int64)
        return ids, tokens

    def _fetch(self, uids: list[int]) -> None:
        import ray

        missing = [u for u in uids if u not in self.held]
        if not missing:
            return
        refs = [ref for u in missing for ref in self.wanted[u][1]]
        tables = iter(ray.get(refs))
        for u in missing:
            parts = [next(tables) for _ in self.wanted[u][1]]
            self.held[u] = _arrays(parts, self.width)


def _arrays(parts: list, width: int) -> tuple:
    """(ids or None, tokens (rows, width)) of one unit's blocks, zero-copy where Arrow allows."""
    import pyarrow as pa

    table = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    tokens = table.column(TOKENS).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    ids = (table.column(IDS).to_numpy().astype(np.int64, copy=False)
           if IDS in table.column_names else None)
    return ids, tokens.reshape(-1, width)
