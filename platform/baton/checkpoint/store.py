"""Checkpoints on a local folder or any pyarrow filesystem URI, committed atomically.

Layout of one checkpoint:

    {job checkpoint dir}/step_00000050/
        shards/           a sharded job's state (parameters and optimizer state by name,
                          each worker's shards), written and read through
                          torch.distributed.checkpoint: see sharded.py; or
        model-0000.pt     parameters keyed by name, one file per pipeline rank (written by
                          one replica of each; names are the whole model's, so any layout
                          can read any other's: read_model merges them)
        optim-0000.pt     optimizer state keyed by parameter name, likewise
        rng-rank0000.pt   each worker's RNG state
        meta.json         step, data cursor, MLflow run id, spec fingerprint, layout (coordinator)
        COMMITTED         written last, by the coordinator, once every part is in place

A folder without COMMITTED is torn (a crash mid-write) and is never loaded. Tensors are stored
with torch.save and read back with weights_only=True: no unrestricted unpickling.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any, Optional

import torch

from baton import storage
from baton.spec import join_path
from baton.errors import CheckpointError

MARKER = "COMMITTED"
SHARDS = "shards"  # a sharded checkpoint's folder (torch.distributed.checkpoint)
STATUS = "status.json"  # beside the step folders: the coordinator's state, for `baton status`
_STEP_DIR = re.compile(r"step_(\d{8})")


class CheckpointStore:
    def __init__(self, root: str):
        self.root = root
        self.fs, self.path = storage.resolve(root)

    def step_dir(self, step: int) -> str:
        return f"{self.path}/step_{step:08d}"

    def shards_dir(self, step: int) -> str:
        """Where a sharded checkpoint's workers write (torch.distributed.checkpoint)."""
        return f"{self.step_dir(step)}/{SHARDS}"

    def shards(self, step: int):
        """A sharded checkpoint's location (`baton.checkpoint.sharded.Location`)."""
        from baton.checkpoint.sharded import Location

        return Location(self.fs, self.shards_dir(step))

    def is_sharded(self, step: int) -> bool:
        return storage.exists(self.fs, f"{self.shards_dir(step)}/.metadata")

    def _steps(self) -> list[tuple[int, bool]]:
        out = []
        for name in storage.list_dirs(self.fs, self.path):
            m = _STEP_DIR.fullmatch(name)
            if m:
                committed = storage.exists(self.fs, f"{self.path}/{name}/{MARKER}")
                out.append((int(m.group(1)), committed))
        return out

    def committed_steps(self) -> list[int]:
        return [s for s, ok in self._steps() if ok]

    def latest(self) -> Optional[int]:
        steps = self.committed_steps()
        return max(steps) if steps else None

    # -- writing ------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Make a clean folder for `step` (a torn attempt at the same step is discarded)."""
        d = self.step_dir(step)
        if storage.exists(self.fs, d):
            if storage.exists(self.fs, f"{d}/{MARKER}"):
                raise CheckpointError(f"checkpoint {d} is already committed")
            self.fs.delete_dir(d)
        self.fs.create_dir(d, recursive=True)

    def write_tensors(self, step: int, name: str, obj: Any) -> None:
        buf = io.BytesIO()
        torch.save(obj, buf)
        storage.write_bytes(self.fs, f"{self.step_dir(step)}/{name}", buf.getvalue())

    def commit(self, step: int, meta: dict, keep: int) -> str:
        """Write the metadata, then the marker; then drop all but the newest `keep` committed
        checkpoints and any torn folder older than this one."""
        d = self.step_dir(step)
        storage.write_bytes(self.fs, f"{d}/meta.json", json.dumps(meta, indent=2).encode())
        storage.write_bytes(self.fs, f"{d}/{MARKER}", b"")
        committed = sorted(self.committed_steps())
        for s, ok in self._steps():
            if (ok and s in committed[:-keep]) or (not ok and s < step):
                self.fs.delete_dir(self.step_dir(s))
        return d if "://" not in self.root else join_path(self.root, f"step_{step:08d}")

    def write_status(self, status: dict) -> None:
        """The running job's state for `baton status` (written by the coordinator)."""
        self.fs.create_dir(self.path, recursive=True)
        tmp = f"{self.path}/.{STATUS}.tmp"  # then a rename: a reader never sees half a file
        storage.write_bytes(self.fs, tmp, json.dumps(status, indent=1).encode())
        self.fs.move(tmp, f"{self.path}/{STATUS}")

    def read_status(self) -> Optional[dict]:
        if not storage.exists(self.fs, f"{self.path}/{STATUS}"):
            return None
        return json.loads(storage.read_bytes(self.fs, f"{self.path}/{STATUS}"))

    # -- reading ------------------------------------------------------------------------------

    def _committed_dir(self, step: int) -> str:
        d = self.step_dir(step)
        if not storage.exists(self.fs, f"{d}/{MARKER}"):
            raise CheckpointError(f"checkpoint {d} is not committed (torn or missing)")
        return d

    def read_meta(self, step: int) -> dict:
        return json.loads(storage.read_bytes(self.fs, f"{self._committed_dir(step)}/meta.json"))

    def read_tensors(self, step: int, name: str) -> Any:
        data = storage.read_bytes(self.fs, f"{self._committed_dir(step)}/{name}")
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")

    def read_model(self, step: int, shards: Optional[int] = None) -> dict[str, torch.Tensor]:
        """The whole model's parameters, merged from its per-stage files (or its shards)."""
        if self.is_sharded(step):
            from baton.checkpoint import sharded  # torch.distributed.checkpoint: only when needed

            self._committed_dir(step)
            return sharded.read_full(self.shards(step), "model")
        if shards is None:
            shards = self.read_meta(step)["layout"]["pp"]
        out: dict[str, torch.Tensor] = {}
        for i in range(shards):
            out.update(self.read_tensors(step, f"model-{i:04d}.pt"))
        return out

    def read_optim(self, step: int, shards: int) -> dict:
        """The whole optimizer state, keyed by parameter name, merged from per-stage files."""
        return merge_optim_states([self.read_tensors(step, f"optim-{i:04d}.pt")
                                   for i in range(shards)])


def merge_optim_states(parts: list[dict]) -> dict:
    """One optimizer state (keyed by parameter name) from the stages' states. Every stage
    builds the same parameter groups in the same order, so groups merge by position."""
    state: dict = {}
    groups: list[dict] = []
    for part in parts:
        state.update(part["state"])
        for i, g in enumerate(part["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += g["params"]
    return {"state": state, "param_groups": groups}


def filter_optim_state(optim: dict, names: set[str]) -> dict:
    """The part of an optimizer state that belongs to the parameters in `names`."""
    return {"state": {k: v for k, v in optim["state"].items() if k in names},
            "param_groups": [{**g, "params": [n for n in g["params"] if n in names]}
                             for g in optim["param_groups"]]}
