"""Expert parallelism (`parallel.ep`): each mixture of experts' experts split over a group of
ep data-parallel replicas, the rest of the model replicated as under DDP.

Ranks are grouped as sharding groups them (`ParallelDims.dp_shard` is ep: the mesh's
"dp_shard" axis is a group, "dp_replicate" the ranks that hold the same experts in the other
groups). Within a group, rank i holds experts [i E/ep, (i+1) E/ep) of each block, under their
whole model's names (the others are empty placeholders), so checkpoints are the whole
model's, by name, and load at any layout.

A block routes its own tokens (its replica's rows) as a whole model would, then sends each
(token, choice) pair to the holder of its expert and gets the expert's output back: two
all-to-alls of the activations a block (and one of the counts, read to the host), each
differentiable (its backward is the all-to-all the other way), so an expert's gradient holds
the contributions of every token of the group that chose it. The experts' gradients are then
summed over the ranks that hold the same experts (the engine's `comm.FlatGrads` over the
mesh's dp_replicate), the rest by DDP, which leaves them out (`held`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class ExpertParallel:
    group: object  # the ranks that split the experts between them (the mesh's dp_shard)
    rank: int  # this rank's place in it
    size: int

    def first(self, experts: int) -> int:
        """The first of a block's `experts` this rank holds (it holds experts / size)."""
        return self.rank * (experts // self.size)

    def run(self, x: torch.Tensor, load: torch.Tensor, counts: list[int],
            experts: nn.ModuleList) -> torch.Tensor:
        """The experts' outputs for `x`, this rank's (token, choice) pairs grouped by expert
        (`counts[e]` of expert e, in the experts' order; `load`, the same on the device), in
        x's order: each group sent to
        its expert's holder, run there with every other rank's for the same expert, and sent
        back."""
        # (differentiable: its backward is the all-to-all the other way; torchtitan's too)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        per = len(counts) // self.size
        send = [sum(counts[r * per:(r + 1) * per]) for r in range(self.size)]
        # got[s][j]: how many pairs rank s sends for this rank's j-th expert
        theirs = torch.empty_like(load)
        dist.all_to_all_single(theirs, load, group=self.group)
        got = theirs.view(self.size, per).tolist()
        recv = [sum(row) for row in got]
        y = all_to_all_single_autograd(x, recv, send, self.group)
        chunks = y.split([n for row in got for n in row])  # by source, then expert
        first = self.first(len(counts))
        outs = [experts[first + j](torch.cat([chunks[s * per + j] for s in range(self.size)]))
                for j in range(per)]  # each expert once, on every rank's pairs for it
        parts = [out.split([got[s][j] for s in range(self.size)]) for j, out in enumerate(outs)]
        back = torch.cat([parts[j][s] for s in range(self.size) for j in range(per)])
        return _waited(all_to_all_single_autograd(back, send, recv, self.group))


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited for: a plain tensor (eager, it is torch's
    `AsyncCollectiveTensor`, which a pipeline stage's count of the activations autograd saves
    cannot read the storage of; traced, it is plain already), its gradient flowing through."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def split(model: nn.Module, ep: ExpertParallel) -> list[tuple[str, nn.Parameter]]:
    """Keep this rank's experts of each of `model`'s mixtures (`models.routed`), each told
    `ep`; the parameters it keeps of them, by name (which DDP leaves to the engine)."""
    from baton.models import routed

    for block in routed(model):
        block.split_experts(ep)
    return held(model)


def held_in(modules) -> set[nn.Parameter]:
    """The experts' parameters of `modules` (what FSDP2 is to leave alone: `ignore`)."""
    return {q for m in modules for _, q in held(m)}


def held(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The experts' parameters `model` holds (a mixture's routed experts, not its router or
    shared expert), by name."""
    return [(name, q) for name, q in model.named_parameters() if ".experts." in f".{name}"]
