"""Measured per-layer cost, for parallel.partition = time."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn


def layer_times(model: nn.Sequential, example: torch.Tensor, device: torch.device,
                repeats: int = 3, fill: Callable[[list[nn.Module]], None] = lambda layers: None
                ) -> list[float]:
    """Median seconds of forward + backward of each layer on `device`, fed what the previous
    layer makes. One layer at a time: each is given its values (`fill`, for a model on the
    meta device: models/layers.py), moved to the device, timed and let go, so a model larger
    than one device, or than the host, can be profiled for its stages."""
    times = []
    x = example.to(device)
    for layer in model:
        fill([layer])
        layer.to(device)
        runs = []
        for _ in range(repeats + 1):  # the first run warms up allocators and kernels
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(inp)
            y.backward(torch.ones_like(y))
            if y.device.type == "cuda":
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - t0)
        layer.to("meta")  # let go of its parameters and gradients
        times.append(sorted(runs[1:])[len(runs[1:]) // 2])
        x = y.detach()
    return times
