"""How a data-parallel worker holds its replica (`parallel.shard`), on torch's own machinery:

    none       DDP: every worker holds the whole replica (parameters, gradients, AdamW moments).
    optimizer  ZeRO-1: DDP, and the optimizer state split over the dp_shard ranks by torch's
               `ZeroRedundancyOptimizer` (each rank steps its share of the parameters and
               broadcasts them). FSDP2 has no level that shards only the optimizer, and
               ZeroRedundancyOptimizer is torch's own ZeRO-1 that composes with DDP.
    grads      ZeRO-2: FSDP2 `fully_shard` with `reshard_after_forward=False` (torch's
               SHARD_GRAD_OP): gradients and optimizer state sharded; parameters gathered once
               per step and kept whole from forward to backward.
    full       ZeRO-3: FSDP2 `fully_shard`, parameters resharded after each block's forward.

FSDP2 wraps each repeated block and then the root, over the mesh's (dp_replicate, dp_shard)
axes: with one replica group that is plain FSDP; with several (`parallel.shard_group`) it is
hybrid sharding, which keeps a whole copy of the state in every group. With context
parallelism the shard axis is dp_shard x cp (`mesh.sharding`): a replica's cp workers hold the
same parameters, so they split them as the dp_shard ranks do (torchtitan's "dp_shard_cp").

Each wrapping gives the engine the same few things (the module to run, the optimizer, a
context that skips gradient synchronisation, the state as name-keyed tensors to save and load),
so the engine's step is one piece of code whatever the level.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from baton.checkpoint import filter_optim_state, sharded
from baton.models import blocks
from baton.optim import average_pairs, fitted, keeps_average
from baton.parallel import comm
from baton.parallel.mesh import sharding
from baton.spec import TrainSpec
from baton.training import make_optimizer, optimizer_class, param_groups


Fill = Callable[[Iterable[nn.Module]], None]  # gives a model's layers their values (models/layers.py)
NAMES = {"none": "DDP", "optimizer": "ZeRO-1", "grads": "ZeRO-2", "full": "ZeRO-3"}
SHARDED_PARTS = {"none": (), "optimizer": ("optimizer",),
                 "grads": ("params", "grads", "optimizer"), "full": ("params", "grads", "optimizer")}


def estimate_bytes(num_params: int, level: str, shards: int, averaged: bool = False,
                   trained: Optional[int] = None) -> dict[str, float]:
    """Bytes of fp32 parameters, gradients and AdamW's two moments (and with `averaged`, the
    average of the weights: train.ema) one worker holds between steps at `level` over
    `shards` ranks (`grads` gathers whole parameters from forward to backward: its peak
    holds them whole). Gradients and optimizer state are those of the `trained` parameters
    only (default: all; model.lora's adapters, or what model.frozen leaves)."""
    trained = num_params if trained is None else trained
    whole = {"params": 4.0 * num_params, "grads": 4.0 * trained,
             "optimizer": (12.0 if averaged else 8.0) * trained}
    return {part: size / shards if part in SHARDED_PARTS[level] else size
            for part, size in whole.items()}


# The least fp32 parameter memory one FSDP unit gathers (parallel.shard_unit_mib's default):
# consecutive blocks smaller than this are grouped into one unit (FSDP2 takes a list of
# modules), so a small model pays a few collectives a micro-batch instead of a few per block;
# a block this large or larger is a unit of its own, as torchtitan wraps them. The idea of
# FSDP1's size-based wrap policy; measured in benchmarks/sharding.py (--unit-mibs).
UNIT_MIB = 16.0


def units(model: nn.Module, unit_mib: float = UNIT_MIB) -> list[list[nn.Module]]:
    """`blocks(model)` in groups of consecutive blocks, each group closed once it holds
    `unit_mib` of fp32 parameters (the last may hold less)."""
    out: list[list[nn.Module]] = []
    size = 0.0
    for block in blocks(model):
        if not out or size >= unit_mib:
            out.append([])
            size = 0.0
        out[-1].append(block)
        size += sum(p.numel() for p in block.parameters()) * 4 / 2**20
    return out


def wrap_problem(model: nn.Module, name: str) -> Optional[str]:
    """Why FSDP cannot wrap `model` unit by unit (None when it can)."""
    if len(blocks(model)) >= 2:
        return None
    return (f"model {name!r} (a {type(model).__name__}) has no repeated blocks for FSDP to "
            "wrap one at a time; return an nn.Sequential of layers or keep the blocks in an "
            "nn.ModuleList")


@dataclass
class Replica:
    """One worker's copy (or shard) of the model under a wrapping."""

    module: nn.Module  # parameters named as in the whole model (DTensors when sharded)
    wrapped: nn.Module  # what the forward runs
    optimizer: torch.optim.Optimizer
    no_sync: Callable[[], contextlib.AbstractContextManager]  # accumulate without reducing
    sharded: bool  # no worker holds the whole state: saved with torch.distributed.checkpoint
    state_dicts: Callable[[], tuple[dict, dict]]  # (model, optimizer state by name)
    load_full: Callable[[dict, dict], None]  # from whole name-keyed state (any checkpoint)
    # from a sharded checkpoint, at any layout (and `pieces`: the state as DCP is to see it,
    # where its tensors are not boxes of the whole: tensor parallelism's shares)
    load_sharded: Callable[..., None]  # (where, pieces=None)
    # drop what the gradient communication carries between steps (comm.forget), after a step
    # whose gradient was not finite
    forget_comm: Callable[[], None] = lambda: None
    # (weight, its average) for each parameter this worker holds that has one (train.ema),
    # local parts: the optimizer's own state, except where it holds only a share (ZeRO-1)
    averages: Optional[Callable[[], list]] = None

    def __post_init__(self):
        if self.averages is None:
            self.averages = lambda: average_pairs(self.optimizer)


def replicate(module: nn.Module, mesh, train: TrainSpec, device: torch.device,
              shard_optimizer: bool = False, grad_comm: str = "fp32", group=None,
              ignore: tuple[str, ...] = ()) -> Replica:
    """DDP over the stage's dp ranks (`group`: those of this worker's share, under tensor
    parallelism; None: the world); with `shard_optimizer`, ZeRO-1 over the dp_shard ranks.
    `ignore`: parameters DDP leaves alone (expert parallelism's experts, reduced apart)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    # DDP overlaps the gradient all-reduce with the backward pass (bucketed), and its
    # constructor broadcasts rank 0's parameters, so replicas start identical.
    # The data-parallel engine runs one stage (pp = 1): its dp group is the whole world. A
    # world of one runs the model itself: no wrapper, no all-reduce, nothing to keep in sync.
    alone = not shard_optimizer and dist.get_world_size(group) == 1
    module.to(device)  # every replica holds the whole model (or its share of each layer)
    if ignore:
        DDP._set_params_and_buffers_to_ignore_for_model(module, list(ignore))
    # Gradients are views into DDP's all-reduce buckets (`gradient_as_bucket_view`): without
    # it a worker holds every gradient twice at the backward's end, once in the buckets, and
    # copies between the two each step (benchmarks/ddp_memory.py, 19 M parameters: a peak 58
    # MiB lower, steps 15 % shorter, the losses bit for bit the same; docs/benchmarks.md)
    wrapped = module if alone else DDP(module, device_ids=[0] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True, process_group=group)
    state = None if alone else comm.register(wrapped, grad_comm)
    if not shard_optimizer:
        no_sync = contextlib.nullcontext if alone else wrapped.no_sync
        optimizer = make_optimizer(wrapped, train)
        return Replica(module, wrapped, optimizer, no_sync, False,
                       lambda: state_dicts(wrapped, optimizer),
                       lambda m, o: load_full(module, wrapped, optimizer, m, o),
                       lambda where, pieces=None: sharded.load_into(wrapped, optimizer, where, pieces),
                       lambda: comm.forget(state))
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls, kwargs = optimizer_class(train)
    optimizer = ZeroRedundancyOptimizer(param_groups(module, train), optimizer_class=cls,
                                        process_group=sharding(mesh).get_group(1), **kwargs)
    zero = _ZeroState(module, optimizer)
    return Replica(module, wrapped, optimizer, wrapped.no_sync, True, zero.state_dicts,
                   zero.load_full, zero.load_sharded, lambda: comm.forget(state), zero.averages)


def _shard_root(module: nn.Module, mesh, train: TrainSpec, reshard_after_forward: bool,
                unit_mib: float, grad_comm: str = "fp32", backward_follows: bool = True,
                fill: Optional[Fill] = None,
                ignore: Optional[Callable[[list], set]] = None) -> Optional[nn.Module]:
    """FSDP2 on each of `module`'s blocks, then on `module` itself as a root, over the dp
    axes of the mesh (of this rank's pipeline stage, when pp > 1).

    When the backward follows the forward at once (`backward_follows`: data parallelism, not a
    pipeline stage, whose backward comes micro-batches later), the last unit keeps its
    parameters whole after its forward even under ZeRO-3: the backward starts with it, so
    freeing them would only gather them again at once, with the peak unchanged (torchtitan
    does the same with its last block). Returns the first unit (a forward begins with it), or
    None for a module with no blocks (a pipeline stage may hold only an embedding or a head).

    `fill`: for a model on the meta device, gives a unit's layers their values just before it
    is sharded (models/layers.py): the host holds this worker's shards and one unit whole.
    `ignore`: the parameters of some modules FSDP is to leave whole and alone (expert
    parallelism's experts: parallel/experts.py), moved to the device here."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as shard

    dp_mesh = sharding(mesh)
    # bf16 compute with fp32 master weights (on CPU too, where train.precision: bf16 asks for
    # it); gradients reduced in fp32 unless parallel.grad_comm: bf16
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if train.precision == "bf16" else None,
                              reduce_dtype=comm.reduce_dtype(grad_comm))
    def alone(modules: list) -> Optional[set]:
        if ignore is None:
            return None
        found = ignore(modules)
        for q in found:  # (FSDP moves what it shards, not what it leaves alone)
            q.data = q.data.to(dp_mesh.device_type)
        return found

    groups = units(module, unit_mib)
    for i, group in enumerate(groups):
        last = backward_follows and i == len(groups) - 1
        if fill is not None:
            fill(group)
        shard(group if len(group) > 1 else group[0], mesh=dp_mesh,
              reshard_after_forward=reshard_after_forward and not last, mp_policy=mp,
              ignored_params=alone(group))
    # the root holds what no unit does; it is needed again at once by the backward
    if fill is not None:
        fill(module.children())
    shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp,
          ignored_params=alone([module]))
    if dist.get_backend(dp_mesh.get_group(1)) == "gloo":
        reduce_scatter = comm.fsdp_reduce_scatter()  # stateless: one for every unit
        for unit in [g[0] for g in groups] + [module]:  # a unit's blocks share one FSDP state
            unit.set_custom_reduce_scatter(reduce_scatter)
    return groups[0][0] if groups else None


def fully_shard(module: nn.Module, mesh, train: TrainSpec, device: torch.device,
                reshard_after_forward: bool, unit_mib: float = UNIT_MIB,
                grad_comm: str = "fp32", fill: Optional[Fill] = None,
                ignore: Optional[Callable[[list], set]] = None) -> Replica:
    """`module` as the host built it (or on the meta device, its units given their values by
    `fill` as they are sharded): FSDP2 moves each unit's parameters to the mesh's device as it
    shards that unit, so the device holds this worker's shards and at most one unit whole,
    never the whole model (moved first, as before, a model larger than one device could not be
    sharded across several)."""
    first = _shard_root(module, mesh, train, reshard_after_forward, unit_mib, grad_comm,
                        fill=fill, ignore=ignore)
    optimizer = make_optimizer(module, train)

    @contextlib.contextmanager
    def no_sync():
        """Accumulate a micro-batch's gradients unreduced; ZeRO-2 also keeps the parameters
        whole until the step's last micro-batch (one all-gather per step, not one per
        micro-batch). ZeRO-3 frees each unit after its backward, except the root and the
        first unit: the backward ends with them and the next micro-batch's forward begins
        with them, so freeing them would only gather them again at once, the peak unchanged
        (the mirror of keeping the last unit for the backward)."""
        module.set_requires_gradient_sync(False)
        module.set_reshard_after_backward(reshard_after_forward)
        module.set_reshard_after_backward(False, recurse=False)
        if first is not None:
            first.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
            module.set_reshard_after_backward(True)
    return Replica(module, module, optimizer, no_sync, True,
                   lambda: state_dicts(module, optimizer),
                   lambda m, o: load_full(module, module, optimizer, m, o, full=True),
                   lambda where, pieces=None: sharded.load_into(module, optimizer, where, pieces))


# `fill` (for the levels that shard parameters): see fully_shard. `group`: DDP's (tensor
# parallelism: the workers holding the same share); FSDP takes its groups from the mesh.
# `ignore`: what DDP leaves alone (names), or FSDP (a function of modules: their parameters).
WRAPPINGS: dict[str, Callable[..., Replica]] = {
    "none": lambda *a, unit_mib=None, grad_comm="fp32", fill=None, group=None, ignore=(): replicate(
        *a, grad_comm=grad_comm, group=group, ignore=ignore),
    "optimizer": lambda *a, unit_mib=None, grad_comm="fp32", fill=None, group=None: replicate(
        *a, shard_optimizer=True, grad_comm=grad_comm, group=group),
    "grads": lambda *a, unit_mib=UNIT_MIB, grad_comm="fp32", fill=None, group=None, ignore=None: fully_shard(
        *a, reshard_after_forward=False, unit_mib=unit_mib, grad_comm=grad_comm, fill=fill, ignore=ignore),
    "full": lambda *a, unit_mib=UNIT_MIB, grad_comm="fp32", fill=None, group=None, ignore=None: fully_shard(
        *a, reshard_after_forward=True, unit_mib=unit_mib, grad_comm=grad_comm, fill=fill, ignore=ignore),
}


def shard_stages(chunks: list[nn.Module], mesh, train: TrainSpec, reshard_after_forward: bool,
                 unit_mib: float = UNIT_MIB, grad_comm: str = "fp32",
                 ignore: Optional[Callable[[list], set]] = None) -> Callable[[int, bool], None]:
    """FSDP2 inside pipeline stages, as torchtitan does: each of this rank's chunks (its
    stages) is a root of its own over the stage's dp axes, its blocks wrapped one by one
    (`ignore`: as `_shard_root`'s). Returns `sync(chunk, last)`, which the pipeline runtime
    calls before each backward: gradients are reduced once per step, at each chunk's last
    backward, not once per micro-batch (and ZeRO-2 keeps parameters whole until then)."""
    for chunk in chunks:
        _shard_root(chunk, mesh, train, reshard_after_forward, unit_mib, grad_comm,
                    backward_follows=False, ignore=ignore)

    def sync(c: int, last: bool) -> None:
        chunks[c].set_requires_gradient_sync(last)
        chunks[c].set_reshard_after_backward(last or reshard_after_forward)
    return sync


def reshard(chunks: list[nn.Module]) -> None:
    """Free the whole parameters a forward left gathered (ZeRO-2 keeps them until a backward):
    each FSDP unit's, not only the root's."""
    from torch.distributed.fsdp import FSDPModule

    for chunk in chunks:
        for unit in chunk.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()


# the levels that compose with pipelines (ZeRO-1's ZeroRedundancyOptimizer steps through DDP)
STAGE_WRAPPINGS: dict[str, Callable[..., Optional[Callable[[int, bool], None]]]] = {
    "none": lambda *a, unit_mib=None, grad_comm="fp32", ignore=None: None,
    "grads": lambda *a, unit_mib=UNIT_MIB, grad_comm="fp32", ignore=None: shard_stages(
        *a, reshard_after_forward=False, unit_mib=unit_mib, grad_comm=grad_comm, ignore=ignore),
    "full": lambda *a, unit_mib=UNIT_MIB, grad_comm="fp32", ignore=None: shard_stages(
        *a, reshard_after_forward=True, unit_mib=unit_mib, grad_comm=grad_comm, ignore=ignore),
}


def state_dicts(wrapped: nn.Module, optimizer) -> tuple[dict, dict]:
    """Model and optimizer state keyed by parameter name (DTensor shards when sharded)."""
    fresh = not optimizer.state
    model_state, optim_state = get_state_dict(wrapped, optimizer)
    if fresh:
        # get_state_dict "initialises" an optimizer that never stepped with a zero-gradient
        # step (lr 0), leaving Adam's step count at 1: undo it here, and save the truth.
        optimizer.state.clear()
        optim_state = {"state": {}, "param_groups": optim_state["param_groups"]}
    return model_state, optim_state


def load_full(module: nn.Module, wrapped: nn.Module, optimizer, model_state: dict,
               optim_state: dict, full: bool = False) -> None:
    """Load whole name-keyed state; FSDP keeps each rank's shard of it (`full`)."""
    model_state = _mine(module, model_state)
    optim_state = fitted(optimizer, filter_optim_state(optim_state, set(model_state)))
    options = StateDictOptions(full_state_dict=full)
    if not optim_state["state"]:
        # An optimizer that never stepped (a checkpoint of step 0, taken before a resize).
        # set_state_dict would first "initialise" the optimizer with a zero-gradient step,
        # which leaves Adam's step count at 1 and skews every later bias correction; the
        # fresh optimizer is already the right one.
        set_model_state_dict(wrapped, model_state, options=options)
        return
    set_state_dict(wrapped, optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state, options=options)


def _mine(module: nn.Module, model_state: dict) -> dict:
    """The tensors of `model_state` that `module` holds; all of them must be there, a tensor
    held under two names (tied) under either (a checkpoint that leaves frozen weights out
    leaves out every name of one: checkpoint/frozen.py)."""
    from baton.models.frozen import ties

    mine, tied = list(module.state_dict()), ties(module)
    same = {**tied, **{first: name for name, first in tied.items()}}
    missing = [k for k in mine if k not in model_state and same.get(k) not in model_state]
    if missing:
        raise KeyError(f"the checkpoint lacks {len(missing)} of this stage's tensors, "
                       f"e.g. {missing[:3]}: it was written for another model")
    return {k: model_state[k] if k in model_state else model_state[same[k]] for k in mine}


class _ZeroState:
    """ZeRO-1's state by parameter name: the whole model (replicated) and this rank's share
    of the optimizer state (ZeroRedundancyOptimizer's own state_dict needs a consolidation
    on one rank first; by name, each rank saves and loads only its share)."""

    def __init__(self, module: nn.Module, optimizer):
        self.module, self.optimizer = module, optimizer
        self.names = {id(p): n for n, p in module.named_parameters()}

    def _local(self):
        return self.optimizer.optim  # the AdamW over this rank's parameters

    def state_dicts(self) -> tuple[dict, dict]:
        state = {self.names[id(p)]: dict(s) for p, s in self._local().state.items()}
        # sharded: only "state" is saved (through DCP); the groups come from the spec
        return dict(self.module.state_dict()), {"state": state, "param_groups": []}

    def load_full(self, model_state: dict, optim_state: dict) -> None:
        self.module.load_state_dict(_mine(self.module, model_state))
        local = self._local()
        local.state.clear()
        optim_state = fitted(local, optim_state)
        for group in local.param_groups:
            for p in group["params"]:
                saved = optim_state["state"].get(self.names[id(p)])
                if saved:  # absent: a checkpoint from before the first step
                    local.state[p] = {k: v.clone().to(p.device) if k != "step" else v.clone()
                                      for k, v in saved.items()}

    def averages(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, average) of every parameter that trains: each rank holds its share's
        averages (train.ema), and the ranks broadcast them to one another (a parameter
        without one, never stepped, sends its weights: they are their own average)."""
        zero, out = self.optimizer, []
        for p, owner in zero._param_to_rank.items():
            mine = zero.optim.state[p].get("ema") if owner == zero.rank else None
            average = (mine if mine is not None else p.detach()).clone() if owner == zero.rank \
                else torch.empty_like(p)
            dist.broadcast(average, src=dist.get_global_rank(zero.process_group, owner),
                           group=zero.process_group)
            out.append((p.detach(), average))
        return out

    def load_sharded(self, where: sharded.Location, pieces=None) -> None:
        """The whole model, and this rank's share of the optimizer state, from a sharded
        checkpoint written at any layout (`pieces`: `Replica.load_sharded`)."""
        # the parameters: loaded in place (less those the checkpoint leaves out: as built)
        state: dict = {"model": sharded.present(where, dict(self.module.state_dict()))}
        local = self._local()
        params = [p for g in local.param_groups for p in g["params"]]
        with_optim = sharded.has_optimizer_state(where)
        if with_optim:
            moments = ("exp_avg", "exp_avg_sq") + (("ema",) if keeps_average(local) else ())
            state["optim"] = sharded.held(where, {
                self.names[id(p)]: {"step": torch.zeros(()),
                                    **{k: torch.zeros_like(p) for k in moments}}
                for p in params})
        sharded.load(pieces(state) if pieces else state, where)
        local.state.clear()
        for p in params if with_optim else ():
            local.state[p] = state["optim"][self.names[id(p)]]
