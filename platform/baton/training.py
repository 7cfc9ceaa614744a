"""The optimisation recipe, as plain functions: the workers use them, and so does any
single-process reference that wants to compute exactly what baton computes."""

from __future__ import annotations

import hashlib
import zlib

import torch
from torch import nn

from baton.spec import TrainSpec


def param_groups(model: nn.Module, train: TrainSpec) -> list[dict]:
    """Weight decay on matrices only (not on biases, norms' gains or positions' rows). A
    model of sharded (DTensor) and whole parameters both (expert parallelism's experts under
    ZeRO) has each kind in groups of its own: a fused or foreach update takes one kind a call."""
    trained = [p for p in model.parameters() if p.requires_grad]  # (model.lora: the adapters)
    groups = []
    for params, decay in (([p for p in trained if p.dim() >= 2], train.weight_decay),
                          ([p for p in trained if p.dim() < 2], 0.0)):
        sharded = [p for p in params if hasattr(p, "to_local")]
        whole = [p for p in params if not hasattr(p, "to_local")]
        groups += [{"params": ps, "weight_decay": decay}
                   for ps in ((sharded, whole) if sharded and whole else (params,))]
    return groups


def optimizer_class(train: TrainSpec) -> tuple[type, dict]:
    """train.optimizer's class and its arguments besides the parameters. AdamW is torch's
    fused kernel on CUDA and on CPU alike (one call for every tensor's update, DTensor shards
    included). On CPU it took 3.8-4.8 ms a step where the per-tensor loop took 13-15 ms (the
    4 x 256 GPT at dp 2, DDP and ZeRO-3; the loop is slowest on DTensor shards, each of its
    ops dispatched per tensor; `benchmarks/fsdp_comm.py --parts step`); after 20 steps it is
    2.4e-7 from the loop. Every reference in the tests builds its optimizer here too.
    `train.ema`: the class keeps an average of the weights too (`optim.Averaged`)."""
    if train.optimizer == "lamb":
        from baton.optim import Lamb

        cls, kwargs = Lamb, {"lr": train.lr, "betas": tuple(train.betas)}
    else:
        cls, kwargs = torch.optim.AdamW, {"lr": train.lr, "betas": tuple(train.betas), "fused": True}
    if train.ema is None:
        return cls, kwargs
    from baton.optim import averaged

    return averaged(cls), {**kwargs, "ema": train.ema}


def make_optimizer(model: nn.Module, train: TrainSpec) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(train)
    return cls(param_groups(model, train), **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_and_norm(model: nn.Module, grad_clip: float) -> float:
    """Clip gradients to `grad_clip` (0: no clipping) and return their norm before clipping."""
    return float(clip_grads(model, grad_clip))


def clip_grads(model: nn.Module, grad_clip: float) -> torch.Tensor:
    """`clip_and_norm` without reading the norm: a tensor on the gradients' device, so that a
    GPU goes on to the optimizer step without waiting for the host to read it."""
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # sharded gradients (DTensors) give a DTensor norm: its value is the whole model's
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def scale_to_norm(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Clip `grads` (each worker's share of the model's) by their whole norm `norm`, computed
    by the caller over every worker that holds a share; returns the norm, a tensor not yet read."""
    if max_norm > 0 and grads:  # (none: a pipeline stage that trains nothing, model.lora's)
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this worker holds of a sharded tensor); a plain tensor
    itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def param_digest(model: nn.Module) -> str:
    """A hash of every parameter's bytes, in name order: equal digests, identical replicas.
    SHA-256 over each name and a checksum of each tensor. Host tensors: their bytes' CRC-32
    (the digest holds the training thread: 455 MB at 2.85 GB/s, against SHA-256's 1.2 GB/s,
    `benchmarks/write_cost.py`). Device tensors: `device_checksums`, so that 8 bytes a tensor
    come back to the host, not the model (on a GPU, reading 455 MB back and hashing it held
    the training thread for about 0.4 s at every checkpoint)."""
    h = hashlib.sha256()
    on_device = []
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = local(p).detach()
        if t.device.type == "cpu":
            h.update(zlib.crc32(t.contiguous().numpy()).to_bytes(4, "little"))  # its buffer, not a copy
        else:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            on_device.append(t)
    if on_device:
        h.update(device_checksums(on_device).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ODD = -7046029254386353131  # 0x9E3779B97F4A7C15 (the golden ratio's bits) as a signed int64


def device_checksums(tensors: list[torch.Tensor], chunk: int = 1 << 22) -> torch.Tensor:
    """One int64 a tensor, computed where the tensor lives: the sum over its elements of the
    element's bits times an odd weight, 2 x position x K + 1 (int64 arithmetic wraps). An odd
    weight has no factor 2 for the wrap-around to cancel, so any one changed bit changes the
    sum; two elements swapped change it too unless their difference times their distance is
    a multiple of 2^63. Chunked: the temporaries are at most `chunk` elements (32 MiB of
    int64) whatever the tensor's size."""
    sums = []
    for t in tensors:
        bits = t.contiguous().reshape(-1).view(_INT[t.element_size()])
        acc = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, bits.numel(), chunk):
            part = bits[start:start + chunk].to(torch.int64)
            weight = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device)
            acc += (part * weight.mul_(_ODD).mul_(2).add_(1)).sum()
        sums.append(acc)
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)
