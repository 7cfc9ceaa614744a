"""Which parameters train: all of them, but those `model.frozen` names; under `model.lora`,
none of the model's own but those `model.lora.whole` names (the adapters train). The
parameters `model.init_fresh` and `init_grow` name always train: `model.init_from` gave them
no values (or not all of them). A frozen parameter gets no gradient, and the optimizer does
not hold it (`baton.training.param_groups`), under every parallelism. A job that starts from
an export (`model.init_from`) keeps the export's values of its frozen parameters to the end,
so its checkpoints leave them out (`from_start`): a LoRA job's checkpoint holds its adapters,
not the model they adapt."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from baton.spec import ModelSpec


def named(name: str, patterns) -> bool:
    """A shell pattern of `patterns` names this parameter (or layer, or buffer): the model's
    names in model.frozen, init_fresh, init_grow and lora's targets and whole."""
    return any(fnmatchcase(name, p) for p in patterns)


def trains(name: str, model: ModelSpec) -> bool:
    """Whether the parameter `name` (in the whole model) trains."""
    if named(name, [*model.init_fresh, *model.init_grow]):
        return True
    if model.lora is not None:
        return named(name, model.lora.whole)
    return not named(name, model.frozen)


def from_start(model: ModelSpec) -> list[str]:
    """The parameters a checkpoint of this job leaves out: the frozen ones of a model started
    from an export (model.init_from with model.lora or model.frozen), which keep the
    export's values to the end; a reader takes them from there (the commit records which, and
    the export's baton.json digest: `baton.checkpoint.frozen`); an hf: model's init_from is a
    save_pretrained folder, left out of its checkpoints where its weights are safetensors (read
    one by one), not a pickle. None for a model built from its seed."""
    from baton.models import HF_PREFIX, adapted_on_meta
    from baton.models.hf import pretrained_files

    if model.init_from is None or not model.partly_frozen:
        return []
    if model.name.startswith(HF_PREFIX) and pretrained_files(model.init_from) is None:
        return []
    built = adapted_on_meta(model)
    kept = {id(p) for p in built.parameters() if not p.requires_grad}
    # every name of each: a head tied to the embedding (one tensor, two names) too
    return sorted(n for n, t in built.state_dict(keep_vars=True).items() if id(t) in kept)


def ties(module: nn.Module) -> dict[str, str]:
    """{name: the first name of the same tensor} of the tensors a module holds under several
    names (a head tied to its token embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if first.setdefault(id(t), name) != name:
            out[name] = first[id(t)]
    return out


def freeze(module: nn.Module, model: ModelSpec, prefix: str = "") -> None:
    """Freeze `module`'s parameters (named `prefix` + their name in it, as in the whole
    model) that do not train."""
    for name, p in module.named_parameters():
        p.requires_grad_(trains(prefix + name, model))


def counts(module: nn.Module) -> tuple[int, int]:
    """(trained, all) parameters of a model."""
    params = list(module.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def flops_change(module: nn.Module, model: ModelSpec) -> float:
    """What freezing changes in the training FLOPs per token of `module` (built on meta), as
    models/flops.py counts them (2 a weight forward, 4 backward): a frozen weight's gradient
    is not computed (2 of its 6). Only nn.Linear weights are counted there, so only theirs
    are here; the adapters' own FLOPs: `lora.flops`."""
    return -2.0 * sum(m.weight.numel() for name, m in module.named_modules()
                      if isinstance(m, nn.Linear) and not trains(f"{name}.weight", model))


def problem(module: nn.Module, model: ModelSpec) -> str | None:
    """Why `model.frozen` cannot be (module built on meta), or None."""
    names = [n for n, _ in module.named_parameters()]
    for pattern in model.frozen:
        if not any(named(n, [pattern]) for n in names):
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            return f"{pattern!r} names no parameter; the model's: {shown}"
    if not any(trains(n, model) for n in names):
        return "freezes every parameter: nothing would train (init_fresh's and init_grow's train)"
    return None
