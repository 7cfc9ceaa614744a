"""Compiled steps (`train.compile`): each of the model's blocks is compiled in place with
`torch.compile` (`nn.Module.compile`), as torchtitan compiles its transformer blocks.

- Parameter names are unchanged (the module is not wrapped), so checkpoints load across the
  setting, and DDP, FSDP2 (which wraps after) and pipeline stages (cut from whole blocks)
  run compiled blocks as they run eager ones.
- Blocks of one kind share their compiled code: torch compiles the first and reuses it for the
  others (their parameters are inputs of the graph, not constants).
- Compilation happens at the first forward and backward a block runs; `compile_seconds` reads
  the time from torch's own counters, which the coordinator reports as the `compile` phase of a
  start, recovery or rescale.
- Inductor keeps what it generated in a cache on disk (`TORCHINDUCTOR_CACHE_DIR`, by default
  /tmp/torchinductor_USER on each node), so a worker started on a node that has compiled the
  model before (a recovery, a rescale, the next run) skips code generation and pays tracing
  only (measured in benchmarks/compile.py).
"""

from __future__ import annotations

import os
import shutil
import sys

from torch import nn

from baton.errors import WorkerError
from baton.models import blocks

CXX = tuple(c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c)
CC = tuple(c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c)  # Triton's launchers


def compile_blocks(model: nn.Module, setting: bool | str, device: str = "cpu") -> int:
    """Compile `model`'s blocks in place when `setting` (`train.compile`) says so for `device`
    ("auto": on CUDA only, where it measured 1.18x; on CPU 0.98x); returns how many."""
    if not (device == "cuda" if setting == "auto" else setting):
        return 0
    # Inductor builds C++ on CPU, and Triton a C launcher on GPU, at the first step; without a
    # compiler that step fails deep inside torch, so say it here, before the world trains.
    # "auto" on a GPU image without one (slim CUDA runtime images) trains eager instead.
    needed = CXX if device == "cpu" else CC
    if not any(shutil.which(c) for c in needed):
        if setting == "auto":
            print(f"baton: train.compile auto: no C compiler on this node ({', '.join(needed)}), "
                  "so this worker trains eager; install one (Debian: apt-get install gcc) to "
                  "compile", file=sys.stderr)
            return 0
        what = "C++ at the first step" if device == "cpu" else "Triton's C launchers at the first step"
        raise WorkerError(f"train.compile on {device.upper()} builds {what} and this node has no "
                          f"compiler ({', '.join(needed[-3:])} on PATH, or "
                          f"${'CXX' if device == 'cpu' else 'CC'}): install one (Debian: apt-get "
                          f"install {'g++' if device == 'cpu' else 'gcc'}) or set train.compile: false")
    found = blocks(model)
    for block in found:
        block.compile()
    return len(found)


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (forward and backward graphs); 0
    without importing torch's compiler (slow to import) where nothing imported it."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils.calculate_time_spent().get("total_wall_time", 0.0) if utils else 0.0
