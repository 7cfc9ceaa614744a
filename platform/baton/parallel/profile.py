"""Measured per-layer cost, for parallel.partition = time."""

from __future__ import annotations

import time

import torch
from torch import nn


def layer_times(model: nn.Sequential, example: torch.Tensor, repeats: int = 3) -> list[float]:
    """Median seconds of forward + backward of each layer, fed what the previous layer makes."""
    times = [[] for _ in model]
    for _ in range(repeats + 1):  # the first round warms up allocators and kernels
        x = example
        for i, layer in enumerate(model):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(inp)
            y.backward(torch.ones_like(y))
            if y.device.type == "cuda":
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - t0)
            x = y
        model.zero_grad(set_to_none=True)
    return [sorted(t[1:])[len(t[1:]) // 2] for t in times]
