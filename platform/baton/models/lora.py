"""Low-rank adapters (LoRA, Hu et al. 2021): `model.lora` trains, beside each linear layer it
names, two small matrices whose product is added to the layer's weight, and leaves the rest of
the model as it was built (or as `model.init_from` gave it), frozen.

A linear layer y = x Wᵀ + b with an adapter computes y + (alpha / rank) · (x Aᵀ) Bᵀ (under
`rslora`, alpha / sqrt(rank): `scale`), A of (rank, in) drawn as torch draws a linear layer's
weight, B of (out, rank) zeros: at the first step the model is the one it was built as. A and
B are parameters of the linear layer itself (`lora_a`, `lora_b`, beside its `weight`), so the
model keeps its modules and its names, every wrapping baton gives a model (DDP, FSDP2,
pipeline stages, compiled blocks, recomputed activations, tensor parallelism's shares) takes
them as any parameter, and a checkpoint holds them as any parameter: it loads at any layout
(the frozen weights of a model started from an export stay in that export:
checkpoint/frozen.py). The optimizer holds only what trains, so its
state is the adapters', not the model's. `baton export` writes each adapted weight merged,
W + (alpha / rank) · B A, as a model without adapters (`merged`).

A's draws come from a stream of their own, seeded by the job's seed and the layer's name, so
the model's own weights are those it has without adapters, and a layer built alone (a
pipeline stage, a FSDP unit filled as it is sharded) gets the A the whole model's has. What
trains beside the adapters, and what freezing means everywhere: models/frozen.py."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
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


def attach(module: nn.Module, model: ModelSpec, seed: int, prefix: str = "",
           start: Optional[Callable[[], dict[str, tuple[torch.Tensor, torch.Tensor]]]] = None) -> None:
    """Adapters on `module`'s target layers (named `prefix` + their name in it, as in the whole
    model), every other parameter frozen but those trained whole. On the meta device, the
    adapters' shapes only. `start()`: each layer's (A, B) to start from (`model.lora.init_from`:
    `started`), instead of A drawn and B zeros; asked for only where there are values to give."""
    lora = model.lora
    freeze(module, model, prefix)
    for name, layer in targets(module, model, prefix):
        n_in, n_out, _ = sizes(layer)
        a = torch.empty(lora.rank, n_in, device=layer.weight.device)
        b = torch.zeros(n_out, lora.rank, device=layer.weight.device)
        if a.device.type != "meta":
            if start is None:
                _draw(a, seed, name)
            else:
                a.copy_(start()[name][0])
                b.copy_(start()[name][1])
        layer.register_parameter(A, nn.Parameter(a))
        layer.register_parameter(B, nn.Parameter(b))
        layer.lora_scale, layer.lora_dropout = scale(lora), lora.dropout
        layer.register_forward_hook(_adapted, with_kwargs=True)


def scale(lora: LoRASpec) -> float:
    """What an adapter's product is multiplied by: alpha / rank, or under rank-stabilised
    LoRA (`model.lora.rslora`) alpha / sqrt(rank), which keeps the product's scale as the
    rank grows."""
    return lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)


def _draw(a: torch.Tensor, seed: int, name: str) -> None:
    """A as nn.Linear draws its weight (Kaiming-uniform, a = sqrt(5): bound 1 / sqrt(in)),
    from a stream of (seed, name) alone."""
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    bound = 1 / math.sqrt(a.shape[1])
    with torch.no_grad():
        a.copy_(torch.empty(a.shape).uniform_(-bound, bound, generator=torch.Generator().manual_seed(key)))


def _adapted(layer: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> torch.Tensor:
    x = args[0] if args else next(iter(kwargs.values()))  # (a layer called with input=x)
    return out + delta(layer, x, out.dtype)


def delta(layer: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What `layer`'s adapter adds to its output for input x: scale · (drop(x) Aᵀ) Bᵀ, as
    PEFT computes it (`model.lora.dropout` on the input, in training; a layer split over tp
    workers: parallel/tensor.py, its share of it)."""
    a, b = getattr(layer, A), getattr(layer, B)
    if layer.lora_dropout and layer.training:
        x = F.dropout(x, layer.lora_dropout)
    return (x @ a.to(dtype).t()) @ b.to(dtype).t() * layer.lora_scale


def merged(tensors: Iterator[tuple[str, torch.Tensor]], lora: LoRASpec, adapted: dict[str, bool]
           ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) with the weight of each layer in `adapted` merged
    (W + scale · B A, transposed for a weight held as (in, out): `adapted[layer]`) and the
    adapters left out, in the order the tensors come: a layer's three parts are held only
    until the last of them has come (neighbours, in name order or in a stage's own order)."""
    factor = scale(lora)
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
            yield f"{layer}.weight", _merge(parts["weight"], parts[A], parts[B], factor, adapted[layer])
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


# PEFT's LoRA folder (`baton export --adapters` writes it; `model.lora.init_from` reads it, or
# one PEFT's save_pretrained wrote): each adapted layer's A and B under these keys, the layer
# named as the model's form names it
PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
PEFT_PART = {A: "lora_A", B: "lora_B"}


def peft_key(layer: str, part: str) -> str:
    return f"base_model.model.{layer}.{PEFT_PART[part]}.weight"


def peft_names(layers, model: ModelSpec) -> dict[str, dict[str, str]]:
    """For each form a model's layers are named in (baton's own; transformers' for an hf:
    model; GPT-2's for the built-in GPT exported --hf, Llama's for the built-in llama),
    baton's name of each layer by that form's."""
    from baton.checkpoint.export import FORMS, HF_NAMES
    from baton.models import HF_PREFIX

    forms = {"baton": {n: n for n in layers}}
    if model.name.startswith(HF_PREFIX):
        forms["transformers"] = {n[len(HF_NAMES):] if n.startswith(HF_NAMES) else n: n for n in layers}
    if model.name in FORMS:
        form = FORMS[model.name]
        forms[form.names] = {form.name(f"{n}.weight", model)[0][:-len(".weight")]: n
                             for n in layers}
    return forms


def started(model: ModelSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The (A, B) of each layer this job adapts, by baton's name, from `model.lora.init_from`
    (read whole: adapters are small); CheckpointError naming what does not fit this job."""
    import json

    from baton import storage
    from baton.checkpoint.export import located
    from baton.checkpoint.tensorfile import TensorFile
    from baton.errors import CheckpointError
    from baton.models import _on_meta

    lora, folder = model.lora, model.lora.init_from
    where = storage.redact(folder)
    fs, path = located(folder)
    try:
        config = json.loads(storage.read_retried(fs, f"{path}/{PEFT_CONFIG}"))
        with TensorFile(fs, f"{path}/{PEFT_WEIGHTS}") as f:
            tensors = {k: f.get(k) for k in f.keys()}
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where} is not a LoRA adapter folder ({PEFT_CONFIG} and "
                              f"{PEFT_WEIGHTS}, as baton export --adapters and PEFT write it): "
                              f"{type(e).__name__}: {storage.redact(str(e))[:200]}") from None
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where} holds {config.get('peft_type')!r} adapters, not LoRA")
    plain = {"r": lora.rank, "lora_alpha": lora.alpha, "bias": "none", "use_dora": False,
             "use_rslora": lora.rslora, "rank_pattern": {}, "alpha_pattern": {}}
    for key, want in plain.items():
        got = config.get(key, want)
        if key.endswith("_pattern"):  # (PEFT writes none as {} or null)
            got = got or {}
        if got != want:
            raise CheckpointError(f"{where}: its {key} is {got!r} and this job's is {want!r} "
                                  + ("(set model.lora.rank and alpha to its r and lora_alpha)"
                                     if key in ("r", "lora_alpha") else
                                     "(set model.lora.rslora to it)" if key == "use_rslora" else
                                     "(baton trains plain LoRA)"))
    mine = {name: layer for name, layer in targets(_on_meta(model), model)}
    have = {k[len("base_model.model."):-len(".lora_A.weight")] for k in tensors
            if k.startswith("base_model.model.") and k.endswith(".lora_A.weight")}
    forms = peft_names(mine, model)
    form = max(forms, key=lambda f: len(have & set(forms[f])))
    theirs = forms[form]
    if have != set(theirs):
        extra, missing = sorted(have - set(theirs)), sorted(set(theirs) - have)
        raise CheckpointError(
            f"{where} adapts " + (f"{extra[0]}, which this job's model.lora.targets do not"
                                  if extra else f"no {missing[0]}, which this job's targets do")
            + f" ({len(have)} layers there, {len(theirs)} here; named as {form}'s)")
    out = {}
    for layer, name in theirs.items():
        n_in, n_out, _ = sizes(mine[name])
        a, b = (tensors.get(peft_key(layer, part)) for part in (A, B))
        for part, t, shape in ((A, a, (lora.rank, n_in)), (B, b, (n_out, lora.rank))):
            if t is None or tuple(t.shape) != shape:
                raise CheckpointError(f"{where}: {peft_key(layer, part)} is "
                                      + ("missing" if t is None else f"of shape {list(t.shape)}")
                                      + f"; this job's {name} takes {list(shape)}")
        out[name] = (a.float(), b.float())
    return out
