"""Which samples each step trains on: a deterministic per-epoch order and a cursor.

The order of epoch e is a pure function of (seed, e, the manifest's row-group sizes), with the
two-level shuffle of MosaicML streaming's `py1b`: the units (Parquet row groups) are permuted,
and the samples of that unit sequence are shuffled inside consecutive blocks of
`shuffle_block` samples. A block needs only the units it overlaps, so a reader holds about one
block at a time, and a cursor (epoch, samples consumed) maps straight to a block and the units
to read: a resume seeks instead of scanning. The order does not depend on the world size, so a
run resumed or resized at any dp continues exactly where it stopped and sees every sample once
per epoch. A corpus of at most `shuffle_block` samples is one block: a full permutation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class Cursor:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already trained on

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def rebased(state: dict) -> dict:
    """A cursor moved onto another corpus: positions of the old order mean nothing in the new
    one, so the run goes on from the start of the next epoch (of this one, if it had not begun)."""
    return {"epoch": int(state["epoch"]) + (int(state["consumed"]) > 0), "consumed": 0}


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(key))))


class EpochOrder:
    """`unit_rows`: rows of each unit in manifest order. Positions are manifest positions
    (unit offset + row). `uids`: the units the order covers (all of them by default; training
    leaves out those held out for evaluation), positions still those of the whole manifest."""

    def __init__(self, unit_rows: Sequence[int], seed: int, shuffle_block: int | None = None,
                 uids: Sequence[int] | None = None, shuffle: bool = True):
        self.unit_rows = np.asarray(unit_rows, dtype=np.int64)
        self.uids = (np.arange(len(self.unit_rows), dtype=np.int64) if uids is None
                     else np.asarray(uids, dtype=np.int64))
        self.num_samples = int(self.unit_rows[self.uids].sum())
        if self.num_samples < 1:
            raise ValueError("the dataset has no samples")
        self.seed, self.shuffle = seed, shuffle  # shuffle False: manifest order (evaluation)
        self.block_size = min(shuffle_block or self.num_samples, self.num_samples)
        self.offsets = np.concatenate([[0], np.cumsum(self.unit_rows)[:-1]])
        self._perms: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.block_size)

    def unit_order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """The units in this epoch's order, and where each starts in the unit sequence."""
        if epoch not in self._perms:
            perm = self.uids[_rng(self.seed, epoch).permutation(len(self.uids))] if self.shuffle \
                else self.uids
            starts = np.concatenate([[0], np.cumsum(self.unit_rows[perm])[:-1]])
            if len(self._perms) >= 2:  # this epoch and the next, which the feed reads ahead
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = (perm, starts)
        return self._perms[epoch]

    def block_units(self, epoch: int, block: int) -> tuple[int, int]:
        """[first, last) indices into the epoch's unit order of the units block `block` overlaps."""
        perm, starts = self.unit_order(epoch)
        a = block * self.block_size
        b = min(a + self.block_size, self.num_samples)
        ends = starts + self.unit_rows[perm]
        return int(np.searchsorted(ends, a, side="right")), int(np.searchsorted(starts, b, side="left"))

    def block(self, epoch: int, block: int) -> np.ndarray:
        """The positions of block `block` of epoch `epoch`, in training order."""
        key = (epoch, block)
        if key not in self._blocks:
            perm, starts = self.unit_order(epoch)
            a = block * self.block_size
            b = min(a + self.block_size, self.num_samples)
            first, last = self.block_units(epoch, block)
            pieces = []
            for i in range(first, last):
                u = perm[i]
                lo, hi = max(a - starts[i], 0), min(b - starts[i], self.unit_rows[u])
                pieces.append(self.offsets[u] + np.arange(lo, hi, dtype=np.int64))
            positions = np.concatenate(pieces)
            if len(self._blocks) >= 4:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[key] = positions[_rng(self.seed, epoch, 1, block).permutation(len(positions))] \
                if self.shuffle else positions
        return self._blocks[key]

    def positions(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions [start, stop) of epoch `epoch`'s order."""
        out, at = [], start
        while at < stop:
            k = at // self.block_size
            block = self.block(epoch, k)
            take = block[at - k * self.block_size: stop - k * self.block_size]
            out.append(take)
            at += len(take)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def units_for(self, epoch: int, start: int, stop: int) -> tuple[int, int]:
        """[first, last) in the epoch's unit order: the units that samples [start, stop) of
        the epoch may come from (every unit of the blocks they lie in)."""
        first = self.block_units(epoch, start // self.block_size)[0]
        last = self.block_units(epoch, (max(stop, start + 1) - 1) // self.block_size)[1]
        return first, last

    def next_batch(self, cursor: Cursor, global_batch: int) -> np.ndarray:
        """Positions of the next global batch; advances `cursor`. The last batch of an epoch
        is short rather than spilling into the next epoch."""
        stop = min(cursor.consumed + global_batch, self.num_samples)
        batch = self.positions(cursor.epoch, cursor.consumed, stop)
        cursor.consumed = stop
        if cursor.consumed >= self.num_samples:
            cursor.epoch, cursor.consumed = cursor.epoch + 1, 0
        return batch
