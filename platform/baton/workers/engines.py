"""How a worker trains its part of the model: a replica (whole under DDP, or sharded: ZeRO-1,
-2 or -3, `parallel/sharding.py`) when pp = 1, or one pipeline rank's stages run by a schedule
(pp > 1). All take the same micro-batches and give the same numbers as one process training
the whole model on the whole batch."""

from __future__ import annotations

import contextlib
import math
import time
from collections import OrderedDict
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from baton.checkpoint import sharded
from baton.errors import WorkerError
from baton.models import build_lazily, build_model, routed, sequential
from baton.models.documents import attend_within, attending
from baton.optim import average_pairs, averages_in
from baton.parallel import ParallelDims
from baton.parallel import comm, experts
from baton.parallel import schedule as sched
from baton.parallel.activations import checkpoint_activations
from baton.parallel.compiled import compile_blocks
from baton.parallel.context import SequenceSplit
from baton.parallel.mesh import axis, joined, sharding
from baton.parallel.partition import bounds
from baton.parallel.pipeline import PipelineRuntime
from baton.parallel.sharding import (SHARDED_PARTS, STAGE_WRAPPINGS, WRAPPINGS, load_full, reshard,
                                     state_dicts)
from baton.spec import JobSpec
from baton.tasks import VALID, Counts, SequencePart, Sums, Task, example_inputs, to_device
from baton.tracking.profile import profiled
from baton.parallel import tensor
from baton.training import clip_grads, local, make_optimizer, scale_to_norm, set_lr

BatchFn = Callable[..., dict]  # (rows, pad_to=None) -> the task's batch (tensors, VALID)


class Stopwatch:
    """Seconds of a worker's own computation, summed over `timed()` spans until `read()`: on
    the host clock, or on a GPU between CUDA events recorded on the stream, read after the
    step's one synchronisation (its loss read), so timing adds no wait."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list = []
        self.host_s = 0.0

    @contextlib.contextmanager
    def timed(self):
        if self.cuda:
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.host_s += time.perf_counter() - t0

    def read(self) -> float:
        total = self.host_s + sum(start.elapsed_time(end) for start, end in self.spans) / 1000
        self.spans, self.host_s = [], 0.0
        return total


class _Engine:
    module: nn.Module  # this worker's parameters, named as in the whole model
    optimizer: torch.optim.Optimizer
    sharded: bool = False  # state split across workers: checkpoints go through DCP
    own_random: Optional[tensor.OwnRandom] = None  # a tp worker's own stream (checkpointed)
    grad_bytes: int = 0  # this worker's gradients at its first step (local shards)
    # needs the step's scale (a loss mask's targets counted over the replicas): not a
    # pipeline's stages before the last, unless their mixture blocks add a load-balancing loss
    weighs_loss = True

    def replica_groups(self) -> list:
        """The groups whose sums, one after another, add up a number over every replica (each
        worker's from its own rows), this worker's part of the model alike: the world's."""
        return [None]

    def over_replicas(self, n: int) -> int:
        """`n` summed over the replicas (a collective of their workers that hold this one's
        part): a loss mask's targets, counted from each replica's rows."""
        total = torch.tensor(n, dtype=torch.int64, device=self.device)
        for group in self.replica_groups():
            dist.all_reduce(total, group=group)
        return int(total)

    def compute_s(self) -> Optional[float]:
        """Seconds of the last step that this worker computed without waiting for a peer
        (what its peers doing the same work are compared with: coordinator/stragglers.py), or
        None where every part of its step may wait for one (sharded parameters, tp)."""
        return None

    def apply(self, lr: float, skip_nonfinite: bool = False) -> torch.Tensor | float:
        """Clip, step, clear; returns the gradient norm before clipping (on a GPU, a tensor
        not yet computed: the caller reads it with the loss, one wait a step). With
        `skip_nonfinite` the norm is read first, and where it is not finite (a NaN or an
        infinity anywhere in the gradient: every worker holds the whole model's norm, so all
        decide alike) the step is skipped: parameters and optimizer state stay as they were."""
        grad_norm = self.clip()
        if not self.grad_bytes:  # the same every step of this world: measured once
            self.grad_bytes = sum(local(q.grad).nbytes for q in self.module.parameters()
                                  if q.grad is not None)
        if skip_nonfinite and not math.isfinite(float(grad_norm)):
            self.clear_grads()
            self.forget_comm()
            return grad_norm
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        self.clear_grads()
        return grad_norm

    def clear_grads(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def averaged(self) -> contextlib.AbstractContextManager:
        """Inside it, this worker's weights are their averages (train.ema); after it, as they were."""
        return averages_in(self.averages())

    def averages(self) -> list:
        return average_pairs(self.optimizer)

    def forget_comm(self) -> None:
        """Drop what the gradient communication carries between steps (PowerSGD's error
        feedback), after a step whose gradient was not finite. Nothing, but under DDP."""

    def layer_names(self) -> list[str]:
        return list(self.module._modules)

    def state_bytes(self) -> dict:
        """Bytes of parameters, gradients (at the last step) and optimizer state that this
        worker holds: its local shards, read from the live tensors."""
        optim = self.optimizer.optim if hasattr(self.optimizer, "optim") else self.optimizer
        return {"params": sum(local(q).nbytes for q in self.module.parameters()),
                "grads": self.grad_bytes,
                "optimizer": sum(local(t).nbytes for s in optim.state.values()
                                 for t in s.values() if torch.is_tensor(t))}


def _own_seed(spec: JobSpec, rank: int) -> int:
    """The seed of a tp worker's own random stream (`tensor.OwnRandom`): one per rank, apart
    from the process streams' (train.seed x 100,003 + the replica)."""
    return spec.train.seed * 1_000_003 + 7_919 * (rank + 1)


class DataParallelEngine(_Engine):
    """Data parallel replicas of the whole model (pp = 1), under DDP or sharded (ZeRO), each
    row's sequence split over parallel.cp workers of a replica where cp > 1
    (parallel/context.py: each computes its part of the positions, its attention over the
    whole sequence; the parameters' gradients summed over the replicas' cp workers too)."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, device: torch.device, task: Task):
        self.spec, self.device, self.task = spec, device, task
        self.per_row = task.per_sample  # (a whole row's loss terms, under cp too)
        self.bf16 = spec.train.precision == "bf16"
        self.dp, self.tp = spec.parallel.dp, dims.tp
        level = spec.parallel.shard
        self.mesh = (dims.device_mesh(device.type, spec.parallel.timeout_s)
                     if level != "none" or dims.tp > 1 or dims.dp_shard > 1 or dims.cp > 1 else None)
        # the ranks whose gradients are shards of one replica's (FSDP's levels)
        self.shard_group = (sharding(self.mesh).get_group(1) if "grads" in SHARDED_PARTS[level]
                            else None)
        self.split = None  # (context parallelism: each row's positions split over cp workers)
        if dims.cp > 1:
            self.split, self.task = _sequence_part(self.mesh, spec, task)
        # built on the host; the wrapping puts it on the device (sharded: unit by unit). With
        # its parameters sharded or split (tp), the model starts on the meta device and each
        # unit gets its values as FSDP shards it, or each layer as it is split, so the host
        # never holds the whole model (models/layers.py)
        self.module, fill = (build_lazily(spec.model, spec.train.seed)
                             if "params" in SHARDED_PARTS[level] or dims.tp > 1
                             else (build_model(spec.model, spec.train.seed), None))
        fill, wrapping = self._split(self.module, fill)
        checkpoint_activations(self.module, spec.train.activation_checkpointing)
        compile_blocks(self.module, _compiling(spec), device.type)
        self.replica = WRAPPINGS[level](self.module, self.mesh, spec.train, device,
                                        unit_mib=spec.parallel.shard_unit_mib,
                                        grad_comm=spec.parallel.grad_comm, fill=fill, **wrapping)
        self.wrapped, self.optimizer = self.replica.wrapped, self.replica.optimizer
        self.sharded = self.replica.sharded
        self.routed = routed(self.module)  # (a mixture of experts' blocks)
        # (under cp every row: each worker is told its part of the positions)
        self.attending = (attending(self.module) if self.split
                          else _attending(self.module, task, spec.model.name))
        # a forward waits for no peer where the parameters are whole and unsplit (DDP and
        # ZeRO-1 all-reduce in the backward; FSDP gathers, and tp all-reduces, in the forward)
        self.forwards = (Stopwatch(device) if "params" not in SHARDED_PARTS[level] and dims.tp == 1
                         and dims.cp == 1 else None)  # (cp: attention exchanges, all-to-all)
        # the workers DDP and FSDP average the gradients over (a replica's cp workers too)
        self.averaged_over = self.dp * dims.cp

    def compute_s(self) -> Optional[float]:
        return self.forwards.read() if self.forwards else None

    def replica_groups(self) -> list:
        # a replica's tp and cp workers read the same rows: their dp group, one worker of each
        # replica
        return [axis(self.mesh, "dp").get_group()] if self.tp > 1 or self.split else [None]

    def forget_comm(self) -> None:
        self.replica.forget_comm()

    def averages(self) -> list:
        return self.replica.averages()

    def _split(self, module: nn.Module, fill) -> tuple:
        """What a subclass does to the model before it is wrapped (tensor parallelism: keeps
        this worker's share of each layer, filling each as it splits it); the `fill` left for
        the wrapping, and extra arguments for it."""
        return fill, {}

    def state_dicts(self) -> tuple[dict, dict]:
        return self.replica.state_dicts()

    def load_state_dicts(self, model_state: dict, optim_state: dict) -> None:
        self.replica.load_full(model_state, optim_state)

    def load_sharded(self, where: sharded.Location) -> None:
        self.replica.load_sharded(where)

    def pieces(self, state: dict) -> dict:
        """A sharded state ({"model", "optim"}) as DCP is to save it: here each tensor is a
        box of the whole already (a DTensor's shard, or a plain tensor)."""
        return state

    def forward_backward(self, micro: list[np.ndarray], batch_fn: BatchFn, scale: float,
                         trace: bool) -> tuple[Sums, dict]:
        """Gradients of this replica's micro-batches, summed over the replicas; the loss sums
        (still on the device), and with `trace` the profile of it all (tracking/profile.py)."""
        sums, extra = Sums(), {}
        # a load-balancing loss summed over a micro-batch's rows weighs as its loss sum does,
        # a row as many terms as it has (models.routed)
        weight = scale * self.averaged_over * self.per_row
        with profiled(extra) if trace else contextlib.nullcontext():
            for i, rows in enumerate(micro):
                sync = i == len(micro) - 1
                with contextlib.nullcontext() if sync else self.replica.no_sync():
                    ls = self._loss(batch_fn, rows, sums, self.forwards, weight)
                    # DDP and FSDP average over the replicas' workers; this undoes it
                    (ls * scale * self.averaged_over).backward()
        return sums, extra

    def _loss(self, batch_fn: BatchFn, rows: np.ndarray, sums: Sums,
              watch: Optional[Stopwatch] = None, weight: Optional[float] = None) -> torch.Tensor:
        # every replica joins every collective: an empty micro-batch runs one padding row,
        # which the task leaves out (zero loss, zero gradient)
        batch = to_device(batch_fn(rows, pad_to=None if len(rows) else 1), self.device)
        for layer in self.routed:  # (which leave the padding row out too)
            layer.balance(batch[VALID], weight)
        if self.attending:  # (a backward follows at once: a recomputation sees these too)
            attend_within(self.attending, self.task.documents(batch))
        with watch.timed() if watch else contextlib.nullcontext():
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
                output = self.wrapped(self.task.inputs(batch))
            ls, metrics = self.task.loss(output, batch)
        if self.routed and weight is not None:  # a training forward's
            rows = batch[VALID].sum()
            if self.split and self.split.rank:  # (a replica's rows once: its cp workers each
                rows = torch.zeros_like(rows)   # score a part of the same rows)
            metrics.update(_routing(self.routed, rows))
        sums.add(self.task, ls, metrics, batch)
        return ls

    def evaluate(self, micro: list[np.ndarray], batch_fn: BatchFn) -> dict:
        sums = Sums()
        was_training = self.wrapped.training
        self.wrapped.eval()
        try:
            with torch.no_grad():
                for rows in micro:
                    self._loss(batch_fn, rows, sums)
        finally:
            self.wrapped.train(was_training)
            if self.sharded:  # ZeRO-2 keeps what a forward gathered until a backward
                reshard([self.wrapped])
        return sums.out()

    def clip(self) -> torch.Tensor:
        return clip_grads(self.module, self.spec.train.grad_clip)


def _sequence_part(mesh, spec: JobSpec, task: Task) -> tuple[SequenceSplit, SequencePart]:
    """Context parallelism: this worker's part of each row's positions, exchanged over the
    mesh's cp axis, and the task as the worker computes it (its part's inputs, loss and
    documents: the sums of a replica's cp workers add up to the replica's)."""
    group = mesh["cp"]
    split = SequenceSplit(group.get_group(), group.get_local_rank(), group.size(),
                          spec.parallel.cp_attention)
    return split, SequencePart(task, split)


def _expert_group(mesh) -> experts.ExpertParallel:
    """The workers that split each mixture's experts between them: the mesh's dp_shard."""
    group = mesh["dp_shard"]
    return experts.ExpertParallel(group.get_group(), group.get_local_rank(), group.size())


def _expert_grads(mesh, dims: ParallelDims, spec: JobSpec) -> Optional[comm.FlatGrads]:
    """The experts' gradients summed over the workers holding the same ones (the other
    groups' workers of this place, and their cp workers), in one buffer; None where none does."""
    holders = joined(mesh, ("dp_replicate", "cp") if dims.cp > 1 else ("dp_replicate",),
                     spec.parallel.timeout_s)
    return (comm.FlatGrads(holders.get_group(), spec.parallel.grad_comm)
            if holders.size() > 1 else None)


def _compiling(spec: JobSpec) -> bool | str:
    """train.compile, but "auto" leaves expert parallelism's blocks eager (unmeasured on a GPU)."""
    return False if spec.parallel.ep > 1 and spec.train.compile == "auto" else spec.train.compile


def _attending(model: nn.Module, task: Task, name: str) -> list[nn.Module]:
    """The layers of `model` told where each micro-batch's documents are (data.document_mask:
    models/documents.py), refused in one line where the job masks and none of them can."""
    layers = attending(model) if task.eod is not None else []
    if task.eod is not None and not layers:
        raise WorkerError(f"data.document_mask: model {name} has no layer that "
                          "keeps documents apart (a layer with an attend_within(documents) "
                          "method: baton.models.documents); set data.document_mask: false")
    return layers


def _routing(layers: list[nn.Module], rows: torch.Tensor) -> dict:
    """A training forward's metrics of a mixture of experts' blocks (`models.routed`):
    train_expert_load_max, the busiest expert's share of its block's choices over an even
    share (tasks.COUNTED's expert_load), and each loss on the routing (train_router_aux_loss,
    train_router_z_loss), its mean over the blocks that add it and the rows."""
    load = torch.stack([layer.load for layer in layers])  # (blocks, experts)
    out = {"expert_load_max": Counts("expert_load", load, load.sum(dim=1, keepdim=True) - load)}
    for name in sorted({name for layer in layers for name in layer.losses}):
        sums = [layer.losses[name] for layer in layers if name in layer.losses]
        out[name] = (sum(sums) / len(sums), rows)
    return out


class _Routing:
    """A pipeline stage's mixture blocks' measures over a step's training forwards, those
    `_routing` makes: each block's load at its place among the whole model's blocks (zeros
    at the other stages'), and each loss on the routing summed over the stage's blocks over
    the model's blocks that add it (`terms`: how many); the rows it is a mean over from the
    last stage alone (the stages' results are summed)."""

    def __init__(self, blocks: int, experts: int, terms: dict[str, int], device: torch.device):
        self.terms = terms
        self.load = torch.zeros(blocks, experts, dtype=torch.int64, device=device)
        self.sums = {name: torch.zeros((), device=device) for name in terms}
        self.rows = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, layers: list[tuple[int, nn.Module]], rows: Optional[torch.Tensor]) -> None:
        """After a forward of `layers` (place, block) on a micro-batch; `rows`, those of it
        that count, where it was the last stage's."""
        for place, layer in layers:
            self.load[place] += layer.load
            for name, v in layer.losses.items():
                self.sums[name] += v
        if rows is not None:
            self.rows += rows.to(self.rows.device)

    def metrics(self) -> dict:
        out = {"expert_load_max": Counts("expert_load", self.load,
                                         self.load.sum(dim=1, keepdim=True) - self.load)}
        out.update({name: (self.sums[name] / n, self.rows) for name, n in self.terms.items()})
        return out


class ExpertParallelEngine(DataParallelEngine):
    """Data parallel replicas under DDP, or ZeRO-2 or -3, whose mixtures' experts are split
    over groups of parallel.ep of them (parallel/experts.py): each worker holds its group
    share of the experts, whose gradients it sums with the workers of the other groups that
    hold the same ones (and with its replica's other cp workers, under context parallelism:
    each routes its part of the rows' tokens among the group's workers of its cp rank), and
    writes them in sharded checkpoints (DCP: every worker its experts, the rest once). Under
    ZeRO the rest of the model is sharded over each group (FSDP2 leaves the experts alone).
    Under tensor parallelism (`TensorExpertEngine`) each worker holds its share of its
    experts' hidden units, and its group is the replicas' workers of its tp rank."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, device: torch.device, task: Task):
        super().__init__(spec, dims, device, task)
        self._hold_experts(dims, spec)

    def _hold_experts(self, dims: ParallelDims, spec: JobSpec) -> None:
        self.experts = [q for _, q in experts.held(self.module)]
        self.sharded = True  # (no worker holds every expert: checkpoints through DCP)
        self.expert_grads = _expert_grads(self.mesh, dims, spec)

    def _split(self, module: nn.Module, fill) -> tuple:
        fill, wrapping = super()._split(module, fill)  # (tp: each layer filled and split)
        self.ep = _expert_group(self.mesh)
        if fill is None:  # (DDP, or tp: built whole or split, its experts split before it is wrapped)
            kept = experts.split(module, self.ep)
            if self.spec.parallel.shard == "none":
                return fill, {**wrapping, "ignore": tuple(name for name, _ in kept)}
            return fill, {**wrapping, "ignore": experts.held_in}

        def fill_and_split(layers) -> None:  # (ZeRO: on the meta device, each FSDP unit given
            layers = list(layers)            # its values, then its experts split, as sharded)
            fill(layers)
            for layer in layers:
                experts.split(layer, self.ep)
        return fill_and_split, {"ignore": experts.held_in}

    def forward_backward(self, micro: list[np.ndarray], batch_fn: BatchFn, scale: float,
                         trace: bool) -> tuple[Sums, dict]:
        out = super().forward_backward(micro, batch_fn, scale, trace)
        trained = [q for q in self.experts if q.grad is not None]  # (none where frozen)
        if self.expert_grads and trained:
            self.expert_grads.all_reduce(trained)
        # (averaged over the replicas' workers as DDP averages the rest: the loss's scale
        # undoes it)
        torch._foreach_div_([q.grad for q in trained], float(self.averaged_over))
        return out

    def clip(self) -> torch.Tensor:
        """Clip by the whole model's gradient norm: the rest's (`_rest_sq`) and the experts'
        summed over the workers that split them (and over the tp workers that split each)."""
        held = {id(q) for q in self.experts}
        grads = [local(q.grad) for q in self.module.parameters() if q.grad is not None]
        mine = _sq((q.grad for q in self.experts if q.grad is not None), self.device)
        dist.all_reduce(mine, group=self.ep.group)
        if self.tp > 1:
            dist.all_reduce(mine, group=self.shares.group)
        return scale_to_norm(grads, (self._rest_sq(held) + mine).sqrt(), self.spec.train.grad_clip)

    def _rest_sq(self, held: set[int]) -> torch.Tensor:
        """The squared norm of the gradient of the rest of the model (what is not in `held`):
        the same on every worker, or under ZeRO its shards' summed over the workers that
        split it."""
        rest = _sq((local(q.grad) for q in self.module.parameters()
                    if q.grad is not None and id(q) not in held), self.device)
        if self.shard_group is not None:
            dist.all_reduce(rest, group=self.shard_group)
        return rest


def _sq(grads, device: torch.device) -> torch.Tensor:
    """The sum of the squares of `grads`' elements, in float32 (0 for none)."""
    return sum((g.float().square().sum() for g in grads), torch.zeros((), device=device))


class TensorParallelEngine(DataParallelEngine):
    """Data parallel replicas (DDP, or FSDP2 over the workers that hold the same share: 2D
    parallelism), each split over parallel.tp workers (parallel/tensor.py). Every worker saves
    and loads the pieces of the whole tensors it holds (`Shares.pieces`)."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, rank: int, device: torch.device,
                 task: Task):
        self.tp_rank = dims.tp_rank(rank)
        self.own_random = tensor.OwnRandom(_own_seed(spec, rank), device)
        super().__init__(spec, dims, device, task)
        self.sharded = True  # each worker writes its own pieces

    def _split(self, module: nn.Module, fill) -> tuple:
        self.shares = tensor.Shares(module, self.tp_rank, self.spec.parallel.tp,
                                    self.mesh["tp"].get_group(), fill,
                                    self.spec.parallel.sequence_parallel,
                                    getattr(self.task, "split_logits", False),
                                    random=self.own_random)
        # DDP's group: every replica of the share (and their cp workers)
        return None, {"group": axis(self.mesh, "dp_cp" if self.split else "dp").get_group()}

    def load_state_dicts(self, model_state: dict, optim_state: dict) -> None:
        self.replica.load_full(*self.shares.take(model_state, optim_state))

    def load_sharded(self, where: sharded.Location) -> None:
        self.replica.load_sharded(where, self.shares.pieces)

    def pieces(self, state: dict) -> dict:
        return self.shares.pieces(state)

    def clip(self) -> torch.Tensor:
        """Clip by the whole model's gradient norm (`Shares.grad_sq`, summed over the shards),
        the sequence-parallel region's whole parameters' gradients summed first."""
        self.shares.sum_partial_grads(self.module)
        sq = self.shares.grad_sq(self.module, self.device)
        if self.shard_group is not None:
            dist.all_reduce(sq, group=self.shard_group)
        grads = [local(q.grad) for q in self.module.parameters() if q.grad is not None]
        return scale_to_norm(grads, sq.sqrt(), self.spec.train.grad_clip)


class TensorExpertEngine(ExpertParallelEngine, TensorParallelEngine):
    """Tensor parallel replicas (under DDP, or ZeRO over each group's workers of a share)
    whose mixtures' experts are split over groups of parallel.ep replicas: each worker holds
    its tp share of its group share of the experts (`ExpertParallelEngine`, among the
    replicas' workers of its tp rank)."""

    def __init__(self, spec: JobSpec, dims: ParallelDims, rank: int, device: torch.device,
                 task: Task):
        TensorParallelEngine.__init__(self, spec, dims, rank, device, task)
        self._hold_experts(dims, spec)

    def _rest_sq(self, held: set[int]) -> torch.Tensor:
        self.shares.sum_partial_grads(self.module)  # (sequence parallelism's parts)
        sq = self.shares.grad_sq(self.module, self.device, leave=held)
        if self.shard_group is not None:  # (ZeRO: this worker's shards of its share)
            dist.all_reduce(sq, group=self.shard_group)
        return sq


class PipelineEngine(_Engine):
    def __init__(self, spec: JobSpec, dims: ParallelDims, rank: int, device: torch.device,
                 stage_layers: list[int], task: Task, shapes: dict):
        self.spec, self.dims, self.device, self.task = spec, dims, device, task
        self.per_row = task.per_sample  # (a whole row's loss terms, under cp too)
        self.dp_rank, self.pp_rank = dims.coords(rank)
        tp_rank, cp_rank = dims.tp_rank(rank), dims.cp_rank(rank)
        self.cp_rank = cp_rank
        p, v = dims.pp, spec.chunks
        full, fill = build_lazily(spec.model, spec.train.seed)
        full = sequential(full, spec.model.name)
        # sequence parallelism: the layer after which the sequence is split, in the whole model
        marked = tensor.sequence_start(full) if spec.parallel.sequence_parallel else None
        checkpoint_activations(full, spec.train.activation_checkpointing)  # on the whole model
        compile_blocks(full, _compiling(spec), device.type)
        # Every rank keeps its slices of the model and gives only those their values, exactly
        # as the single-process model has them (a built-in model: the rest stays on the meta
        # device; a user's builder builds the whole, and the rest is freed at once).
        spans = bounds(stage_layers)
        chunks = [full[slice(*spans[sched.stage_of(self.pp_rank, c, p)])] for c in range(v)]
        fill(layer for chunk in chunks for layer in chunk)
        self.module = nn.Sequential(OrderedDict(
            (key, layer) for chunk in chunks for key, layer in chunk._modules.items()))
        # (the whole model's layers refused where none takes documents; this rank's told;
        # under cp every row: its part of the positions)
        self.attending = (attending(self.module) if dims.cp > 1 or _attending(full, task, spec.model.name)
                          else [])
        # this rank's mixture blocks, told each micro-batch's rows that count and the weight
        # of their loss as its attending layers are told; their measures reported at their
        # places among the whole model's (tasks' Counts are summed over the stages)
        mixtures = routed(full)
        places = {id(m): i for i, m in enumerate(mixtures)}
        self.routed = [[(places[id(m)], m) for m in routed(chunk)] for chunk in chunks]
        # (blocks, experts a block, {a loss on the routing: the blocks that add it})
        self.mixtures = ((len(mixtures), mixtures[0].mixture.experts,
                          {name: sum(name in m.mixture.terms for m in mixtures) for name in mixtures[0].mixture.terms})
                         if mixtures else None)
        self.balancing = any(m.balances for layers in self.routed for _, m in layers)
        del full
        # every rank builds every group, in one order
        mesh = dims.device_mesh(device.type, spec.parallel.timeout_s)
        # expert parallelism: this rank's experts of its stage's mixtures, split over the
        # stage's workers of its replica group (the mesh's dp_shard), held by name
        self.expert_grads = None
        if spec.parallel.ep > 1:
            split = _expert_group(mesh)
            experts.split(self.module, split)
            self.ep_group = split.group
            self.expert_grads = _expert_grads(mesh, dims, spec)
        # the stage's replicas that sum its gradients (whole stages), with their cp workers
        # (and with expert parallelism's groups: its mesh's dp_shard)
        self.dp_group = (axis(mesh, "dp_cp") if dims.cp > 1
                         else joined(mesh, ("dp_replicate", "dp_shard"), spec.parallel.timeout_s)
                         if spec.parallel.ep > 1 else mesh["dp_replicate"]).get_group()
        self.pp_group = mesh["pp"].get_group()
        self.shard_group = sharding(mesh).get_group(1)  # (with cp under ZeRO: dp_shard x cp)
        example = example_inputs(spec, shapes, spec.micro_batch)
        if dims.cp > 1:  # (context parallelism: each row's positions split over cp workers)
            split, self.task = _sequence_part(mesh, spec, task)
            example = split.part(example)
        # each stage's layers split over its tp workers (parallel/tensor.py)
        self.own_random = tensor.OwnRandom(_own_seed(spec, rank), device) if dims.tp > 1 else None
        self.shares = (tensor.Shares(self.module, tp_rank, dims.tp, mesh["tp"].get_group(),
                                     sequence=spec.parallel.sequence_parallel,
                                     split_logits=getattr(task, "split_logits", False),
                                     stage_after=int(marked) if marked is not None else None,
                                     random=self.own_random)
                       if dims.tp > 1 else None)
        # (taken once the stage's layers are split: tp makes its experts' layers shares)
        self.experts = [q for _, q in experts.held(self.module)] if spec.parallel.ep > 1 else []
        self.module.to(device)
        # FSDP2 inside the stages (shard: grads | full), or whole stages whose gradients
        # this engine all-reduces over the stage's replicas
        # (with expert parallelism FSDP2 leaves the experts alone: each stage's rest sharded
        # over the workers that split its experts)
        sync = STAGE_WRAPPINGS[spec.parallel.shard](
            chunks, mesh, spec.train, unit_mib=spec.parallel.shard_unit_mib,
            grad_comm=spec.parallel.grad_comm,
            ignore=experts.held_in if self.experts else None)
        self.fsdp = sync is not None
        # saved through DCP, in pieces (or each worker its experts)
        self.sharded = self.fsdp or self.shares is not None or bool(self.experts)
        # whole stages: their replicas sum the gradients here, in a buffer they are views of
        self.replica_grads = (comm.FlatGrads(self.dp_group, spec.parallel.grad_comm)
                              if dims.dp * dims.cp > 1 and not self.fsdp else None)
        self.runtime = PipelineRuntime(chunks, self.pp_rank,
                                       dims.pp_group(self.dp_rank, tp_rank, cp_rank), v,
                                       device, spec.train.precision == "bf16", self.pp_group,
                                       before_backward=sync)
        self.runtime.agree_shapes(example)
        if self.fsdp:  # the shape probe's forward left ZeRO-2's parameters gathered
            reshard(chunks)
        self.optimizer = make_optimizer(self.module, spec.train)
        self.actions = sched.build(spec.parallel.schedule, p, spec.microbatches, v)[self.pp_rank]
        self.first, self.last = self.pp_rank == 0, self.pp_rank == p - 1
        self.weighs_loss = self.last or bool(self.balancing)
        self.mesh = mesh

    def replica_groups(self) -> list:
        # the last stage's workers of this share of it, one in each replica: over the
        # replica groups and the shards within each (every dp rank reads rows of its own)
        return [self.mesh[name].get_group() for name in ("dp_shard", "dp_replicate")
                if self.mesh[name].size() > 1]

    def forward_backward(self, micro: list[np.ndarray], batch_fn: BatchFn, scale: float,
                         trace: bool) -> tuple[Sums, dict]:
        """Run the schedule; gradients end summed over this stage's replicas. The loss sums
        (the last stage's), and the schedule's measures."""
        # fixed-size micro-batches (short ones padded, padding ignored by the task), so every
        # message between stages keeps the shape agreed at set-up
        sums = Sums()
        # FSDP averages gradients over the stage's dp ranks (and their cp workers); the scale
        # undoes it
        st = self._run(self.actions, micro, batch_fn, sums,
                       scale * self.dims.dp * self.dims.cp if self.fsdp else scale, training=True)
        trained = [q for q in self.module.parameters() if q.grad is not None]
        held = {id(q) for q in self.experts}
        if self.replica_grads:  # each stage's replicas sum their gradients
            self.replica_grads.all_reduce([q for q in trained if id(q) not in held])
        if self.expert_grads:  # and each expert's holders its
            self.expert_grads.all_reduce([q for q in trained if id(q) in held])
        if self.fsdp and self.experts:  # (averaged as FSDP averages the rest: the scale undoes it)
            torch._foreach_div_([q.grad for q in trained if id(q) in held], float(self.dims.dp * self.dims.cp))
        self.busy_s = st.busy_s
        return sums, {
                "pipe": {"start": st.first_start, "end": st.last_end, "busy_s": st.busy_s,
                         "activation_bytes": st.peak_activation_bytes, "live": st.peak_live},
                "events": st.events if trace else None}

    def compute_s(self) -> Optional[float]:
        # the schedule's forwards and backwards, between its waits for the next and the last
        # stage (each timed on the host: on a GPU the host only queues them); FSDP inside the
        # stages and tp wait for peers within them
        return (self.busy_s if self.device.type == "cpu" and not self.fsdp and self.shares is None
                else None)

    def _run(self, actions, micro: list[np.ndarray], batch_fn: BatchFn, sums: Sums, scale: float,
             training: bool = False):
        # every stage whose layers keep documents apart, or route among experts, reads the
        # rows too: where their documents are, which of them count
        batches = ([batch_fn(rows, pad_to=self.spec.micro_batch) for rows in micro]
                   if self.first or self.last or self.attending or any(self.routed) else None)
        # a load-balancing loss summed over a micro-batch's rows weighs as its loss sum does
        # (the runtime's scale), a row as many terms as it has (models.routed)
        weight = scale * self.per_row
        measured = _Routing(*self.mixtures, self.device) if training and self.mixtures else None
        final = self.dims.pp * self.spec.chunks - 1  # (the model's last stage)

        def loss_fn(output: torch.Tensor, batch: dict) -> torch.Tensor:
            ls, metrics = self.task.loss(output, batch)
            sums.add(self.task, ls, metrics, batch)
            return ls

        def enter(mb: int) -> None:  # before each forward and backward of micro-batch mb
            if self.attending:
                attend_within(self.attending, self.task.documents(batches[mb], self.device))
            for layers in self.routed:
                for _, layer in layers:
                    layer.balance(batches[mb][VALID].to(self.device), weight)

        def forwarded(mb: int, chunk: int) -> None:  # (a chunk's blocks, just run on mb)
            # (the rows once: of the last stage's first cp worker, each scoring a part of them)
            counts = sched.stage_of(self.pp_rank, chunk, self.dims.pp) == final and not self.cp_rank
            measured.add(self.routed[chunk], batches[mb][VALID].sum() if counts else None)

        trace = self.runtime.run(actions, batches and [self.task.inputs(b) for b in batches],
                                 batches, loss_fn, scale,
                                 enter if self.attending or any(self.routed) else None,
                                 forwarded if measured else None)
        if measured:
            sums.add_metrics(measured.metrics())
        return trace

    def evaluate(self, micro: list[np.ndarray], batch_fn: BatchFn) -> dict:
        """The schedule's forwards alone, without gradients: the last stage's task sums."""
        sums = Sums()
        forwards = [a for a in self.actions if a.kind == "F"]  # in the schedule's order
        chunks = self.runtime.chunks
        was_training = [c.training for c in chunks]
        for c in chunks:
            c.eval()
        try:
            with torch.no_grad():
                self._run(forwards, micro, batch_fn, sums, 1.0)
        finally:
            for c, mode in zip(chunks, was_training):
                c.train(mode)
            if self.fsdp:  # ZeRO-2 keeps what a forward gathered until a backward
                reshard(chunks)
        return sums.out()

    def state_dicts(self) -> tuple[dict, dict]:
        """This stage's state (this worker's share of it, under tensor parallelism)."""
        return state_dicts(self.module, self.optimizer)

    def load_state_dicts(self, model_state: dict, optim_state: dict) -> None:
        if self.shares:  # (the other stages' tensors are not split here, and not loaded)
            model_state, optim_state = self.shares.take(model_state, optim_state)
        load_full(self.module, self.module, self.optimizer, model_state, optim_state,
                  full=self.fsdp)

    def load_sharded(self, where: sharded.Location) -> None:
        sharded.load_into(self.module, self.optimizer, where, self.pieces)

    def pieces(self, state: dict) -> dict:
        """A sharded state as DCP is to save it (`DataParallelEngine.pieces`)."""
        return self.shares.pieces(state) if self.shares else state

    def clear_grads(self) -> None:
        flats = [f for f in (self.replica_grads, self.expert_grads) if f]
        if not (flats and all([f.zero() for f in flats])):  # (views of a buffer stay, zeroed)
            super().clear_grads()
            return
        # what is in no buffer: the experts where one worker holds each, the rest under FSDP
        held = {id(q) for q in self.experts}
        loose = (([] if self.expert_grads else self.experts)
                 + ([] if self.replica_grads else [q for q in self.module.parameters() if id(q) not in held]))
        for q in loose:
            q.grad = None

    def clip(self) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient, summed over the pipeline's stages
        (and over a stage's shards). The norm stays a tensor, as `clip_grads` leaves it: on a
        GPU the optimizer step is queued without the host waiting for the backward to end
        (the worker reads the norm once, with the loss, after the step)."""
        grads = [q.grad for q in self.module.parameters() if q.grad is not None]
        held = {id(q) for q in self.experts}

        def sq_of(gs) -> torch.Tensor:
            return sum((torch.linalg.vector_norm(local(g)) ** 2 for g in gs),
                       torch.zeros((), dtype=torch.float32, device=self.device))
        if self.shares:  # a stage's tp workers together hold its gradient (this one's shards)
            self.shares.sum_partial_grads(self.module)  # (sequence parallelism's parts)
            sq = self.shares.grad_sq(self.module, self.device, leave=held)
        else:
            sq = sq_of(q.grad for q in self.module.parameters() if q.grad is not None and id(q) not in held)
        if self.fsdp:  # a stage's shards together hold its gradient (once per group)
            dist.all_reduce(sq, group=self.shard_group)
        if self.experts:  # (the stage's experts: their group holds them between them, and
            mine = sq_of(q.grad for q in self.experts if q.grad is not None)  # its tp workers
            dist.all_reduce(mine, group=self.ep_group)  # a share of each)
            if self.shares:
                dist.all_reduce(mine, group=self.shares.group)
            sq = sq + mine
        dist.all_reduce(sq, group=self.pp_group)
        return scale_to_norm([local(g) for g in grads], sq.sqrt(), self.spec.train.grad_clip)
