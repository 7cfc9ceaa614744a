"""What a checkpoint of a job started from an export leaves out: the parameters that job
freezes (`models.frozen.from_start`: model.lora's, model.frozen's), whose values are the
export's from the first step to the last. A LoRA job's checkpoint then holds its adapters
and their optimizer state, not a copy of the model they adapt at every save.

The commit records which parameters are left out, where they are (model.init_from) and the
digest of that export's `baton.json` (`record`). A resume, an evaluation and an export take
them from the export again (`filled`), and refuse one that has changed since (`problem`): the
export is then an input of the checkpoint, as the corpus is (its manifest is checked the
same way)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from baton import storage
from baton.errors import CheckpointError, StoreUnavailable

if TYPE_CHECKING:
    import torch

    from baton.spec import ModelSpec


def _digest(folder: str) -> str:
    """The SHA-256 of an export's baton.json (its files, its source checkpoint, its step)."""
    from baton.checkpoint.export import ABOUT, located

    fs, path = located(folder)
    try:
        return hashlib.sha256(storage.read_retried(fs, f"{path}/{ABOUT}")).hexdigest()
    except (OSError, ValueError, StoreUnavailable) as e:
        raise CheckpointError(f"{storage.redact(folder)}/{ABOUT} cannot be read "
                              f"({type(e).__name__}: {storage.redact(str(e))[:200]})") from None


def record(model: ModelSpec) -> Optional[dict]:
    """What the commit of a checkpoint of this job records of the parameters it leaves out
    (None: it holds them all)."""
    from baton.models.frozen import from_start

    names = from_start(model)
    if not names:
        return None
    return {"from": storage.redact(model.init_from), "about": _digest(model.init_from),
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
                f"parameters are those of the export {frozen['from']}, and this job's "
                f"model.init_from is {model.init_from and storage.redact(model.init_from)}; "
                "set model.init_from to that export")
    try:
        digest = _digest(model.init_from)
    except CheckpointError as e:
        return f"checkpoint {step} takes its frozen parameters from {frozen['from']}, and {e}"
    if digest != frozen["about"]:
        return (f"{frozen['from']} has changed since checkpoint {step} was written (its "
                "baton.json is another): the checkpoint holds only what trained, and its "
                f"{len(frozen['names'])} frozen parameters are that export's; restore the "
                "export it started from")
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
    from baton.checkpoint.export import Exported

    why = problem(meta, model)
    if why:
        raise CheckpointError(why)

    def each() -> Iterator[tuple[str, torch.Tensor]]:
        exported = Exported(model.init_from)
        try:
            for name in names:
                yield name, exported.get(name)
        finally:
            exported.close()
    return each()
