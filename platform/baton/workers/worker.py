"""The worker: a Ray actor that holds one model replica (pp = 1) or one pipeline rank's stages
(pp > 1), its optimizer, and its place in the torch.distributed groups. It executes; the
coordinator decides what.

Calls run one at a time, in the order sent, on the worker's training thread (actor.py): a step
starts the moment the one before ends, without waiting for Ray to hand it over. `heartbeat`
runs on a thread of its own (the "health" concurrency group), so a worker busy in a long step
or stuck in a collective still answers, and one that does not answer is dead or frozen. A worker outlives
its process group: after a failure the coordinator calls `leave`, then `assign` gives it a new
rank in a new world and `setup` joins it (on a fresh port), without a new process."""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib
import math
import os
import re
import socket
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import ray
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from baton.checkpoint import CheckpointStore, frozen
from baton.data.feed import Batch, Columns
from baton.data.rows import UnitRows
from baton.errors import CheckpointError, OutOfMemory, WorkerError
from baton.models.frozen import from_start
from baton.parallel import ParallelDims
from baton.parallel.broadcast import broadcast_state
from baton.parallel.compiled import compile_seconds
from baton.parallel.mesh import split_micro
from baton.spec import JobSpec
from baton.tasks import VALID, counted_once, example_inputs, make_task, padded
from baton.tracking import profile
from baton.training import local, param_digest
from baton.workers import host
from baton.workers.saves import BackgroundSaves, empty_like, empty_shards

if TYPE_CHECKING:
    from baton.checkpoint import sharded


def _in_world(method):
    """A call that runs the world's collectives. Once one of them fails, the world is broken:
    the calls queued behind it (the next step, a save) refuse at once instead of waiting in a
    collective with peers that are no longer in it, so this worker reaches `leave` and frees
    its groups, which lets its peers' waits end. Found with pp 2 x hybrid ZeRO-3: a stage whose
    step had failed ran the next queued step and waited in a receive for the whole collective
    timeout, and the peer of the old step waited on it in turn (two timeouts, then killed)."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.broken is not None:
            raise WorkerError(f"not run: this world broke earlier ({self.broken})")
        try:
            return method(self, *args, **kwargs)
        except BaseException as e:
            self.broken = f"{method.__name__}: {type(e).__name__}"
            short = out_of_memory(e)
            if short is not None:
                raise OutOfMemory(f"{short}; lower train.micro_batch, set "
                                  "train.activation_checkpointing: blocks, or shard the model's "
                                  "state (parallel.shard)") from e
            raise
    return call


def out_of_memory(error: BaseException) -> Optional[str]:
    """What an allocation that failed asked for, in words that are the same each time it
    fails at the same place (torch's CUDA message goes on with the device's free memory, which
    varies, and the failure policy gives up when the same message comes back at the same
    step); None for any other error."""
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):  # CUDA's (and other accelerators')
        asked = re.search(r"Tried to allocate ([\d.]+ (?:[KMG]iB|bytes))", text)  # torch's units
        return "out of device memory" + (f" (tried to allocate {asked[1]})" if asked else "")
    asked = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if isinstance(error, RuntimeError) and asked:  # torch's CPU allocator
        return f"out of host memory (tried to allocate {int(asked[1]) / 2**30:,.2f} GiB)"
    return None


class Worker:
    def __init__(self, spec: JobSpec, dims: ParallelDims, rank: int):
        self.began = time.time()  # the code this process runs is the code on disk then
        self._new(spec, dims, rank)

    def _new(self, spec: JobSpec, dims: ParallelDims, rank: int) -> None:
        # A constructor that raises kills the actor, and Ray prints its traceback on the
        # driver's console. The error is kept instead and raised by `ready`, which the group
        # waits on: the group names it in one line and kills this actor.
        self.start_error: Optional[Exception] = None
        try:
            if spec.tracking.trace_step is not None:  # a step may be profiled: see profile.py
                profile.prepare()  # here, on the thread that imported torch
            self._start(spec, dims, rank)
        except Exception as e:  # noqa: BLE001 - raised again, whole, by `ready`
            self.start_error = e

    def _start(self, spec: JobSpec, dims: ParallelDims, rank: int) -> None:
        self.use_cuda = spec.resources.gpus_per_worker > 0
        if self.use_cuda and not torch.cuda.is_available():  # a node's image or driver, not the job
            raise WorkerError(f"Ray gave this worker {spec.resources.gpus_per_worker:g} GPU on node "
                              f"{ray.util.get_node_ip_address()}, but torch sees no CUDA device: "
                              + (f"torch {torch.__version__} is built without CUDA"
                                 if torch.version.cuda is None else
                                 f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}"
                                 ", no driver or no device"))
        self.device = torch.device("cuda", 0) if self.use_cuda else torch.device("cpu")
        torch.set_num_threads(spec.resources.threads_per_worker)
        host.keep_freed_memory()  # steps run off the main thread: see host.py
        self.ledger: Optional[list] = None
        self.engine = self.checkpoint_group = None
        self.broken: Optional[str] = None  # the call that broke this world (`_in_world`)
        self.kept = None  # (step, pp_rank, sharded, state) kept by `leave`
        self.needs_state = False  # a growth's new worker, until `share_state`
        self.kept_save = None  # a sharded `write_kept` between its two rounds
        self.saves = BackgroundSaves(self.device)  # checkpoint.async
        # what checkpoints leave out: the frozen parameters of a model started from an export
        # (checkpoint/frozen.py), which a load takes from the export again
        self.left_out = frozenset(from_start(spec.model))
        self.last_step = 0
        self.assign(spec, dims, rank)
        # what `setup` needs, imported now, so that a warm spare has it before a fault: the
        # engines (FSDP2, DCP) and the torch._dynamo that DDP's first wrap imports (recovery
        # with a spare 3.07 -> 2.03 s on 2 cores; a fresh start neither gains nor loses:
        # docs/benchmarks.md, Recovery)
        # The job's spec decides, not `dims`: the group creates every worker, spares included,
        # in a world of one (it used to be `dims.dp > 1`, so no spare imported torch._dynamo,
        # and the first DDP wrap after a fault did, 0.65 s, with the survivor waiting for it)
        with host.collector_paused(freeze=True):  # and this process's objects frozen (host.py)
            importlib.import_module("baton.workers.engines")
            if spec.dp_range[1] > 1:
                importlib.import_module("torch._dynamo")

    def rest(self) -> None:
        """Out of any world and holding no model or state: kept warm for the next run of the
        driver (resources.keep_warm_s, workers/warm.py)."""
        self.leave()
        self.kept = None
        gc.collect()
        if self.use_cuda:
            torch.cuda.empty_cache()

    def renew(self, spec: JobSpec) -> bool:
        """Become, for a new run of `spec`, the worker the constructor would make, in this
        process (rested, kept warm). False, and nothing done, when code this process imported
        (the job's, or baton's in a checkout) has changed on disk since it started: a new
        process runs the new code."""
        from baton.workers.warm import changed_code

        if changed_code(self.began) is not None:
            return False
        if "torch._dynamo" in sys.modules:  # no compiled code or guards of the last run's models
            torch._dynamo.reset()
        self._new(spec, ParallelDims(1), 0)
        return self.start_error is None

    def assign(self, spec: JobSpec, dims: ParallelDims, rank: int) -> None:
        """Take `rank` in a world of `dims` (before `setup`)."""
        self.spec, self.dims, self.rank = spec, dims, rank
        self.dp_rank, self.pp_rank = dims.coords(rank)
        self.tp_rank = dims.tp_rank(rank)
        self.cp_rank = dims.cp_rank(rank)
        self.master_store = None  # the group's store, hosted by rank 0 (rendezvous_address)

    def ready(self) -> dict:
        if self.start_error is not None:
            raise self.start_error
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}

    def heartbeat(self) -> int:
        """Answered on its own thread: the worker's process is alive and not frozen."""
        return self.last_step

    def leave(self) -> int:
        """Drop the process group and the model (after a failure or before a resize). Runs
        after every call queued before it and the step still running, so nothing of the old
        world is still executing (steps handed over and not started are dropped: actor.py).
        Keeps the model's state as of the last step this worker completed (a step that failed
        half-way never reached its optimizer update) and returns that step: after a failure,
        the survivors' state can be written as a checkpoint (`write_kept`). A sharded worker
        (or a tensor-parallel one) keeps its shares, as the pieces of the whole tensors DCP
        writes: with another replica alive, every share has a survivor."""
        self.kept, kept_step, state = None, -1, None
        self.saves.settle(self.spec.checkpoint.timeout_s)
        if self.engine is not None:
            state = self.engine.state_dicts()
            model_state, optim_state = state
            self.kept = (self.last_step, self.pp_rank, self.engine.sharded,
                         self.engine.pieces({"model": model_state, "optim": optim_state["state"]})
                         if self.engine.sharded else state)
            kept_step = self.last_step
        self.engine = self.checkpoint_group = None
        if dist.is_initialized():
            dist.destroy_process_group()
        sharded = _sharded()
        sharded.forget_meshes()  # DTensor's caches would hand the next world this one's groups
        # Free this world's groups now, so that their connections close and a peer still in a
        # collective with this rank fails at once (FSDP's and DDP's state hold them in cycles)
        sharded.release_groups(state)
        gc.collect()
        return kept_step

    def write_kept(self, root: str, step: int) -> dict:
        """Write the state kept by `leave` as its part of checkpoint `step`: its stage's files
        ({"parts": their records}), or, when sharded, its shards through DCP, whose plans go
        through the coordinator (the survivors have no process group): this returns
        {"plan": the local plan}, and `write_kept_shards` writes this worker's part of the
        global plan."""
        kept_step, pp_rank, is_sharded, state = self.kept
        if kept_step != step:
            raise RuntimeError(f"this worker kept the state of step {kept_step}, not {step}")
        store = CheckpointStore(root)
        if is_sharded:  # (the pieces of the state: {"model": ..., "optim": ...})
            state = {**state, "model": self._checkpointed(state["model"])}
            self.kept_save = _sharded().PlannedSave(state, store.shards(step))
            return {"plan": self.kept_save.plan()}
        model_state, optim_state = state
        return {"parts": [store.write_tensors(step, f"model-{pp_rank:04d}.pt",
                                              self._checkpointed(model_state)),
                          store.write_tensors(step, f"optim-{pp_rank:04d}.pt", optim_state)]}

    def write_kept_shards(self, root: str, step: int, plan) -> tuple[list, list[dict]]:
        """This worker's part of the global plan: DCP's results, and the records of its files."""
        try:
            return self.kept_save.write(plan)
        finally:
            self.kept_save = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's IP and the port of the group's store, which rank 0 hosts: bound here to
        a port the system picks and held open until `setup` joins through it. (Binding port 0,
        closing it and handing the number on, as before, let another process take the port in
        between, and the world failed to form.) The store listens on the node's address only
        (torch's own would listen on every interface): 127.0.0.1 under the embedded Ray."""
        ip = ray.util.get_node_ip_address()
        family, kind, proto, _, address = socket.getaddrinfo(ip, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, proto)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        self.master_store = dist.TCPStore(ip, port, self.dims.world_size, is_master=True,
                                          timeout=timedelta(seconds=self.spec.parallel.timeout_s),
                                          wait_for_workers=False, master_listen_fd=listener.detach())
        return ip, port

    def profile_layers(self, columns: Optional[Columns] = None, repeats: int = 3) -> list[float]:
        """Seconds of forward + backward of each layer on one micro-batch (median of
        `repeats`): what parallel.partition = time balances."""
        from baton.models import build_lazily, sequential
        from baton.parallel.profile import layer_times

        model, fill = build_lazily(self.spec.model, self.spec.train.seed)
        example = example_inputs(self.spec, _shapes(self.spec, columns), self.spec.micro_batch)
        return layer_times(sequential(model, self.spec.model.name), example, self.device, repeats,
                           fill)

    def setup(self, master: tuple[str, int], record_samples: bool,
              stage_layers: Optional[list[int]] = None, columns: Optional[Columns] = None,
              keep_state: bool = False) -> dict:
        """Join the process group, build this rank's part of the model and its optimizer.
        `keep_state` (a growth): a worker of the world before loads the state `leave` kept into
        its new model (held in host memory meanwhile, so that a GPU holds one state at a time);
        a new one waits for `share_state`."""
        spec = self.spec
        kept = _on_host(self.kept) if keep_state and self.kept is not None else None
        self.broken = None  # a new world
        self.compile_mark = compile_seconds()
        timeout = timedelta(seconds=spec.parallel.timeout_s)
        store, self.master_store = self.master_store, None  # rank 0's, from rendezvous_address
        if store is None:
            store = dist.TCPStore(master[0], master[1], self.dims.world_size, is_master=False,
                                  timeout=timeout)
        dist.init_process_group("nccl" if self.use_cuda else "gloo", store=store, rank=self.rank,
                                world_size=self.dims.world_size, timeout=timeout)
        # sharded checkpoints' coordination (DCP), timed by checkpoint.timeout_s: a save to a
        # slow store is slow, not a failure
        self.checkpoint_group = dist.new_group(
            backend="gloo", timeout=timedelta(seconds=spec.checkpoint.timeout_s))
        self.shapes = _shapes(spec, columns)  # each column's row: what padding looks like
        self.task = make_task(spec, columns)
        self.rows = UnitRows(self.shapes)  # the units of each step's batch
        self.eval_rows = UnitRows(self.shapes)  # and of evaluation's, kept apart
        self.kept, self.last_step = None, 0  # a model built from the seed: the state at step 0
        self.state_reported = False
        from baton.workers.engines import (DataParallelEngine, ExpertParallelEngine,  # see _sharded
                                           PipelineEngine, TensorExpertEngine, TensorParallelEngine)

        if self.dims.pp > 1:
            self.engine = PipelineEngine(spec, self.dims, self.rank, self.device, stage_layers,
                                         self.task, self.shapes)
        elif self.dims.tp > 1:
            self.engine = (TensorExpertEngine if spec.parallel.ep > 1 else TensorParallelEngine)(
                spec, self.dims, self.rank, self.device, self.task)
        elif spec.parallel.ep > 1:
            self.engine = ExpertParallelEngine(spec, self.dims, self.device, self.task)
        else:
            self.engine = DataParallelEngine(spec, self.dims, self.device, self.task)
        # dropout differs per worker, but not within a replica's tp workers: the activations
        # they hold whole must stay the same on each
        torch.manual_seed(spec.train.seed * 100_003 + self.rank // self.dims.tp)
        self.needs_state = keep_state and kept is None
        if kept is not None:
            kept_step, _, _, state = kept
            self.engine.load_state_dicts(*state)
            self.last_step = kept_step
            if self.rank == 0:  # what `share_state` sends, as `leave` made it
                self.kept = kept
        self.ledger = [] if record_samples else None
        self.data_s = 0.0
        return {"rank": self.rank, "device": str(self.device), "backend": dist.get_backend(),
                "device_name": torch.cuda.get_device_name(self.device) if self.use_cuda else "cpu",
                "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "ip": ray.util.get_node_ip_address(), "layers": self.engine.layer_names(),
                "wrapper": type(getattr(self.engine, "wrapped", self.engine.module)).__name__,
                **self._compiled()}

    @_in_world
    def train_step(self, step: int, batch: Batch, lr: float, trace: bool = False) -> dict:
        """One optimizer step on this replica's part of the global batch `batch`. The loss is
        summed and divided by the global token count, so the summed gradient equals one
        process's gradient of the mean loss over the whole batch, even when the last batch of
        an epoch splits unevenly."""
        self.rows.use(batch)
        micro = self._micro_batches(batch.positions)
        self.data_s = 0.0
        # the traced step: a pipeline's timeline needs every rank's events, a data-parallel
        # profile one replica's (rank 0's: the others train unprofiled)
        trace = trace and (self.dims.pp > 1 or self.rank == 0)
        sums, out = self.engine.forward_backward(micro, self._batch, self._scale(batch, micro), trace)
        self.saves.fence()  # a background save's copy has read what the step changes
        skip = self.spec.train.skip_nonfinite > 0
        grad_norm = self.engine.apply(lr, skip)
        # read once the optimizer step is queued: on a GPU the loss read before it left the
        # device idle while the host queued the clip and the step (one wait a step, not two)
        out.update(self._once(sums.out()), grad_norm=float(grad_norm))
        if skip and not math.isfinite(out["grad_norm"]):
            out["skipped"] = True  # (engine.apply skipped the update)
        out["data_s"] = self.data_s  # getting the batch: what baton_data_wait_fraction shows
        computed = self.engine.compute_s()  # (read after the loss: on a GPU, its events are done)
        if computed is not None:
            out["compute_s"] = computed
        stalled = self.saves.stalls()
        if stalled:  # training's time in the last background save and its fence
            out["save_stall_s"] = stalled
        if not self.state_reported:  # sizes are fixed within a world: measured once
            out["state_bytes"] = self.engine.state_bytes()  # what sharding saves, live tensors
            self.state_reported = True
            self._prestage()
        out.update(self._compiled())
        out["memory"] = self._memory()
        self.last_step = step + 1
        if self.ledger is not None and self.pp_rank == 0 and self.tp_rank == self.cp_rank == 0:
            self.ledger += [(step, self.rows.gather(rows)[0].tolist()) for rows in micro if len(rows)]
        return out

    def _once(self, sums: dict) -> dict:
        """A replica's sums, from its first tp worker only (`counted_once`)."""
        return counted_once(sums) if self.tp_rank else sums

    def _memory(self) -> dict:
        """What this worker holds, in bytes: its process's resident host memory, and on a GPU
        the most device memory allocated since the last step's report (a counter the allocator
        keeps on the host: no wait on the device), its peak then reset for the next step."""
        held = {"host": host.resident_bytes()}
        if self.use_cuda:
            held["device"] = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return {kind: n for kind, n in held.items() if n is not None}

    def _compiled(self) -> dict:
        """{"compile_s": seconds} spent compiling since the last report (a new world's first
        step, a recompile for a new shape), or nothing."""
        spent, self.compile_mark = compile_seconds() - self.compile_mark, compile_seconds()
        return {"compile_s": spent} if spent > 0 else {}

    @_in_world
    def gradients(self, batch: Batch) -> dict:
        """This worker's gradients for `batch`, by parameter name, without stepping: what
        the equivalence tests compare with one process's."""
        self.rows.use(batch)
        micro = self._micro_batches(batch.positions)
        sums, _ = self.engine.forward_backward(micro, self._batch, self._scale(batch, micro), False)
        out = sums.out()
        grads = {n: _whole(q.grad).detach().cpu().clone()
                 for n, q in self.engine.module.named_parameters()}
        self.engine.optimizer.zero_grad(set_to_none=True)
        return {"grads": grads, "loss_sum": out["loss_sum"], "tokens": out["tokens"]}

    def _micro_batches(self, batch: np.ndarray) -> list[np.ndarray]:
        return split_micro(self.dims.replica_part(batch, self.dp_rank), self.spec.microbatches)

    @_in_world
    def evaluate(self, batch: Batch) -> dict:
        """The task's loss and metric sums over this replica's part of an evaluation batch,
        without gradients; the model is left as it was. With train.ema, those of the average
        of the weights too (under "ema")."""
        self.eval_rows.use(batch)
        micro = self._micro_batches(batch.positions)

        def sums() -> dict:
            return self._once(self.engine.evaluate(
                micro, lambda rows, pad_to=None: self._batch(rows, pad_to, self.eval_rows)))
        if self.spec.train.ema is None:
            return sums()
        live = sums()
        with self.engine.averaged():
            return {**live, "ema": sums()}

    def _scale(self, batch: Batch, micro: list[np.ndarray]) -> float:
        """What each loss sum is multiplied by: 1 over the global batch's loss terms, so that
        the gradients summed over the replicas are those of the mean. A loss mask's targets
        are counted from the rows, this replica's, summed over the replicas (a collective
        of one number; 1 where there are none); tokens are known from the rows' count."""
        if not self.task.masked:
            return 1.0 / (len(batch) * self.task.per_sample)
        if not self.engine.weighs_loss:  # (a pipeline's stages before the last, mostly)
            return 1.0
        mine = sum(self.task.targets(self.rows.gather(rows)[1]) for rows in micro if len(rows))
        return 1.0 / max(1, self.engine.over_replicas(mine))

    def _batch(self, rows: np.ndarray, pad_to: Optional[int] = None,
               source: Optional[UnitRows] = None) -> dict:
        """These rows as the task's batch (a tensor per column, and VALID), padded with
        invalid rows to `pad_to`."""
        t0 = time.perf_counter()
        try:
            columns = (source or self.rows).gather(rows)[1] if len(rows) else {}
            batch = {name: torch.from_numpy(columns[name]).to(dtype)
                     for name, (_, dtype) in self.shapes.items() if name in columns}
            batch[VALID] = torch.ones(len(rows), dtype=torch.bool)
            return padded(batch, pad_to, self.shapes) if pad_to else batch
        finally:
            self.data_s += time.perf_counter() - t0

    # -- checkpoints: one file per pipeline rank, keyed by parameter name -----------------------

    @_in_world
    def save(self, root: str, step: int, background: bool = False) -> Optional[Any]:
        """Write this worker's parts of checkpoint `step`; returns their records (name, size,
        checksum) for the commit. `background`: copy the state to host memory, off the training
        thread where it can be (workers/saves.py), and return at once; a thread writes the
        copy, and `written(step)` returns the records. Sharded state in the background is
        written in DCP's two rounds with the coordinator carrying the plans, as the survivors'
        save does: this returns {"plan": this worker's local plan}, and `write_planned` starts
        the write of its part of the global plan. (DCP's own rounds are collectives: on the
        writing thread they would race the failure handling that tears the group down.)"""
        t0 = time.perf_counter()
        try:
            return self._save(CheckpointStore(root), step, background)
        finally:  # what training waited for: reported with the next step
            self.saves.stalled_s += time.perf_counter() - t0

    def _save(self, store: CheckpointStore, step: int, background: bool) -> Optional[Any]:
        rng = {"cpu": torch.get_rng_state()}
        if self.use_cuda:
            rng["cuda"] = torch.cuda.get_rng_state()
        if self.engine.own_random is not None:  # a tp worker's own stream
            rng["own"] = self.engine.own_random.state.clone()
        state = None
        if self.engine.sharded or self.dp_rank == 0:
            model_state, optim_state = self.engine.state_dicts()
            state = self._checkpointed(model_state), optim_state
        if not background:
            return self._write(store, step, state, rng)
        if self.engine.sharded:
            model_state, optim_state = state
            def plan(copied: dict) -> tuple:  # from the copy's shapes: its values land later
                planned = _sharded().PlannedSave(self.engine.pieces(copied), store.shards(step))
                return planned, planned.plan()
            (planned, local_plan), copying = self.saves.copy_shards(
                {"model": model_state, "optim": optim_state["state"]}, self._param_pointers(), plan)
            self.saves.planned[step] = (planned, store, rng, copying)
            return {"plan": local_plan}
        copying = self.saves.copy(state, self._param_pointers()) if state is not None else None

        def write():
            return self._write(store, step, copying and self.saves.landed(copying), rng)
        self.saves.started(step, self.saves.writer.submit(write))
        return None

    def _checkpointed(self, model_state: dict) -> dict:
        """A model state as a checkpoint holds it: less the parameters the job's checkpoints
        leave out (`left_out`)."""
        return {n: t for n, t in model_state.items() if n not in self.left_out}

    def _param_pointers(self) -> set[int]:
        """The parameters' data pointers (of their local shards: a DTensor's own is 0)."""
        return {local(q).data_ptr() for q in self.engine.module.parameters()}

    def _prestage(self) -> None:
        """After a world's first step (the optimizer's state exists from then on), allocate the
        host buffers background saves copy into (workers/saves.py)."""
        if not (self.spec.checkpoint.async_ and self.spec.checkpoint.every_steps > 0
                and (self.engine.sharded or self.dp_rank == 0)):
            return
        model_state, optim_state = self.engine.state_dicts()
        model_state = self._checkpointed(model_state)
        pin = self.use_cuda
        if self.engine.sharded:
            state = {"model": model_state, "optim": optim_state["state"]}
            self.saves.prestage(lambda: empty_shards(state, pin))
        else:
            _, later = BackgroundSaves.split((model_state, optim_state), self._param_pointers())
            self.saves.prestage(lambda: ({}, empty_like(later, pin)))

    def write_planned(self, step: int, plan) -> None:
        """Start writing this worker's part of background save `step`'s global plan; `written`
        returns (DCP's results, the records of its files)."""
        planned, store, rng, copying = self.saves.planned.pop(step)

        def write():
            BackgroundSaves.landed_copy(copying)  # the values DCP's writes read
            results, parts = planned.write(plan)
            return results, parts + [store.write_tensors(step, f"rng-rank{self.rank:04d}.pt", rng)]
        self.saves.started(step, self.saves.writer.submit(write))

    def written(self, step: int) -> list[dict]:
        """The records of background save `step`'s parts, once written (on a thread of its
        own, so training calls queued meanwhile are not held up)."""
        return self.saves.written(step, self.spec.checkpoint.timeout_s)

    def _write(self, store: CheckpointStore, step: int, state: Optional[tuple], rng: dict) -> list[dict]:
        parts = []
        if self.engine.sharded:  # every worker writes its shards, in parallel
            model_state, optim_state = state
            parts += _sharded().save(self.engine.pieces({"model": model_state, "optim": optim_state["state"]}),
                                     self._shards(store, step))
        elif state is not None:  # replicas are identical: one copy of each stage is enough
            model_state, optim_state = state
            parts.append(store.write_tensors(step, f"model-{self.pp_rank:04d}.pt", model_state))
            parts.append(store.write_tensors(step, f"optim-{self.pp_rank:04d}.pt", optim_state))
        parts.append(store.write_tensors(step, f"rng-rank{self.rank:04d}.pt", rng))
        return parts

    def _shards(self, store: CheckpointStore, step: int) -> sharded.Location:
        return dataclasses.replace(store.shards(step), group=self.checkpoint_group)

    def check_sums(self, root: str, step: int, parts: dict) -> Optional[str]:
        """Read `parts` ({name: record}, this worker's share of checkpoint `step`'s) and check
        their checksums; what does not match, or None."""
        return CheckpointStore(root).check_sums(step, parts)

    def load(self, root: str, step: int, layout: dict, restore_rng: bool) -> None:
        """Load parameters and optimizer state, whatever the layout (dp, pp, shard level) the
        checkpoint was written at: by name from per-stage files, or through DCP from shards."""
        store = CheckpointStore(root)
        self.saves.fence()  # loading overwrites what a background copy may still be reading
        meta = store.read_meta(step)  # (what it leaves out: from model.init_from's export)
        changed = frozen.problem(meta, self.spec.model)  # (an export replaced mid-run)
        if changed:
            raise CheckpointError(changed)
        if store.is_sharded(step):
            lacks = frozenset(frozen.left_out(meta))
            self.engine.load_sharded(dataclasses.replace(self._shards(store, step), lacks=lacks))
        else:
            pp = layout["pp"]
            model_state = frozen.filled(store.read_model(step, pp), meta, self.spec.model,
                                        [n for n, _ in self.engine.module.named_parameters()])
            self.engine.load_state_dicts(model_state, store.read_optim(step, pp))
        self.last_step = step
        if restore_rng:  # same layout: continue each worker's random stream exactly
            rng = store.read_tensors(step, f"rng-rank{self.rank:04d}.pt")
            torch.set_rng_state(rng["cpu"])
            if self.use_cuda and "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"])
            if self.engine.own_random is not None and "own" in rng:
                self.engine.own_random.state = rng["own"]

    @_in_world
    def share_state(self, step: int) -> None:
        """The new workers of a world that has just grown take rank 0's state of `step`, sent
        over the new process group: rank 0 was in the world before and holds it again (`setup`),
        and sends the state dictionaries `leave` made (made again, they cost a second pass of
        torch's get_state_dict). No checkpoint is written and read back for the growth, and a
        failure meanwhile leaves the old workers holding that state for the recovery's
        survivors' save."""
        sent = None
        if self.rank == 0:
            kept_step, _, _, state = self.kept
            if kept_step != step:
                raise RuntimeError(f"rank 0 holds the state of step {kept_step}, not {step}")
            sent, self.kept = state, None
        state = broadcast_state(sent, 0, self.device)
        if self.needs_state:
            self.engine.load_state_dicts(*state)
            self.last_step, self.needs_state = step, False

    # -- inspection -----------------------------------------------------------------------------

    def digest(self) -> str:
        return param_digest(self.engine.module)

    def take_ledger(self) -> list:
        """The (step, sample ids) trained on since the last call; empties the ledger."""
        out = self.ledger or []
        if self.ledger is not None:
            self.ledger = []
        return out

    def shutdown(self) -> None:
        self.leave()


def _on_host(kept: tuple) -> tuple:
    """What `leave` kept, its tensors in host memory."""
    return tree_map(lambda x: x.cpu() if torch.is_tensor(x) else x, kept)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole (a collective: every worker calls it); a plain one."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _shapes(spec: JobSpec, columns: Optional[Columns]) -> dict:
    """Each column's row (shape, dtype): from the job's data (`source.columns`, checked against
    its schema before Ray starts), or a language model's token rows."""
    if columns is None:
        from baton.data.feed import token_columns

        columns = token_columns("tokens", None, spec.model.seq_len + 1, spec.model.vocab_size,
                                spec.data.loss_mask_column)
    return columns.shapes()


def _sharded():
    """`baton.checkpoint.sharded`, imported when a worker first needs it. The driver imports
    this module for its actor class, and torch.distributed.checkpoint with DTensor is 0.45 s
    of its start that it never uses; the engines import it in the worker anyway."""
    from baton.checkpoint import sharded

    return sharded
