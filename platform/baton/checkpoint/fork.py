"""`baton fork NEW.yaml --from OLD.yaml`: a job that starts where another job's checkpoint
is, with everything a resume takes from it (weights, optimizer state, the data cursor, RNG
states, the step) and a training recipe of its own: a learning-rate decay branched off a
stable phase (`train.schedule: wsd`), a lower rate after a spike, a rate or clipping
ablation from a shared start.

The checkpoint is copied into the new job's checkpoint folder as its first, under its name and
recipe, so the new job is a plain resume from then on, on any launcher (`baton run`, `baton
submit`, KubeRay), its recoveries included, and the old job's retention (`checkpoint.keep`)
can delete its own copy. What the copy cannot change must match: the model, the data (the
cursor counts samples of its order) and everything else in the recipe but FORKABLE.
"""

from __future__ import annotations

from typing import Callable, Optional

import pyarrow.fs as pafs

from baton import storage
from baton.checkpoint.store import MARKER, META, REJECTED, CheckpointStore
from baton.errors import CheckpointError
from baton.spec import JobSpec
from baton.storage import redact

# the training settings a fork may change: each is read from the job file as each step runs
# (the rate is set on the optimizer every step: training.py), none from the checkpoint. Not
# betas or weight decay: the optimizer's saved param groups carry them, and a load of them
# restores the old values (torch's set_state_dict does).
FORKABLE = ("lr", "min_lr", "warmup_steps", "schedule", "grad_clip", "precision")
COPY_BYTES = 8 << 20


def fork(spec: JobSpec, source: JobSpec, step: Optional[int | str] = None,
         log: Optional[Callable[[str], None]] = None) -> dict:
    """Make checkpoint `step` of job `source` (default: its newest that verifies; "best": the
    one checkpoint.best kept) the first checkpoint of job `spec`; returns its metadata as
    written there. Refused, with nothing written, where `spec` already has checkpoints or its
    recipe differs from the checkpoint's outside FORKABLE."""
    from baton.api import _changed_keys
    from baton.checkpoint.export import pick

    new, old = CheckpointStore(spec.checkpoint_dir), CheckpointStore(source.checkpoint_dir)
    if old.path == new.path and type(old.fs) is type(new.fs):
        raise CheckpointError(f"job {spec.name!r} is job {source.name!r} (the same checkpoint "
                              "folder): to train a job on, run it")
    if new.committed_steps():
        raise CheckpointError(f"job {spec.name!r} already has checkpoints in "
                              f"{redact(spec.checkpoint_dir)}: a fork starts a new job (give it "
                              "another name or checkpoint.path)")
    step = pick(source, old, step, log or print, doing="forking")
    meta = old.read_meta(step)
    theirs, mine = meta.get("recipe", {}), redact(spec.recipe())
    changed = _changed_keys(_fixed(theirs), _fixed(mine))
    if changed:
        raise CheckpointError(f"checkpoint {step} of {source.name!r} is not a start for "
                              f"{spec.name!r}: {changed} (a fork may change train."
                              f"{', train.'.join(FORKABLE)}; the rest is the checkpoint's state "
                              "or the order of its data)")
    if spec.train.steps <= step:
        raise CheckpointError(f"job {spec.name!r} would start finished: train.steps is "
                              f"{spec.train.steps}, the checkpoint is at step {step}")
    new.begin(step)
    src, dst = old.step_dir(step), new.step_dir(step)
    for info in old.fs.get_file_info(pafs.FileSelector(src, recursive=True)):
        name = info.path[len(src) + 1:]
        if info.type == pafs.FileType.File and name not in (META, MARKER, REJECTED):
            _copy(old.fs, info.path, new.fs, f"{dst}/{name}")
    forked = {**meta, "job": spec.name, "fingerprint": spec.fingerprint(), "recipe": mine,
              "mlflow_run_id": None,  # a run of its own, tagged with where it started
              "forked_from": {"job": source.name, "step": step, "checkpoint": redact(src)}}
    parts = [{"name": name, **record} for name, record in forked.pop("parts").items()]
    new.commit(step, forked, keep=spec.checkpoint.keep, parts=parts)
    return new.read_meta(step)


def _fixed(recipe: dict) -> dict:
    """A recipe without its job's name and the settings a fork may change."""
    train = {k: v for k, v in recipe.get("train", {}).items() if k not in FORKABLE}
    return {**{k: v for k, v in recipe.items() if k != "name"}, "train": train}


def _copy(fs: pafs.FileSystem, path: str, to_fs: pafs.FileSystem, to: str) -> None:
    """One file, whole and on the disk (`storage.durable_writer`), across filesystems too."""
    parent = to.rsplit("/", 1)[0]
    to_fs.create_dir(parent, recursive=True)
    with fs.open_input_stream(path) as f, storage.durable_writer(to_fs, to) as out:
        while chunk := f.read(COPY_BYTES):
            out.write(chunk)
