"""What a checkpoint of a job started from an export leaves out: the parameters that job
freezes (`models.frozen.from_start`: model.lora's, model.frozen's), whose values are the
export's from the first step to the last. A LoRA job's checkpoint then holds its adapters
and their optimizer state, not a copy of the model they adapt at every save.

The commit records which parameters are left out, where they are (model.init_from) and a
digest of that export (`record`: of its `baton.json`; of a `save_pretrained` folder, an hf:
model's, which need not be an export, or a Llama's for the built-in llama, its configuration
and its weights' files: `_sampled`).
A resume, an evaluation and an export take them from the export again (`filled`), and refuse
one that has changed since (`problem`): the export is then an input of the checkpoint, as the
corpus is (its manifest is checked the same way)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from baton import storage
from baton.errors import CheckpointError, StoreUnavailable
from baton.models import HF_PREFIX

if TYPE_CHECKING:
    import torch

    from baton.spec import ModelSpec


SAMPLES = 16  # blocks of a weights' file in its digest beside its first, spread over it
SAMPLE_BYTES = storage.READ_WINDOW_BYTES  # a block: one request (smaller ones fetch this much)


def _digest(model: ModelSpec) -> str:
    """The SHA-256 of model.init_from's export's baton.json (its files, its source checkpoint,
    its step); of an hf: model's folder: `_sampled`."""
    from baton.checkpoint.export import ABOUT, located
    from baton.models.hf import CONFIG, pretrained_files

    folder = model.init_from
    fs, path = located(folder)
    pretrained = _pretrained(model)
    try:
        if pretrained:
            return _sampled(fs, path, [CONFIG, *(pretrained_files(folder) or [])])
        return hashlib.sha256(storage.read_retried(fs, f"{path}/{ABOUT}")).hexdigest()
    except (OSError, ValueError, StoreUnavailable) as e:
        what = "" if pretrained else f"/{ABOUT}"
        raise CheckpointError(f"{storage.redact(folder)}{what} cannot be read "
                              f"({type(e).__name__}: {storage.redact(str(e))[:200]})") from None


def _sampled(fs, path: str, files: list[str]) -> str:
    """A digest of a save_pretrained folder's `files` (its configuration, whole, and its
    weights): each file's size, its first SAMPLE_BYTES (a safetensors header: every name,
    shape and place) and SAMPLES more blocks spread over the rest to its end. Weights
    trained further, or others of the same shapes, differ in every block; reading the whole
    files at every load would cost what reading the model again does. A file copied or
    touched, its bytes as they were, is the same."""
    h = hashlib.sha256()
    for name in files:
        with storage.RetryingInput(fs, f"{path}/{name}") as f:
            size = f.size
            h.update(f"{name}\0{size}\0".encode())
            spans = ([(0, size)] if size <= (SAMPLES + 1) * SAMPLE_BYTES else
                     [((size - SAMPLE_BYTES) * i // SAMPLES, SAMPLE_BYTES) for i in range(SAMPLES + 1)])
            for at, n in spans:
                f.seek(at)
                h.update(f.read(n))
    return h.hexdigest()


def record(model: ModelSpec) -> Optional[dict]:
    """What the commit of a checkpoint of this job records of the parameters it leaves out
    (None: it holds them all)."""
    from baton.models.frozen import from_start

    names = from_start(model)
    if not names:
        return None
    return {"from": storage.redact(model.init_from), "about": _digest(model),
            "names": names}


def left_out(meta: dict) -> list[str]:
    """The parameters checkpoint `meta` leaves out (none: it holds every one)."""
    return (meta.get("frozen") or {}).get("names", [])


def problem(meta: dict, model: ModelSpec) -> Optional[str]:
    """Why the parameters checkpoint `meta` leaves out cannot be taken from this job's
    model.init_from now (None: they can, or it leaves none out)."""
    frozen = meta.get("frozen")
    if not frozen:
        return None
    step = meta["step"]
    if model.init_from is None or storage.redact(model.init_from) != frozen["from"]:
        return (f"checkpoint {step} holds only what trained: its {len(frozen['names'])} frozen "
                f"parameters are those of {frozen['from']}, and this job's "
                f"model.init_from is {model.init_from and storage.redact(model.init_from)}; "
                "set model.init_from to that folder")
    try:
        digest = _digest(model)
    except CheckpointError as e:
        return f"checkpoint {step} takes its frozen parameters from {frozen['from']}, and {e}"
    if digest != frozen["about"]:
        what, itself = (("weights are others", "folder") if _pretrained(model) else
                        ("baton.json is another", "export"))
        return (f"{frozen['from']} has changed since checkpoint {step} was written (its "
                f"{what}): the checkpoint holds only what trained, and its "
                f"{len(frozen['names'])} frozen parameters are that {itself}'s; restore the "
                f"{itself} it started from")
    return None


def filled(tensors: dict, meta: dict, model: ModelSpec, wanted: Iterable[str]) -> dict:
    """`tensors` (of checkpoint `meta`), with those of the parameters it leaves out that
    `wanted` names read from the export (the values they had in training, bit for bit)."""
    wanted = set(wanted)
    missing = [n for n in left_out(meta) if n not in tensors and n in wanted]
    if not missing:
        return tensors
    return {**tensors, **dict(read(meta, model, missing))}


def read(meta: dict, model: ModelSpec, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of parameters checkpoint `meta` leaves out, read from the export as
    they are asked for; the export is checked first (here, before any is asked for): it must
    be the one the checkpoint started from."""
    why = problem(meta, model)
    if why:
        raise CheckpointError(why)

    def each() -> Iterator[tuple[str, torch.Tensor]]:
        from baton.models import adapted_on_meta
        from baton.models.frozen import ties

        exported = _reader(model)
        try:
            # a head tied to the embedding: in the folder under the embedding's name alone
            tied = ties(adapted_on_meta(model)) if any(n not in exported.where for n in names) else {}
            for name in names:
                yield name, exported.get(tied.get(name, name))
        finally:
            exported.close()
    return each()


def _reader(model: ModelSpec):
    """What reads model.init_from's parameters by the model's names: an export, or an hf:
    model's save_pretrained folder (its safetensors files, under transformers' names)."""
    from baton.checkpoint.export import Exported
    from baton.models.hf import pretrained_files

    if not model.name.startswith(HF_PREFIX):  # (an export, or a folder it reads as one)
        return Exported(model.init_from)
    return Exported(model.init_from, about={"files": pretrained_files(model.init_from) or [],
                                            "names": "transformers", "model": {"name": model.name}})


def _pretrained(model: ModelSpec) -> bool:
    """Its init_from is a save_pretrained folder, with no baton.json to digest: an hf:
    model's (an export of one or not), or one a built-in model reads (a Llama's, for the
    built-in llama: `export.pretrained_about`)."""
    from baton.checkpoint.export import is_export, located
    from baton.models.hf import CONFIG

    if model.name.startswith(HF_PREFIX):
        return True
    try:  # (no baton.json and no config.json: an export that lost its baton.json)
        fs, path = located(model.init_from)
        return not is_export(model.init_from) and storage.exists(fs, f"{path}/{CONFIG}")
    except (OSError, ValueError):
        return False

