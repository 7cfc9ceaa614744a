"""A worker's background saves (`checkpoint.async`): the copy of its state off the training
path, and one writing thread.

A save copies the state into host buffers and a thread writes the copy. The copy of the
parameters and the optimizer state is itself off the training thread (CheckFreq's pipelined
snapshot): it runs while the next step's forward and backward do, which read those tensors
and change none of them; the next optimizer step, the first thing that changes them, waits
for the copy (`fence`). On a GPU the copy runs on a stream of its own and the wait is the
device's (the training stream waits on the copy's event), so the host never waits for it.
What a forward may change (a module's buffers, such as BatchNorm's running statistics) is
copied at the save itself. A sharded state's copy is the same, its DTensors' local shards
copied (`copy_shards`): DCP plans from the copy's shapes at the save, and its writes read the
values once they have landed."""

from __future__ import annotations

import concurrent.futures
import copy
import os
import threading
import time
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import (tree_flatten, tree_flatten_with_path, tree_leaves, tree_map,
                                 tree_unflatten)

from baton.training import local


class BackgroundSaves:
    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"  # page-locked buffers: a GPU copies into them directly
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-save",
                                                            initializer=_yield_to_training)
        # the copy at the default priority: training waits for it at its next optimizer step
        self.copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-copy")
        self.stream = torch.cuda.Stream(device) if self.pin else None
        self.writes: dict[int, concurrent.futures.Future] = {}  # step -> its write
        self.changed = threading.Condition()
        self.world_left = 0  # how many times this worker has left a world
        # host memory a save copies the state into, kept for the next one (filling buffers
        # already mapped is several times faster than allocating new ones)
        self.buffers, self.last_write = None, None
        self.prestaged: Optional[concurrent.futures.Future] = None  # the first copy's buffers
        self.copying: Optional[concurrent.futures.Future] = None  # (copy, its CUDA event)
        self.planned: dict[int, tuple] = {}  # a sharded save between its two rounds
        self.stalled_s = 0.0  # training's time in saves and fences since the last `stalls`

    # -- the copy --------------------------------------------------------------------------------

    def prestage(self, allocate: Callable[[], Any]) -> None:
        """Allocate the first copy's buffers on the writing thread: mapping 1.4 GB took about
        2 s on a CPU (a copy into mapped buffers 0.1 s), and page-locked memory is slower to
        allocate still, so the first save no longer holds training for it."""
        self.prestaged = self.writer.submit(allocate)

    def ready(self) -> None:
        """Before a save's copy: the last write is done (its buffers are free again), and the
        buffers made ahead are in hand."""
        if self.last_write is not None:
            concurrent.futures.wait([self.last_write])
        self._take_copy()  # (one no step has waited for yet: two saves in a row)
        if self.prestaged is not None:
            self.buffers, self.prestaged = self.prestaged.result(), None

    @staticmethod
    def split(state: tuple[dict, dict], params: set[int]) -> tuple[dict, tuple[dict, dict]]:
        """(model state, optimizer state) as (what a forward may change: the model state's
        tensors that are not parameters, (the parameters, the optimizer state)); `params`: the
        parameters' data pointers."""
        model_state, optim_state = state
        now = {k: v for k, v in model_state.items()
               if not (isinstance(v, torch.Tensor) and v.data_ptr() in params)}
        return now, ({k: v for k, v in model_state.items() if k not in now}, optim_state)

    def copy(self, state: tuple[dict, dict], params: set[int]) -> concurrent.futures.Future:
        """Start copying (model state, optimizer state) into the host buffers; returns the
        future of the copy (and of its CUDA event). `params`: the parameters' data pointers;
        the model state's other tensors are copied before this returns."""
        self.ready()
        now, later = self.split(state, params)
        old = self.buffers or ({}, None)
        copied_now = _copy_into(old[0], now)  # pageable: copied before this returns
        return self._beside_next_step(lambda pin: (copied_now, _copy_into(old[1], later, pin)),
                                      tree_leaves(later))

    def copy_shards(self, state: dict, params: set[int],
                    plan: Callable[[dict], Any]) -> tuple[Any, concurrent.futures.Future]:
        """`copy` for a sharded state ({"model", "optim"}, DTensors). The copy: DTensors of the
        same meshes and placements with their local shards in host memory; `plan(copy)` runs
        before any value has landed (DCP plans from shapes alone) and before the copying thread
        starts (a plan is Python work, and the copy's thread would contend with it for the
        interpreter: 0.26-0.32 s against 0.1 s alone in a probe through baton on 2 cores).
        Returns what `plan` returns and the future the values land by (`landed_copy`). The
        model's tensors that are not parameters are copied before this returns, the rest
        beside the next step. The last copy's buffers are reused unless a plan not yet written
        still reads them (its write can come after this next save: seen in CI, checkpoint 1 of
        an every-step run held step 2's shards). `params`: the parameters' local shards' data
        pointers."""
        self.ready()
        buffers = None if self.planned else self.buffers
        if buffers is None or not _same_shapes(state, buffers):
            buffers = empty_shards(state, self.pin, zero=False)
        leaves, spec = tree_flatten(state)  # plain values (none in baton's states) as of now
        copies = [b if isinstance(b, torch.Tensor) else copy.deepcopy(v)
                  for v, b in zip(leaves, tree_leaves(buffers))]
        buffers = tree_unflatten(copies, spec)
        now = {local(t).data_ptr() for t in tree_leaves(state["model"])
               if isinstance(t, torch.Tensor)} - params
        pairs = [(local(v), local(b)) for v, b in zip(leaves, copies) if isinstance(v, torch.Tensor)]
        for v, b in pairs:
            if v.data_ptr() in now:
                b.copy_(v)  # blocking: copied before this returns
        later = [(v, b) for v, b in pairs if v.data_ptr() not in now]
        planned = plan(buffers)

        def copy_later(pin: bool) -> dict:
            if pin:  # device to host: each copy is queued on the copying stream
                for v, b in later:
                    b.copy_(v, non_blocking=True)
            elif later:  # one call for all: Python's lock taken once, not once a tensor
                # (none: a pipeline stage that trains nothing and saves nothing of its frozen
                # weights, checkpoint/frozen.py)
                torch._foreach_copy_([b for _, b in later], [v for v, _ in later])
            return buffers
        return planned, self._beside_next_step(copy_later, [v for v, _ in later])

    def _beside_next_step(self, copy_later: Callable[[bool], Any],
                          sources: list) -> concurrent.futures.Future:
        """Run `copy_later(pin)` on the copying thread, beside the next step's forward and
        backward, which `fence` holds from the optimizer step until it is done; on a GPU on a
        stream of its own, after what the training stream has queued so far. The future's
        result: (the copy, the CUDA event it is done by, or None)."""
        ready = None
        if self.stream is not None:  # the state as of now, on the training stream
            ready = torch.cuda.Event()
            ready.record()

        def run():
            if self.stream is None:
                return copy_later(False), None
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                copied = copy_later(True)
                for t in sources:  # freed meanwhile, not reused until copied
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        t.record_stream(self.stream)
                done = torch.cuda.Event()
                done.record(self.stream)
            return copied, done
        self.copying = self.copier.submit(run)
        return self.copying

    def fence(self) -> None:
        """Before anything changes parameters or optimizer state in place (the optimizer step,
        a load): the copy in flight has read them."""
        t0 = time.perf_counter()
        if self._take_copy():
            self.stalled_s += time.perf_counter() - t0

    def _take_copy(self) -> bool:
        """Wait for the copy in flight, if any, and keep its buffers for the next save."""
        copying, self.copying = self.copying, None
        if copying is None:
            return False
        concurrent.futures.wait([copying])
        if copying.exception() is None:  # (else the write raises it: the save fails)
            self.buffers, done = copying.result()
            if done is not None:  # the device waits, not the host
                torch.cuda.current_stream().wait_event(done)
        return True

    @staticmethod
    def landed_copy(copying: concurrent.futures.Future) -> dict:
        """On the writing thread: the copy, once in host memory (raises the copy's error)."""
        copied, done = copying.result()
        if done is not None:
            done.synchronize()
        return copied

    @staticmethod
    def landed(copying: concurrent.futures.Future) -> tuple[dict, dict]:
        """`landed_copy` for a replica's copy: (model state, optimizer state)."""
        now, (model_state, optim_state) = BackgroundSaves.landed_copy(copying)
        return {**model_state, **now}, optim_state

    def stalls(self) -> float:
        """Training's seconds in saves (the worker adds them) and fences since the last call."""
        spent, self.stalled_s = self.stalled_s, 0.0
        return spent

    # -- the writes ------------------------------------------------------------------------------

    def started(self, step: int, write: concurrent.futures.Future) -> None:
        self.last_write = write
        with self.changed:
            self.writes[step] = write
            self.changed.notify_all()

    def written(self, step: int, timeout_s: float) -> Any:
        """Save `step`'s write's result, once written; raises when this worker left the world
        the save was of."""
        with self.changed:
            world = self.world_left
            self.changed.wait_for(lambda: step in self.writes or self.world_left != world,
                                  timeout=timeout_s)
            write = self.writes.pop(step, None)
        if write is None:
            raise RuntimeError(f"checkpoint {step} was abandoned: this worker left its world")
        return write.result()

    def settle(self, timeout_s: float) -> None:
        """Let writes finish (bounded: files, no collectives) and forget them and the copies: a
        save in flight when the world breaks is never committed, and the next world makes its
        own copy (a sharded one's tensors name this world's mesh)."""
        with self.changed:
            writes, self.writes = list(self.writes.values()), {}
            self.world_left += 1  # a `written` still waiting gives up
            self.changed.notify_all()
        concurrent.futures.wait(writes, timeout=timeout_s)
        self.planned, self.buffers, self.prestaged, self.copying = {}, None, None, None


def _yield_to_training() -> None:
    """The writing thread takes only the CPU time that training leaves: Linux's SCHED_IDLE
    for this thread alone (a thread may always lower its own priority). Ray starts its workers
    at nice 15 (`RAY_worker_niceness`), so the fixed nice 10 this thread used to take put the
    write ahead of training wherever the process could raise it (as root: seen in a worker
    on a 2-core machine, the writing thread at 10, every training and gloo thread at 15). Where
    SCHED_IDLE is not available, 10 steps nicer than the thread that starts it."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):  # another system
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):  # the default priority
        pass


def _copy_into(buffers, tree, pin: bool = False):
    """`tree` (a state: dicts and lists of tensors and plain values) copied into host memory,
    reusing `buffers` (the previous copy) wherever a tensor's shape and dtype still match.
    `pin`: page-locked buffers, which a GPU copies into without staging (the caller waits for
    the copies)."""
    if isinstance(tree, torch.Tensor):
        if not (isinstance(buffers, torch.Tensor) and buffers.shape == tree.shape
                and buffers.dtype == tree.dtype):
            buffers = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=pin)
        buffers.copy_(tree.detach(), non_blocking=pin)
        return buffers
    if isinstance(tree, dict):
        old = buffers if isinstance(buffers, dict) else {}
        return {k: _copy_into(old.get(k), v, pin) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        old = buffers if isinstance(buffers, (list, tuple)) and len(buffers) == len(tree) else [None] * len(tree)
        return type(tree)(_copy_into(b, v, pin) for b, v in zip(old, tree))
    return copy.deepcopy(tree)


def empty_like(tree, pin: bool):
    """Host buffers shaped as `tree`'s tensors, zeroed (their pages mapped now, not by the
    first copy), for `_copy_into` to fill; other values None, which it copies anew."""
    return tree_map(lambda v: torch.zeros(v.shape, dtype=v.dtype, pin_memory=pin)
                    if isinstance(v, torch.Tensor) else None, tree)


def empty_shards(state: dict, pin: bool, zero: bool = True) -> dict:
    """`empty_like` for a sharded state: DTensors of the same meshes and placements, their
    local shards in host memory (torch's own helper, the one its async checkpointing stages
    with), zeroed when `zero` (their pages mapped now, not by the first copy)."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    buffers = _create_cpu_state_dict(state, pin_memory=pin)
    for t in tree_leaves(buffers) if zero else ():
        if isinstance(t, torch.Tensor):
            local(t).zero_()
    return buffers


def _same_shapes(state: dict, buffers: dict) -> bool:
    """Whether `buffers` (a copy of an earlier state, or allocated ahead) can hold a copy of
    `state`: the same keys in the same order (a dict's type aside: a state dict is an
    OrderedDict, torch's copy of it a dict), and tensors of the same local shapes and dtypes."""
    leaves, old = tree_flatten_with_path(state)[0], tree_flatten_with_path(buffers)[0]
    return len(leaves) == len(old) and all(
        path == old_path and (isinstance(b, torch.Tensor) and local(b).shape == local(t).shape
                              and b.dtype == t.dtype
                              if isinstance(t, torch.Tensor) else not isinstance(b, torch.Tensor))
        for (path, t), (old_path, b) in zip(leaves, old))
