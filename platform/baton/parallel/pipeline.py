"""The pipeline runtime: one rank's model chunks, executing a schedule from
`baton.parallel.schedule` with point-to-point sends and receives.

Why not `torch.distributed.pipelining`'s schedules (its stages and schedules do run between
Ray actors on gloo; the design notes measured that): baton needs three things they do not
give. (1) A timeline of every forward, backward and receive wait, per micro-batch, from which
the bubble is measured every step and drawn for one; torch's schedules only emit profiler
ranges. (2) Interleaved 1F1B for any micro-batch count (torch's requires m to be a multiple
of its round count: p=2, m=5 is refused). (3) Live activation bytes per stage, for the memory
comparison between schedules. What we keep from it is the shape of the protocol: activations
forward and gradients backward as plain tensors, sends posted together with the next receive
in one `batch_isend_irecv` (the NCCL-safe pattern its 1F1B uses), shapes agreed once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from baton.parallel.schedule import Action, owner_of, stage_of
from baton.training import local

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_HEADER = 8  # ndim, dtype code, up to 6 sizes


@dataclass
class StepTrace:
    """What one rank did in one step. Times are wall-clock seconds (time.time()), so the
    coordinator can line ranks up; compute intervals are what the bubble is measured from."""

    events: list = field(default_factory=list)  # (kind, micro-batch, stage, start, end)
    busy_s: float = 0.0
    first_start: float = 0.0
    last_end: float = 0.0
    peak_activation_bytes: int = 0
    peak_live: int = 0  # most micro-batch activations held at once, all chunks together


class PipelineRuntime:
    def __init__(self, chunks: list[nn.Module], rank: int, peers: list[int], v: int,
                 device: torch.device, bf16: bool, group=None,
                 before_backward: Optional[Callable[[int, bool], None]] = None):
        """`chunks[c]` is global stage c * p + rank; `peers[i]` is the global rank of pipeline
        rank i (send and receive address global ranks). `before_backward(chunk, last)` runs
        before each backward; `last`: the chunk's last of the step (sharded stages reduce
        their gradients then)."""
        self.chunks, self.rank, self.peers, self.v = chunks, rank, peers, v
        self.before_backward = before_backward
        self.p = len(peers)
        self.last = self.p * v - 1
        self.device, self.bf16, self.group = device, bf16, group
        self.in_shape: dict[int, tuple] = {}  # stage -> (shape, dtype) of what it receives
        self.out_shape: dict[int, tuple] = {}  # stage -> (shape, dtype) of what it sends on
        # How many actions beyond the next one have their receives posted early. gloo matches
        # messages by tag, and a message whose receive is not posted yet waits at its sender
        # until the receive is posted: posted only after the action before it, it then cost the
        # receiving rank 0.2-7 ms a message (the last stage's receive of the next activation,
        # sent while it ran a backward). NCCL matches by order and keeps the one pattern its
        # schedules are checked for (`order_problem`): each action's sends with the next
        # action's receive.
        self.ahead = 2 if dist.get_backend(group) == "gloo" else 0
        self._param_storages = {local(q).untyped_storage().data_ptr()
                                for c in chunks for q in c.parameters()}

    # -- shapes ---------------------------------------------------------------------------------

    def agree_shapes(self, example: torch.Tensor) -> None:
        """Run one micro-batch forward through the pipeline, stage by stage, without autograd
        or dropout, sending a small header with each activation; every later message then
        has a known shape and dtype. Micro-batches have a fixed size (short ones are padded),
        so the shapes hold for the whole run."""
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for c, chunk in enumerate(self.chunks):
                s = stage_of(self.rank, c, self.p)
                was_training = chunk.training
                chunk.eval()
                if s == 0:
                    x = example.to(self.device)
                else:
                    header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                    dist.recv(header, self._peer(s - 1), group=self.group)
                    ndim, code = int(header[0]), int(header[1])
                    shape = tuple(int(n) for n in header[2:2 + ndim])
                    self.in_shape[s] = (shape, _DTYPES[code])
                    x = torch.empty(shape, dtype=_DTYPES[code], device=self.device)
                    dist.recv(x, self._peer(s - 1), group=self.group)
                with self._autocast():
                    y = chunk(x)
                chunk.train(was_training)
                if s < self.last:
                    if not isinstance(y, torch.Tensor) or y.dim() > _HEADER - 2:
                        raise TypeError(f"pipeline stage {s} must return one tensor of at most "
                                        f"{_HEADER - 2} dims, got {type(y).__name__}")
                    self.out_shape[s] = (tuple(y.shape), y.dtype)
                    header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
                    header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
                    header[2:2 + y.dim()] = torch.tensor(y.shape)
                    dist.send(header, self._peer(s + 1), group=self.group)
                    dist.send(y.contiguous(), self._peer(s + 1), group=self.group)

    # -- one step -------------------------------------------------------------------------------

    def run(self, actions: list[Action], inputs: Optional[list[torch.Tensor]],
            targets: Optional[list[torch.Tensor]], loss_fn: Callable, scale: float,
            enter: Optional[Callable[[int], None]] = None,
            forwarded: Optional[Callable[[int, int], None]] = None) -> StepTrace:
        """Run this rank's actions for one step; gradients accumulate in the parameters.
        `inputs` (first stage) and `targets` (last stage) are per micro-batch; the loss of a
        micro-batch is loss_fn(output, target) * scale. `enter(mb)` is called before each
        forward and backward of micro-batch mb (what its layers read besides the activations:
        a backward's recomputation under activation checkpointing reads it again);
        `forwarded(mb, chunk)` after each forward (what its layers measured in it)."""
        trace = StepTrace()
        stash: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (input, output or loss)
        act_bytes: dict[tuple[int, int], int] = {}
        sends: list = []  # (works, event index) not yet seen complete
        recvs: dict[int, tuple] = {}  # action index -> its posted receive
        self._post(actions, range(min(1 + self.ahead, len(actions))), [], recvs, sends, trace)
        last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
        for i, a in enumerate(actions):
            s = stage_of(self.rank, a.chunk, self.p)
            got = self._wait(recvs.pop(i, None), trace, a, s)
            t0 = time.time()
            out = []
            if enter:
                enter(a.mb)
            if a.kind == "F":
                x = inputs[a.mb].to(self.device) if s == 0 else got.requires_grad_()
                with self._count_saved(act_bytes, (a.mb, a.chunk)), self._autocast():
                    y = self.chunks[a.chunk](x)
                if forwarded:
                    forwarded(a.mb, a.chunk)
                if s == self.last:
                    target = targets[a.mb]  # a tensor, or a task's batch (a dict of them)
                    part = loss_fn(y, {k: t.to(self.device) for k, t in target.items()}
                                   if isinstance(target, dict) else target.to(self.device))
                    y = part * scale
                else:
                    out.append((y.detach(), self._peer(s + 1), _tag("F", a.mb, s), a.mb, s))
                stash[(a.mb, a.chunk)] = (x, y)
                trace.peak_live = max(trace.peak_live, len(stash))
                trace.peak_activation_bytes = max(trace.peak_activation_bytes,
                                                  sum(act_bytes.values()))
            else:
                x, y = stash.pop((a.mb, a.chunk))
                if self.before_backward:
                    self.before_backward(a.chunk, last_backward[a.chunk] == i)
                if y.requires_grad:  # (not: a first stage that trains nothing, model.lora's)
                    torch.autograd.backward(y, None if s == self.last else got)
                act_bytes.pop((a.mb, a.chunk), None)
                if s > 0:
                    out.append((x.grad, self._peer(s - 1), _tag("B", a.mb, s), a.mb, s))
            t1 = time.time()
            trace.events.append((a.kind, a.mb, s, t0, t1))
            trace.busy_s += t1 - t0
            trace.first_start = trace.first_start or t0
            trace.last_end = t1
            due = i + 1 + self.ahead  # the receive of this action is posted now
            self._post(actions, range(due, min(due + 1, len(actions))), out, recvs, sends, trace)
            self._reap(sends, trace)
        for works, _ in sends:
            for work in works:
                work.wait()
        self._reap(sends, trace, done=True)
        return trace

    # -- messages -------------------------------------------------------------------------------

    def _post(self, actions: list[Action], due: range, out: list, recvs: dict, sends: list,
              trace: StepTrace) -> None:
        """Post this action's sends (`out`: tensor, peer, tag, micro-batch, stage) and the
        receives of the actions at indices `due` as one batch (NCCL runs a batch's operations
        together: a send and a receive crossing between two ranks cannot block each other)."""
        ops, bufs = [], []
        for tensor, peer, tag, _, _ in out:
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), peer, self.group, tag))
        for j in due:
            action = actions[j]
            s = stage_of(self.rank, action.chunk, self.p)
            if action.kind == "F" and s > 0:
                shape, dtype = self.in_shape[s]
                peer, tag = self._peer(s - 1), _tag("F", action.mb, s - 1)
            elif action.kind == "B" and s < self.last:
                shape, dtype = self.out_shape[s]  # the gradient of what this stage sent on
                peer, tag = self._peer(s + 1), _tag("B", action.mb, s + 1)
            else:
                continue
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, peer, self.group, tag))
            bufs.append((j, buf))
        if not ops:
            return
        now = time.time()
        works = dist.batch_isend_irecv(ops)
        # gloo: a work per operation; NCCL coalesces the batch into one work that completes
        # all of it (waiting on it also orders the compute stream after the receive)
        each = [[w] for w in works] if len(works) == len(ops) else [works] * len(ops)
        for (_, _, _, mb, stage), done in zip(out, each):
            trace.events.append(("send", mb, stage, now, None))
            sends.append((done, len(trace.events) - 1))
        for (j, buf), done in zip(bufs, each[len(out):]):
            recvs[j] = (buf, now, done)

    def _wait(self, recv, trace: StepTrace, action: Action, stage: int) -> Optional[torch.Tensor]:
        if recv is None:
            return None
        buf, posted, works = recv
        t0 = time.time()
        for w in works:
            w.wait()
        trace.events.append(("recv", action.mb, stage, max(posted, t0), time.time()))
        return buf

    def _reap(self, sends: list, trace: StepTrace, done: bool = False) -> None:
        """Stamp sends seen complete (at the resolution of one action) and forget them."""
        now = time.time()
        keep = []
        for works, idx in sends:
            if done or all(w.is_completed() for w in works):
                kind, mb, s, t0, _ = trace.events[idx]
                trace.events[idx] = (kind, mb, s, t0, now)
            else:
                keep.append((works, idx))
        sends[:] = keep

    def _peer(self, stage: int) -> int:
        return self.peers[owner_of(stage, self.p)[0]]

    def _autocast(self):
        return torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16)

    @contextlib.contextmanager
    def _count_saved(self, act_bytes: dict, key: tuple):
        """Bytes of the tensors autograd saves for this micro-batch's backward, parameters
        excluded, each storage counted once: the activation memory a schedule keeps alive."""
        seen: set = set()
        act_bytes[key] = 0
        # not `self`: autograd keeps a pack hook with each tensor it saves, and a graph left by
        # a failed step would keep this runtime, and so its process groups, alive
        params = self._param_storages

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and ptr not in params:
                seen.add(ptr)
                act_bytes[key] += storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield


def _tag(kind: str, mb: int, stage: int) -> int:
    """The message carrying `kind`'s result of micro-batch `mb` at `stage` (gloo matches by
    tag; NCCL ignores tags and relies on the order the schedule guarantees)."""
    return (mb * 4096 + stage) * 2 + (kind == "B")

