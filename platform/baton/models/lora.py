"""Low-rank adapters (LoRA, Hu et al. 2021): `model.lora` trains, beside each linear layer it
names, two small matrices whose product is added to the layer's weight, and leaves the rest of
the model as it was built (or as `model.init_from` gave it), frozen.

A linear layer y = x Wᵀ + b with an adapter computes y + (alpha / rank) · (x Aᵀ) Bᵀ, A of
(rank, in) drawn as torch draws a linear layer's weight, B of (out, rank) zeros: at the first
step the model is the one it was built as. A and B are parameters of the linear layer itself
(`lora_a`, `lora_b`, beside its `weight`), so the model keeps its modules and its names, every
wrapping baton gives a model (DDP, FSDP2, pipeline stages, compiled blocks, recomputed
activations) takes them as any parameter, and a checkpoint holds them with the frozen weights:
it loads at any layout as any checkpoint does. The optimizer holds only what trains, so its
state is the adapters', not the model's. `baton export` writes each adapted weight merged,
W + (alpha / rank) · B A, as a model without adapters (`merged`).

A's draws come from a stream of their own, seeded by the job's seed and the layer's name, so
the model's own weights are those it has without adapters, and a layer built alone (a
pipeline stage, a FSDP unit filled as it is sharded) gets the A the whole model's has. What
trains beside the adapters, and what freezing means everywhere: models/frozen.py."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from baton.models.frozen import freeze, named, trains

if TYPE_CHECKING:
    from baton.spec import LoRASpec, ModelSpec

A, B = "lora_a", "lora_b"  # the adapter's parameters' names, on the linear layer


def sizes(layer: nn.Module) -> Optional[tuple[int, int, bool]]:
    """(in, out, whether its weight is held as (in, out)) of a linear layer: torch's
    nn.Linear, or transformers' Conv1D (GPT-2's, its weight transposed); None for another."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features, False
    if type(layer).__name__ == "Conv1D" and hasattr(layer, "nx") and hasattr(layer, "nf"):
        return layer.nx, layer.nf, True
    return None


def targets(module: nn.Module, model: ModelSpec, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """(name in the whole model, layer) of the linear layers `model.lora.targets` names, but
    those whose weight trains whole (`model.lora.whole`, init_fresh, init_grow)."""
    return [(prefix + name, m) for name, m in module.named_modules()
            if sizes(m) is not None and named(prefix + name, model.lora.targets)
            and not trains(f"{prefix}{name}.weight", model)]


def attach(module: nn.Module, model: ModelSpec, seed: int, prefix: str = "") -> None:
    """Adapters on `module`'s target layers (named `prefix` + their name in it, as in the whole
    model), every other parameter frozen but those trained whole. On the meta device, the
    adapters' shapes only."""
    lora = model.lora
    freeze(module, model, prefix)
    for name, layer in targets(module, model, prefix):
        n_in, n_out, _ = sizes(layer)
        a = torch.empty(lora.rank, n_in, device=layer.weight.device)
        if a.device.type != "meta":
            _draw(a, seed, name)
        layer.register_parameter(A, nn.Parameter(a))
        layer.register_parameter(B, nn.Parameter(torch.zeros(n_out, lora.rank, device=layer.weight.device)))
        layer.lora_scale = lora.alpha / lora.rank
        layer.register_forward_hook(_adapted, with_kwargs=True)


def _draw(a: torch.Tensor, seed: int, name: str) -> None:
    """A as nn.Linear draws its weight (Kaiming-uniform, a = sqrt(5): bound 1 / sqrt(in)),
    from a stream of (seed, name) alone."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    bound = 1 / math.sqrt(a.shape[1])
    with torch.no_grad():
        a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=torch.Generator().manual_seed(key)))


def _adapted(layer: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else next(iter(kwargs.values()))  # (a layer called with input=x)
    a, b = getattr(layer, A), getattr(layer, B)
    return out + (x @ a.to(out.dtype).t()) @ b.to(out.dtype).t() * layer.lora_scale


def merged(tensors: Iterator[tuple[str, torch.Tensor]], lora: LoRASpec, adapted: dict[str, bool]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) with the weight of each layer in `adapted` merged
    (W + scale · B A, transposed for a weight held as (in, out): `adapted[layer]`) and the
    adapters left out, in the order the tensors come: a layer's three parts are held only
    until the last of them has come (neighbours, in name order or in a stage's own order)."""
    scale = lora.alpha / lora.rank
    held: dict[str, dict[str, torch.Tensor]] = {}  # adapted layer -> its parts seen so far
    for name, t in tensors:
        layer, _, part = name.rpartition(".")
        if layer not in adapted or part not in (A, B, "weight"):
            yield name, t
            continue
        parts = held.setdefault(layer, {})
        parts[part] = t
        if len(parts) == 3:
            del held[layer]
            yield f"{layer}.weight", _merge(parts["weight"], parts[A], parts[B], scale, adapted[layer])
    if held:
        raise ValueError(f"the checkpoint lacks parts of the adapted layers {sorted(held)[:3]}")


def _merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
           transposed: bool) -> torch.Tensor:
    product = b.double() @ a.double()  # (out, in)
    return (w.double() + scale * (product.t() if transposed else product)).to(w.dtype)


def adapted_layers(module: nn.Module, model: ModelSpec) -> dict[str, bool]:
    """The layers `model.lora.targets` adapts in `module` (built on meta: names only), each
    with whether its weight is held as (in, out)."""
    return {name: sizes(layer)[2] for name, layer in targets(module, model)}


def flops(module: nn.Module, model: ModelSpec) -> float:
    """The adapters' training FLOPs per token (`module` built on meta): 6 per parameter of
    each one's A and B, as models/flops.py counts a weight's."""
    return 6.0 * sum(model.lora.rank * (n_in + n_out) for _, m in targets(module, model)
                     for n_in, n_out, _ in [sizes(m)])


def problem(model: nn.Module, spec: ModelSpec) -> Optional[str]:
    """Why `spec.lora` cannot adapt `model` (built on meta), or None."""
    adapted = targets(model, spec)
    if not adapted:
        linear = [name for name, m in model.named_modules() if sizes(m) is not None]
        return (f"targets {spec.lora.targets} match no linear layer (nn.Linear, Conv1D) that does not "
                "train whole; the model's: " + (", ".join(linear[:8]) + (", ..." if len(linear) > 8 else "")
                                                 if linear else "none"))
    shared: dict[int, list[str]] = {}  # a tensor -> its names (tied weights: several)
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    for name, layer in adapted:
        tied = [n for n in shared[id(layer.weight)] if n != f"{name}.weight"]
        if tied:
            return (f"{name}.weight is tied to {tied[0]} (one tensor under two names), and "
                    f"merging an adapter into it would change both; leave {name} out of targets")
    return None
