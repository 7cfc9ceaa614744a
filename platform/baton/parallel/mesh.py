"""All rank arithmetic, in one place. Nobody else computes a rank or splits a batch by hand.

Ranks are laid out pp-major, tp-minor: rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp
+ tp_rank, so the tp workers that split one replica's layers (tensor parallelism) and the cp
workers that split its rows' sequence (context parallelism) are neighbours (on one node, where
they fit: their collectives run in every layer), the data-parallel ranks of a stage are
a contiguous block and each pipeline is a column. With tp = cp = 1, rank = pp_rank * dp + dp_rank.
Within a stage's dp replicas, dp_rank = replica_group * dp_shard + shard: sharding (FSDP2,
ZeRO) splits state across the dp_shard ranks of one group and replicates it across the
groups; with context parallelism it splits it over each of those ranks' cp workers too
(`sharded_cp`: torchtitan's dp_shard x cp), whose parameters are otherwise copies. That is
torch's row-major `DeviceMesh` of shape (pp, dp_replicate, dp_shard, cp, tp), which
`device_mesh` builds (without the cp and tp axes where they are 1).
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
    tp: int = 1  # workers that split each layer of a replica (tensor parallelism)
    cp: int = 1  # workers that split each row's sequence (context parallelism)
    sharded_cp: bool = False  # the state split over the cp workers too (ZeRO with cp > 1)

    def __post_init__(self) -> None:
        if min(self.dp, self.pp, self.dp_shard, self.tp, self.cp) < 1:
            raise ValueError(f"parallel degrees must be >= 1, got dp={self.dp} pp={self.pp} "
                             f"dp_shard={self.dp_shard} tp={self.tp} cp={self.cp}")
        if self.dp % self.dp_shard:
            raise ValueError(f"dp_shard={self.dp_shard} must divide dp={self.dp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def per_replica(self) -> int:
        """Workers that hold one replica between them: its stages, each split tp ways, its
        rows cp ways."""
        return self.pp * self.cp * self.tp

    @property
    def dp_replicate(self) -> int:
        return self.dp // self.dp_shard

    def rank(self, dp_rank: int, pp_rank: int = 0, tp_rank: int = 0, cp_rank: int = 0) -> int:
        assert 0 <= dp_rank < self.dp and 0 <= pp_rank < self.pp and 0 <= tp_rank < self.tp
        assert 0 <= cp_rank < self.cp
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, pp_rank) of a global rank."""
        assert 0 <= rank < self.world_size
        rank //= self.tp * self.cp
        return rank % self.dp, rank // self.dp

    def tp_rank(self, rank: int) -> int:
        """Which part of each of its layers a rank holds (0 without tensor parallelism)."""
        return rank % self.tp

    def cp_rank(self, rank: int) -> int:
        """Which part of each row's sequence a rank computes (0 without context parallelism)."""
        return rank // self.tp % self.cp

    def dp_group(self, pp_rank: int, tp_rank: int = 0) -> list[int]:
        """Ranks that hold the same stage (the same part of its layers) and average its
        gradients."""
        return [self.rank(d, pp_rank, tp_rank) for d in range(self.dp)]

    def pp_group(self, dp_rank: int, tp_rank: int = 0, cp_rank: int = 0) -> list[int]:
        """Ranks that form one pipeline (of one share of each stage, on one part of each
        row's positions), first stage first."""
        return [self.rank(dp_rank, s, tp_rank, cp_rank) for s in range(self.pp)]

    def tp_group(self, dp_rank: int, pp_rank: int = 0) -> list[int]:
        """Ranks that split the layers of one replica's stage between them."""
        return [self.rank(dp_rank, pp_rank, t) for t in range(self.tp)]

    def part_of(self, rank: int) -> tuple[int, int, int]:
        """Which part of a replica's state a rank holds: (its stage, its shard of that stage,
        its share of the stage's layers). Ranks that hold the same part hold copies of it."""
        dp_rank, pp_rank = self.coords(rank)
        shard = dp_rank % self.dp_shard
        if self.sharded_cp:
            shard = shard * self.cp + self.cp_rank(rank)
        return pp_rank, shard, self.tp_rank(rank)

    @property
    def shards(self) -> int:
        """Workers that split one copy of a stage's state (of one share of its layers)."""
        return self.dp_shard * (self.cp if self.sharded_cp else 1)

    @property
    def parts(self) -> int:
        """How many parts one replica's state is held in (`part_of`)."""
        return self.pp * self.shards * self.tp

    def replica_groups(self) -> list[list[int]]:
        """Ranks that must hold identical parameters: those that hold the same part
        (`part_of`), for each stage, each shard and each share of its layers in turn (every
        dp rank of a stage, when unsharded and whole; its cp workers too, unless they split
        the state)."""
        groups: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            groups.setdefault(self.part_of(rank), []).append(rank)
        return [groups[part] for part in sorted(groups)]

    def device_mesh(self, device_type: str, timeout_s: float):
        """torch's DeviceMesh of (pp, dp_replicate, dp_shard), and cp and tp where > 1, over the
        default process group (every rank must call it, in the same order). Every group the
        engines use comes from it: `mesh["pp"]`, with cp `mesh["cp"]`, and with tp
        `mesh["tp"]`; with either, `axis(mesh, "dp")` (both dp axes flattened), with both
        "dp_cp" (and the cp axis: the ranks holding one share whose gradients DDP sums); the
        sharding's (`sharding`) and with `sharded_cp` the flattened "dp_shard_cp"; a
        rank's group along an axis holds the ranks that differ from it only there (its dp
        group: those holding the same share of its stage). Each
        group gets the job's collective timeout: torch gives a mesh's groups its default (30
        minutes on gloo), not the world's, and a collective whose peer is gone waits that long."""
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.distributed_c10d import _set_pg_timeout

        split = [(name, n) for name, n in (("cp", self.cp), ("tp", self.tp)) if n > 1]
        axes = AXES + tuple(name for name, _ in split)
        shape = (self.pp, self.dp_replicate, self.dp_shard) + tuple(n for _, n in split)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=axes)
        if split:  # every dp rank of a stage's share, sharded or not (tp: DDP's group)
            mesh["dp_replicate", "dp_shard"]._flatten("dp")
            axes += ("dp",)
        if self.cp > 1 and (self.tp > 1 or self.pp > 1):  # with their cp workers: DDP's group
            # under tp, a pipeline stage's replicas' summing the gradients
            mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
            axes += ("dp_cp",)
        if self.sharded_cp:  # the workers that split a copy of the state
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            axes += ("dp_shard_cp",)
        for name in axes:
            _set_pg_timeout(timedelta(seconds=timeout_s), axis(mesh, name).get_group())
        return mesh

    def replica_part(self, batch_ids: np.ndarray, dp_rank: int) -> np.ndarray:
        """This replica's share of a global batch: contiguous and as even as possible, so a
        short last batch of an epoch is still covered exactly once."""
        return np.array_split(batch_ids, self.dp)[dp_rank]


def split_micro(ids: np.ndarray, num_micro: int) -> list[np.ndarray]:
    """Split one replica's samples into `num_micro` micro-batches (some may be empty)."""
    return np.array_split(ids, num_micro)


def axis(mesh, name: str):
    """`mesh[name]`, but a flattened axis ("dp") as the root mesh keeps it: sliced out of the
    root, torch 2.13 warns that this "will be deprecated" and the warning reached the console
    of every tensor-parallel `baton run`, once per worker (Ray forwards workers' stderr)."""
    flattened = getattr(mesh, "_flatten_mapping", {})
    return flattened[name] if name in flattened else mesh[name]


def joined(mesh, names: tuple[str, ...], timeout_s: float):
    """The ranks that differ only along the axes `names` as one axis (`mesh[name]` where one),
    its group given the job's collective timeout as `ParallelDims.device_mesh`'s are. Every
    rank must call it, in the same order."""
    if len(names) == 1:
        return mesh[names[0]]
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    joined = mesh[names]._flatten("_".join(names))
    _set_pg_timeout(timedelta(seconds=timeout_s), joined.get_group())
    return joined


def sharding(mesh):
    """The 2-D mesh (replicas, shards) that a stage's state is sharded over: (dp_replicate,
    dp_shard), or with `sharded_cp` (dp_replicate, dp_shard x cp). Its group along dimension 1
    holds the workers that split one copy (ZeRO-1's, FSDP's reduce-scatter). Put together from
    the root's axes, not sliced out of it by a flattened name (torch 2.13 warns of that:
    `axis`)."""
    from torch.distributed.device_mesh import DeviceMesh

    flattened = getattr(mesh, "_flatten_mapping", {})
    if "dp_shard_cp" in flattened:
        return DeviceMesh._concatenate([mesh["dp_replicate"], flattened["dp_shard_cp"]])
    return mesh["dp_replicate", "dp_shard"]
