"""A data-parallel step under `torch.profiler` (the traced step, `tracking.trace_step`): the
forward and backward of one replica with its gradient all-reduce, as a Chrome trace, and how
much of the all-reduce ran while the backward still computed (`comm_overlap`).

DDP launches each bucket's all-reduce as soon as the backward has produced its gradients, so
the communication should run beside the rest of the backward, not after it. On CPU the
profiler sees gloo's work on gloo's own thread (`gloo:all_reduce`, and FSDP's
`gloo:reduce_scatter`) and the backward's on the autograd thread; on a GPU, NCCL's kernels
(`ncclDevKernel_AllReduce...`, `..._ReduceScatter...`) on their stream beside the compute
kernels. The overlap is the share of the communication's time that falls inside a
compute interval of the same trace; 0 means every byte waited for the backward to end.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Iterator, Optional

COMPUTE_CPU = "autograd::engine::evaluate_function"  # each backward op, on the autograd thread


def prepare() -> None:
    """Start the profiler once, empty, on the thread that imported torch (a Ray actor's
    constructor's; its methods run on other threads). torch's profiler client is registered
    on that thread, and a first profile started on another prints "ERROR: External init
    callback must run in same thread as registerClient" (the client's init does nothing: the
    profile is whole either way) on the worker's stderr, which reaches the run's console.
    Kineto also prints "profiler_start" and "profiler_stop" lines at its highest level
    (USDT, above ERROR): its level is set first, as it is read at that first start; a user's
    own setting is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import profile

    with profile():
        pass


@contextlib.contextmanager
def profiled(into: dict) -> Iterator[None]:
    """Profile the block (CPU, and CUDA where there is one); `into["profile"]` is then its
    Chrome trace (a dict in Chrome's trace-event format)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        yield
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            into["profile"] = json.load(f)
    finally:
        os.remove(path)


GRADIENT_COMM = ("all_reduce", "reduce_scatter", "AllReduce", "ReduceScatter")  # DDP's, FSDP's


def _is_comm(event: dict) -> bool:
    name = event.get("name", "")
    ours = name.startswith("gloo:") or (event.get("cat") == "kernel" and name.startswith("nccl"))
    return ours and any(c in name for c in GRADIENT_COMM)


def _is_compute(event: dict, gpu: bool) -> bool:
    if gpu:
        return event.get("cat") == "kernel" and not event.get("name", "").startswith("nccl")
    return event.get("name", "").startswith(COMPUTE_CPU)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def comm_overlap(trace: dict) -> Optional[float]:
    """The share of the gradient communication's time (all-reduce: gloo's on CPU, NCCL's
    kernels on a GPU) that ran while compute ran (the backward's ops on CPU, the other
    kernels on a GPU); None when the trace holds no communication (a world of one)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if _is_comm(e)]
    if not comm:
        return None
    gpu = any(e.get("cat") == "kernel" for e in events)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if _is_compute(e, gpu)])
    total = sum(end - start for start, end in comm)
    inside = sum(max(0.0, min(end, b1) - max(start, b0)) for start, end in comm for b0, b1 in busy)
    return min(1.0, inside / total) if total > 0 else None
