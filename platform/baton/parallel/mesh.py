"""All rank arithmetic, in one place. Nobody else computes a rank or splits a batch by hand.

Ranks are laid out pp-major: rank = pp_rank * dp + dp_rank, so the data-parallel group of a
stage is a contiguous block of ranks and each pipeline is a stride-dp column. Within a stage's
dp replicas, dp_rank = replica_group * dp_shard + shard: sharding (FSDP2, ZeRO) splits state
across the dp_shard ranks of one group and replicates it across the groups. That is torch's
row-major `DeviceMesh` of shape (pp, dp_replicate, dp_shard), which `device_mesh` builds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

AXES = ("pp", "dp_replicate", "dp_shard")


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    pp: int = 1
    dp_shard: int = 1  # ranks that split one replica's state (1: every worker holds it whole)

    def __post_init__(self) -> None:
        if self.dp < 1 or self.pp < 1 or self.dp_shard < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp} pp={self.pp} "
                             f"dp_shard={self.dp_shard}")
        if self.dp % self.dp_shard:
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

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

    def shard_of(self, rank: int) -> int:
        """Which shard of its stage's state a rank holds (0 when unsharded)."""
        return self.coords(rank)[0] % self.dp_shard

    def replica_groups(self) -> list[list[int]]:
        """Ranks that must hold identical parameters: for each stage and each shard, its
        copies across the replica groups (every dp rank of a stage, when unsharded)."""
        return [[self.rank(g * self.dp_shard + s, p) for g in range(self.dp_replicate)]
                for p in range(self.pp) for s in range(self.dp_shard)]

    def shard_groups(self, pp_rank: int = 0) -> list[list[int]]:
        """The sets of ranks that together hold one whole copy of a stage's sharded state."""
        return [[self.rank(g * self.dp_shard + s, pp_rank) for s in range(self.dp_shard)]
                for g in range(self.dp_replicate)]

    def device_mesh(self, device_type: str, timeout_s: float):
        """torch's DeviceMesh of (pp, dp_replicate, dp_shard) over the default process group
        (every rank must call it, in the same order). Every group the engines use comes
        from it: `mesh["dp_shard"]`, `mesh["dp_replicate", "dp_shard"]`, `mesh["pp"]`. Each
        group gets the job's collective timeout: torch gives a mesh's groups its default (30
        minutes on gloo), not the world's, and a collective whose peer is gone waits that long."""
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.distributed_c10d import _set_pg_timeout

        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard),
                                mesh_dim_names=AXES)
        for axis in AXES:
            _set_pg_timeout(timedelta(seconds=timeout_s), mesh[axis].get_group())
        return mesh

    def replica_part(self, batch_ids: np.ndarray, dp_rank: int) -> np.ndarray:
        """This replica's share of a global batch: contiguous and as even as possible, so a
        short last batch of an epoch is still covered exactly once."""
        return np.array_split(batch_ids, self.dp)[dp_rank]


def split_micro(ids: np.ndarray, num_micro: int) -> list[np.ndarray]:
    """Split one replica's samples into `num_micro` micro-batches (some may be empty)."""
    return np.array_split(ids, num_micro)
