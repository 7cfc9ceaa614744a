"""How a worker process uses its host's memory allocator.

A worker's steps run on a thread that is not the process's main one (the worker's training
thread, actor.py; before it, Ray's executor thread), so glibc serves their allocations from a
per-thread arena, and it gives the top of such an arena
back to the kernel whenever more than its trim threshold lies free there. A CPU step frees its
activations at the end and allocates them again in the next one, so every step faulted the
same pages back in: 23-25 thousand minor page faults a second in each worker of
`benchmarks/dp_throughput.py`, 6-7 % of a core in the kernel, against 0.1-5 thousand in the
plain DDP processes, whose loop runs on the main thread. Fixed thresholds keep freed memory
mapped for the next step (setting any of them also turns glibc's dynamic thresholds off):
under 60 faults a second, the training thread's CPU a step level with DDP's (126-128 ms
against DDP's 126-128 ms; before, 135-142 ms against 130-133 ms), the RSS unchanged at
620 MB (the memory a step frees is memory the next step needs again). Without Ray,
`python benchmarks/host_memory.py` runs the same step on a second thread: 1,248 page faults
a step with glibc's defaults, none with these settings, and a 0.969x step time.

It also reads how much memory the worker holds, which every step reports (`memory`), and
keeps Python's garbage collector off while a worker's modules load (`collector_paused`).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from typing import Iterator, Optional

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {M_TRIM_THRESHOLD: 512 << 20,  # above a thread arena's 64 MiB: its heaps are never trimmed
            M_TOP_PAD: 64 << 20,  # grow a heap in large steps
            M_MMAP_THRESHOLD: 32 << 20}  # glibc's largest: blocks under 32 MiB come from the arenas
# a user's own settings win: glibc reads these at start
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_")


def keep_freed_memory() -> bool:
    """Set glibc's allocator to keep freed memory mapped (see above); False where it is not
    glibc's, or where the environment already tunes it."""
    if any(k in os.environ for k in USER_SETTINGS) or "glibc.malloc" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    return all(mallopt(param, value) == 1 for param, value in SETTINGS.items())


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> Optional[int]:
    """This process's resident memory now (Linux: /proc/self/statm, about 20 us); where there
    is no /proc (macOS), its peak so far; None where neither can be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


@contextlib.contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """Python's cyclic garbage collector off while modules load. Importing torch, Ray's
    pieces and baton's worker modules makes some 370 thousand objects that live as long as
    the process, and the collector's full passes over them as they piled up took 0.9 s of
    each worker's start on the 2-core machine (5 passes of 70-320 ms, seen with a
    `gc.callbacks` probe); loading with it off costs 0.7 CPU-s less (median of 5 paired runs,
    docs/benchmarks.md). Loading makes little garbage (a collection
    after it finds about 10 thousand objects), so nothing is collected for it. `freeze`: then
    move what the process holds out of the collector's sight (`gc.freeze`, once per process),
    so that its later passes skip the modules; only in a worker's own process."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze and gc.get_freeze_count() == 0:
            gc.freeze()
        if was_on:
            gc.enable()
