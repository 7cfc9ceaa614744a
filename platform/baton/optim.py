"""What torch's optimizers lack: LAMB, and an average of the weights (`Averaged`).

LAMB: layer-wise adaptive moments for large batches (You et al., 2020, "Large Batch
Optimization for Deep Learning: Training BERT in 76 Minutes", Algorithm 2). torch has none.

Adam's direction with decoupled weight decay, each parameter tensor's step scaled by its
trust ratio ||x|| / ||update||, so that every layer moves by about lr times its own size
whatever the batch: what lets `batch_policy: scale_lr` raise the learning rate with many
replicas and keep converging. Moments are bias-corrected (as the paper's experiments and
NVIDIA's implementation do); a tensor whose norm or whose update's norm is 0 takes ratio 1.

Element-wise work runs foreach over a group's tensors (on their local shards when sharded:
the state is a DTensor like the parameter, so checkpoints reshard it as they do AdamW's);
the two norms of each tensor are of the whole tensor, across its shards."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _norm(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The norm of the whole tensor whose local part is `values` (`like`: the parameter, a
    DTensor when sharded, which says how the parts are spread)."""
    if hasattr(like, "to_local"):
        from torch.distributed.tensor import DTensor

        whole = DTensor.from_local(values, like.device_mesh, like.placements, run_check=False,
                                   shape=like.shape, stride=like.stride())
        return torch.linalg.vector_norm(whole).full_tensor()
    return torch.linalg.vector_norm(values)


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            (b1, b2), eps, wd = group["betas"], group["eps"], group["weight_decay"]
            t = float(self.state[params[0]]["step"])
            xs = [_local(p) for p in params]
            gs = [_local(p.grad) for p in params]
            ms = [_local(self.state[p]["exp_avg"]) for p in params]
            vs = [_local(self.state[p]["exp_avg_sq"]) for p in params]
            torch._foreach_lerp_(ms, gs, 1 - b1)  # m = b1 m + (1 - b1) g
            torch._foreach_mul_(vs, b2)
            torch._foreach_addcmul_(vs, gs, gs, 1 - b2)  # v = b2 v + (1 - b2) g^2
            denom = torch._foreach_div(vs, 1 - b2 ** t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(ms, denom)  # m_hat / (sqrt(v_hat) + eps) ...
            torch._foreach_div_(update, 1 - b1 ** t)  # ... with m's bias correction
            if wd:
                torch._foreach_add_(update, xs, alpha=wd)  # + lambda x (decoupled)
            ratios = []
            for p, x, u in zip(params, xs, update):
                w, n = _norm(p, x), _norm(p, u)
                ratios.append(torch.where((w > 0) & (n > 0), w / n, torch.ones_like(w)))
            torch._foreach_mul_(update, ratios)
            torch._foreach_add_(xs, update, alpha=-group["lr"])
        return loss


class Averaged:
    """A mixin that keeps an exponential moving average of the weights each step updates
    (`train.ema`): after the step, ema <- decay ema + (1 - decay) w, starting from the weights
    the first step starts from. The average is the optimizer's state, "ema" beside Adam's
    moments, so it is a shard where they are (ZeRO-1, -2, -3), a tensor-parallel piece where
    they are, and checkpointed, resharded and loaded with them at any layout. A parameter whose
    state has no average (a checkpoint written without train.ema) starts one from its weights
    at its next step. A skipped step (`train.skip_nonfinite`) updates none."""

    def __init__(self, params, *, ema: float, **kwargs):
        super().__init__(params, **kwargs)
        self.ema_decay = ema

    @torch.no_grad()
    def step(self, closure=None):
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        # (added after the step: the optimizer initialises a parameter's state when it is empty)
        first = {p: p.detach().clone() for p in stepped if "ema" not in self.state[p]}
        loss = super().step(closure)
        for p, start in first.items():
            self.state[p]["ema"] = start
        if stepped:
            torch._foreach_lerp_([_local(self.state[p]["ema"]) for p in stepped],
                                 [_local(p) for p in stepped], 1 - self.ema_decay)
        return loss


_AVERAGED: dict[type, type] = {}


def averaged(cls: type) -> type:
    """`cls` (an optimizer class) with `Averaged`'s moving average of the weights: its
    constructor takes `ema=decay` beside `cls`'s own arguments."""
    if cls not in _AVERAGED:
        _AVERAGED[cls] = type(f"Averaged{cls.__name__}", (Averaged, cls), {})
    return _AVERAGED[cls]


def keeps_average(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` (or the one ZeRO-1's ZeroRedundancyOptimizer steps) is `Averaged`."""
    return isinstance(getattr(optimizer, "optim", optimizer), Averaged)


def fitted(optimizer: torch.optim.Optimizer, optim_state: dict) -> dict:
    """An optimizer state by name (`state_dict()`'s form) as `optimizer` takes it: less its
    averages where `optimizer` keeps none (a checkpoint written with train.ema, resumed
    without). The converse needs nothing: an average starts from the weights at the next step."""
    if keeps_average(optimizer):
        return optim_state
    return {**optim_state, "state": {n: {k: v for k, v in s.items() if k != "ema"}
                                     for n, s in optim_state["state"].items()}}


@contextlib.contextmanager
def averages_in(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[None]:
    """Inside the block each weight holds its average (`pairs`: (weight, average), local
    parts); after it, its own values again, bit for bit. Holds one more copy of them meanwhile."""
    kept = [w.clone() for w, _ in pairs]
    try:
        with torch.no_grad():
            for w, a in pairs:
                w.copy_(a)
        yield
    finally:
        with torch.no_grad():
            for (w, _), k in zip(pairs, kept):
                w.copy_(k)


def average_pairs(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, average) of each parameter `optimizer` steps that has one, local parts."""
    return [(_local(p), _local(s["ema"])) for p, s in optimizer.state.items() if "ema" in s]
