"""An emulated device for the pipeline benchmark: layers whose forward and backward sleep a
fixed time, so equal-cost stages stay equal however many share this machine's cores."""

from __future__ import annotations

import time

import torch
from torch import nn


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_s: float, bwd_s: float):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class SleepLayer(nn.Module):
    def __init__(self, inner: nn.Module, fwd_s: float, bwd_s: float):
        super().__init__()
        self.inner, self.fwd_s, self.bwd_s = inner, fwd_s, bwd_s

    def forward(self, x):
        return _Sleep.apply(self.inner(x), self.fwd_s, self.bwd_s)


def build(spec) -> nn.Sequential:
    """spec.layers equal layers: embedding first, the vocabulary head last."""
    fwd_s, bwd_s = spec.options["fwd_s"], spec.options["bwd_s"]
    w = spec.width
    inner = ([nn.Embedding(spec.vocab_size, w)] + [nn.Linear(w, w) for _ in range(spec.layers - 2)]
             + [nn.Linear(w, spec.vocab_size)])
    return nn.Sequential(*[SleepLayer(m, fwd_s, bwd_s) for m in inner])
