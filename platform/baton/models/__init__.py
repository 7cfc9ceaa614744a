"""The model registry: a name ("gpt", "llama", "mlp", "classifier") or "package.module:function"
gives a builder.

A language model takes tokens (B, T) and returns logits (B, T, vocab); a classifier takes
features (B, inputs) and returns logits (B, classes). A user builder is called with the job's
`ModelSpec` and returns an `nn.Module` taking the task's `batch["inputs"]`; an `nn.Sequential`
can later be cut into stages.
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from baton.errors import reason

if TYPE_CHECKING:
    from torch import nn

    from baton.models.layers import Layers

# torch is imported where a model is built, not here: the spec's checks read the names and
# options below before Ray starts, and `baton run` imports torch while Ray starts (api.py)
HF_PREFIX = "hf:"  # model.name: hf:TYPE (models/hf.py)

__all__ = ["IGNORE", "MODELS", "OPTIONS", "REQUIRED", "build_lazily", "build_model", "blocks", "check_model_name",
           "layer_count", "layer_params", "loss_sum", "options_problem", "routed", "sequential"]


def __getattr__(name: str) -> Any:
    if name in ("IGNORE", "loss_sum"):  # their home before tasks existed: still found here
        from baton import tasks

        return getattr(tasks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def blocks(model: nn.Module) -> list[nn.Module]:
    """A model's repeated units: the layers of an nn.Sequential (embedding, blocks, head), or
    the entries of its nn.ModuleLists. What FSDP wraps one by one (each unit's parameters are
    gathered for its forward and backward and freed after, so peak memory is one unit, not
    the model), what train.compile compiles and what activation checkpointing wraps."""
    from torch import nn

    if isinstance(model, nn.Sequential) and len(model) > 1:
        return [m for m in model if any(True for _ in m.parameters())]
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def routed(model: nn.Module) -> list[nn.Module]:
    """The layers of `model` that route tokens among experts (a mixture of experts' blocks:
    models/llama.py's MoEBlock). Before each training forward the engine tells each the rows
    that count and the weight of a loss summed over them (`layer.balance(rows, weight)`);
    after it, it reads each one's choices (`layer.load`, a count an expert) and, where it
    adds losses on its routing (`layer.balances`: model.options.router_aux_loss,
    router_z_loss), what each was (`layer.losses`, by the name its mean is logged under)."""
    return [m for m in model.modules() if callable(getattr(m, "balance", None))]


def _gpt(spec) -> Layers:
    from baton.models.gpt import gpt_layers

    return gpt_layers(layers=spec.layers, width=spec.width, heads=spec.heads,
                      seq_len=spec.seq_len, vocab_size=spec.vocab_size, dropout=spec.dropout,
                      **spec.options)


def _llama(spec) -> Layers:
    from baton.models.llama import llama_layers

    return llama_layers(layers=spec.layers, width=spec.width, heads=spec.heads,
                        seq_len=spec.seq_len, vocab_size=spec.vocab_size, dropout=spec.dropout,
                        **spec.options)


def _mlp(spec) -> Layers:
    from baton.models.mlp import mlp_layers

    return mlp_layers(layers=spec.layers, width=spec.width, context=spec.context,
                      vocab_size=spec.vocab_size, **spec.options)


def _classifier(spec) -> Layers:
    from baton.models.mlp import classifier_layers

    return classifier_layers(layers=spec.layers, width=spec.width, dropout=spec.dropout,
                             **spec.options)


# the built-in models, as recipes of layers (models/layers.py): a worker can build the layers
# it holds without the rest. A builder of the user's may return a recipe too, or a module.
MODELS: dict[str, Callable[..., Layers]] = {"gpt": _gpt, "llama": _llama, "mlp": _mlp,
                                            "classifier": _classifier}
# the options each built-in model takes: name -> (least, most), whose type is the option's
# (an int, a float, which an integer also is, or a bool: (False, True))
OPTIONS: dict[str, dict[str, tuple]] = {
    "gpt": {}, "mlp": {"embed_dim": (1, 4096)},
    # llama: key-value heads (grouped-query attention; default: heads), the MLP's hidden
    # units (default: 8/3 of the width), the rotary embedding's base, RMSNorm's epsilon,
    # biases on q, k and v (Qwen2's), queries and keys normed (Qwen3's), a head's width
    # (default: width / heads), Llama 3.1's rotary scaling, a mixture of experts for each
    # block's MLP (Mixtral's, Qwen3-MoE's: each expert of `hidden` units; Qwen2-MoE's, with
    # a gated shared expert of `shared_expert` units), Mistral's sliding window of attention
    # (models/llama.py)
    "llama": {"kv_heads": (1, 2**12), "hidden": (1, 2**20), "rope_theta": (1.0, 1e12),
              "norm_eps": (1e-12, 0.1), "qkv_bias": (False, True), "qk_norm": (False, True),
              "head_dim": (2, 2**12), "rope_factor": (1.0, 1024.0),
              "rope_low_freq_factor": (0.01, 1024.0), "rope_high_freq_factor": (0.01, 1024.0),
              "rope_original_seq_len": (1, 2**24), "experts": (1, 2**12),
              "experts_per_token": (1, 2**12), "norm_topk": (False, True), "router_aux_loss": (0.0, 100.0),
              "router_z_loss": (0.0, 100.0),
              "shared_expert": (1, 2**20), "sliding_window": (1, 2**24)},
    "classifier": {"inputs": (1, 2**24), "classes": (2, 2**24)}}
REQUIRED = {"classifier": ("inputs", "classes")}  # options a built-in model cannot do without
_USER_BUILDER = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def check_model_name(name: str) -> Optional[str]:
    """None when `name` names a builder, else what would be valid."""
    if name in MODELS or name.startswith(HF_PREFIX):
        return None  # (an hf: model's type and configuration: options_problem)
    if not _USER_BUILDER.fullmatch(name):
        return f"use one of {', '.join(MODELS)} or 'package.module:function'"
    module, _, func = name.partition(":")
    try:  # the module's own code runs here: anything may come out of it
        builder = _user_builder(name)
    except AttributeError:
        return f"module {module!r} has no {func!r}"
    except (Exception, SystemExit) as e:
        return f"cannot load the builder: importing {module!r} raised {reason(e)}"
    if not callable(builder):
        return f"{name} is {type(builder).__name__}, not a function"
    return None


def options_problem(spec, on_meta: bool) -> Optional[str]:
    """Why the model cannot be built from `spec` (None: it can): a built-in model's options
    are checked by name and range; a user's builder, when `on_meta` (baton builds it there
    anyway to cut or wrap it), is run on the meta device (shapes only), with any exception
    turned into one line. Not otherwise: a builder that works on CPU may not on meta."""
    if spec.name.startswith(HF_PREFIX):
        from baton.models import hf

        return hf.problem(spec)
    if spec.name in OPTIONS:
        allowed = OPTIONS[spec.name]
        missing = [k for k in REQUIRED.get(spec.name, ()) if k not in spec.options]
        if missing:
            return (f"{spec.name} needs model.options {' and '.join(missing)} "
                    f"(e.g. {{inputs: 64, classes: 10}}: features per sample, classes)")
        for key, value in spec.options.items():
            if key not in allowed:
                near = difflib.get_close_matches(str(key), allowed, n=1)
                return (f"{spec.name} takes no option {key!r}"
                        + (f" (did you mean {near[0]!r}?)" if near else "")
                        + (f"; it takes {', '.join(allowed)}" if allowed else "; it takes none"))
            problem = _option_problem(key, value, *allowed[key])
            if problem:
                return problem
        return None
    if not on_meta:
        return None
    try:
        _on_meta(spec)
    except Exception as e:
        return f"the builder {spec.name} failed on these settings: {reason(e)}"
    return None


def _option_problem(key: str, value: Any, least: Any, most: Any) -> Optional[str]:
    if isinstance(least, bool):
        return None if isinstance(value, bool) else f"{key} must be true or false, not {value!r}"[:200]
    kind, what = (float, "a number") if isinstance(least, float) else (int, "an integer")
    if isinstance(value, bool) or not isinstance(value, (int, kind)) or not least <= value <= most:
        shown = "g" if kind is float else "d"
        return f"{key} must be {what} in [{least:{shown}}, {most:{shown}}], not {value!r}"[:200]
    return None


def _user_builder(name: str) -> Callable:
    if name.startswith(HF_PREFIX):
        from baton.models import hf

        return hf.build_hf
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def build_model(spec, seed: int) -> nn.Module:
    """Build the model with parameters drawn from `seed`, identically in every process."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _whole(_builder(spec)(spec))
    weights = _init_from(spec)
    if weights is not None:
        weights.load_into(model)
        weights.close()
    _adapter(spec, seed)(model, "")
    return model


def adapted_on_meta(spec) -> nn.Module:
    """The model on the meta device as a worker holds it: with model.lora's adapters, and
    what does not train frozen (model.frozen, model.lora)."""
    module = _on_meta(spec)
    _adapter(spec, 0)(module, "")  # (on meta: shapes only)
    return module


def _adapter(spec, seed: int) -> Callable[[nn.Module, str], None]:
    """What freezes the parameters of a model built (or of a layer of it, named from
    `prefix` in the whole model) that do not train (`model.frozen`), or adds `model.lora`'s
    adapters and freezes the rest: nothing where the whole model trains."""
    if spec.lora is not None:
        from baton.models import lora

        read: dict = {}  # model.lora.init_from's adapters, read once, when first given

        def start() -> dict:
            if not read:
                read.update(lora.started(spec))
            return read
        return lambda module, prefix: lora.attach(module, spec, seed, prefix,
                                                  start if spec.lora.init_from else None)
    if spec.frozen:
        from baton.models import frozen

        return lambda module, prefix: frozen.freeze(module, spec, prefix)
    return lambda module, prefix: None


def _init_from(spec):
    """The export `model.init_from` names, for a model of baton's or a builder's (an hf:
    model's builder reads its own with from_pretrained), or None."""
    if spec.init_from is None or spec.name.startswith(HF_PREFIX):
        return None
    from baton.checkpoint.export import Exported

    return Exported(spec.init_from, spec.init_fresh, spec.init_grow)


def build_lazily(spec, seed: int) -> tuple[nn.Module, Callable[[Iterable[nn.Module]], None]]:
    """The model and `fill(layers)`, which gives those of its layers the values `build_model`
    would, in the model's order. A model made by a recipe (the built-in ones, or a builder of
    the user's that returns `Layers`) starts on the meta device and gets its layers' values
    only as they are filled (models/layers.py), so a worker that keeps a part of it (sharded,
    a pipeline stage) never holds the whole in memory. A builder that returns a module has
    built it whole, and `fill` has nothing to do."""
    import torch

    from baton.models.layers import LayerByLayer, Layers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        made = _builder(spec)(spec)  # a module is built here, whole, as build_model builds it
    weights = _init_from(spec)
    if not isinstance(made, Layers):
        if weights is not None:
            weights.load_into(made)
            weights.close()
        _adapter(spec, seed)(made, "")
        return made, lambda layers: None
    lazy = LayerByLayer(made, seed, weights, _adapter(spec, seed))
    return lazy.module, lazy.fill


def _builder(spec) -> Callable:
    return MODELS.get(spec.name) or _user_builder(spec.name)


def _whole(made) -> nn.Module:
    from baton.models.layers import Layers

    return made.build() if isinstance(made, Layers) else made


def _on_meta(spec) -> nn.Module:
    """The model built on the meta device: shapes only, no memory, no time."""
    import torch

    with torch.device("meta"):
        return _whole(_builder(spec)(spec))


def layer_count(spec) -> int:
    """How many layers a pipeline can cut the model into; a model that is not an
    nn.Sequential counts as one."""
    from torch import nn

    model = _on_meta(spec)
    return len(model) if isinstance(model, nn.Sequential) else 1


def layer_params(spec) -> list[int]:
    """Parameters per layer: what parallel.partition = params balances."""
    model = sequential(_on_meta(spec), spec.name)
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def sequential(model: nn.Module, name: str) -> nn.Sequential:
    from torch import nn

    if not isinstance(model, nn.Sequential):
        raise TypeError(f"model {name!r} is a {type(model).__name__}; pipeline stages cut an "
                        "nn.Sequential, so return one from the builder (or use parallel.pp: 1)")
    return model
