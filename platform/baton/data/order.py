"""Which samples each step trains on: a deterministic per-epoch order and a cursor.

The order of epoch e is a permutation drawn from (seed, e) alone, independent of the world size,
and the cursor (epoch, samples consumed) says where in it the run stands. So a run resumed at any
world size continues exactly where it stopped and sees every sample once per epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Cursor:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch already trained on

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class EpochOrder:
    def __init__(self, num_samples: int, seed: int):
        if num_samples < 1:
            raise ValueError("the dataset has no samples")
        self.num_samples = num_samples
        self.seed = seed
        self._cached: tuple[int, np.ndarray] | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
            self._cached = (epoch, rng.permutation(self.num_samples))
        return self._cached[1]

    def next_batch(self, cursor: Cursor, global_batch: int) -> np.ndarray:
        """Row positions of the next global batch; advances `cursor`. The last batch of an
        epoch is short rather than spilling into the next epoch."""
        perm = self.permutation(cursor.epoch)
        batch = perm[cursor.consumed:cursor.consumed + global_batch]
        cursor.consumed += len(batch)
        if cursor.consumed >= self.num_samples:
            cursor.epoch, cursor.consumed = cursor.epoch + 1, 0
        return batch
