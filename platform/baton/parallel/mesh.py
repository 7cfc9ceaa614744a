"""All rank arithmetic, in one place. Nobody else computes a rank or splits a batch by hand.

Ranks are laid out pp-major: rank = pp_rank * dp + dp_rank, so the data-parallel group of a
stage is a contiguous block of ranks and each pipeline is a stride-dp column.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pp: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1 or self.pp < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp} pp={self.pp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    def rank(self, dp_rank: int, pp_rank: int = 0) -> int:
        assert 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp
        return pp_rank * self.dp + dp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, pp_rank) of a global rank."""
        assert 0 <= rank < self.world_size
        return rank % self.dp, rank // self.dp

    def dp_group(self, pp_rank: int) -> list[int]:
        """Ranks that hold the same stage and average its gradients."""
        return [self.rank(d, pp_rank) for d in range(self.dp)]

    def pp_group(self, dp_rank: int) -> list[int]:
        """Ranks that form one pipeline, first stage first."""
        return [self.rank(dp_rank, s) for s in range(self.pp)]

    def replica_part(self, batch_ids: np.ndarray, dp_rank: int) -> np.ndarray:
        """This replica's share of a global batch: contiguous and as even as possible, so a
        short last batch of an epoch is still covered exactly once."""
        return np.array_split(batch_ids, self.dp)[dp_rank]


def split_micro(ids: np.ndarray, num_micro: int) -> list[np.ndarray]:
    """Split one replica's samples into `num_micro` micro-batches (some may be empty)."""
    return np.array_split(ids, num_micro)
