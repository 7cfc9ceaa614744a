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
        meta.json         step, data cursor, MLflow run id, spec fingerprint, layout, and every
                          part's size and checksum (CRC-32; SHA-256 in older ones) (coordinator)
        COMMITTED         written last, by the coordinator, once every part is in place
        REJECTED          written into a committed checkpoint that later failed verification

A folder without COMMITTED is torn (a crash mid-write) and is never loaded. On a local disk
every file is written under a temporary name, fsynced and renamed, and its folder fsynced
(`storage.write_durably`; DCP fsyncs its own files); object storage stores each object whole or
not at all. A commit is refused when a part the layout needs is missing or is not the size its
writer recorded; a load verifies every part against its checksum first (`latest_verified`),
and a checkpoint that fails goes to the previous one. Tensors are stored with torch.save and
read back with weights_only=True: no unrestricted unpickling.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import math
import re
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from baton import storage
from baton.spec import join_path
from baton.errors import CheckpointError, reason

if TYPE_CHECKING:
    import torch

MARKER = "COMMITTED"
REJECTED = "REJECTED"
META = "meta.json"
SHARDS = "shards"  # a sharded checkpoint's folder (torch.distributed.checkpoint)
METADATA = ".metadata"  # in it: DCP's index (a pickle: see sharded.py)
STATUS = "status.json"  # beside the step folders: the coordinator's state, for `baton status`
_STEP_DIR = re.compile(r"step_(\d{8})")


# who checks a checkpoint's checksums (`CheckpointStore.verify`): (step, {part: record}) -> what
# does not match, or None
Sums = Callable[[int, dict], Optional[str]]


def sizes_only(step: int, parts: dict) -> None:
    """`verify` without reading the parts: the workers check them before they load."""
    return None


class CheckpointStore:
    def __init__(self, root: str):
        self.root = root
        self.fs, self.path = storage.resolve(root)
        self.status_written = False
        self._dropping: dict[str, concurrent.futures.Future] = {}  # folder -> its deletion
        self._dropping_lock = threading.Lock()
        self._dropper: Optional[concurrent.futures.ThreadPoolExecutor] = None

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
                d = f"{self.path}/{name}"
                committed = (storage.exists(self.fs, f"{d}/{MARKER}")
                             and not storage.exists(self.fs, f"{d}/{REJECTED}"))
                out.append((int(m.group(1)), committed))
        return out

    def committed_steps(self) -> list[int]:
        return [s for s, ok in self._steps() if ok]

    def latest(self) -> Optional[int]:
        steps = self.committed_steps()
        return max(steps) if steps else None

    # -- writing ------------------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """Make a clean folder for `step` (a torn or rejected attempt at the step is discarded)."""
        d = self.step_dir(step)
        self.settle(d)  # being dropped (a rejected checkpoint's step, trained again): gone first
        if storage.exists(self.fs, d):
            if step in self.committed_steps():
                raise CheckpointError(f"checkpoint {d} is already committed")
            self.fs.delete_dir(d)
        self.fs.create_dir(d, recursive=True)

    def write_tensors(self, step: int, name: str, obj: Any) -> dict:
        """Write one part; returns its record for the commit (name, size, checksum of the bytes
        written)."""
        import torch  # here, not at the top: the driver reads metadata before Ray starts

        with storage.durable_writer(self.fs, f"{self.step_dir(step)}/{name}") as f, no_zip_checksums():
            torch.save(obj, f)
        return {"name": name, **f.record()}

    def commit(self, step: int, meta: dict, keep: int, parts: list[dict],
               protect: Iterable[int] = ()) -> str:
        """Check that every part the checkpoint needs is there at the size its writer recorded;
        write the metadata (with every part's size and checksum), then the marker; then drop
        all but the newest `keep` committed checkpoints and those in `protect` (the best one,
        `checkpoint.best`), and any torn or rejected folder older than this one. Refused
        (CheckpointError, nothing committed) when a part is missing."""
        d = self.step_dir(step)
        recorded = {p["name"]: {k: v for k, v in p.items() if k != "name"} for p in parts}
        problem = _missing(meta, recorded) or self._wrong_size(step, recorded)
        if problem:
            raise CheckpointError(f"checkpoint {step} not committed: {problem}")
        storage.fsync_dir(self.fs, d)
        storage.write_durably(self.fs, f"{d}/{META}",
                              json.dumps({**meta, "parts": recorded}, indent=2).encode())
        storage.write_durably(self.fs, f"{d}/{MARKER}", b"")
        committed = sorted(self.committed_steps())
        kept = {*committed[-keep:], *protect}
        for s, ok in self._steps():
            if (ok and s not in kept) or (not ok and s < step):
                self._drop(s)
        return d if "://" not in self.root else join_path(self.root, f"step_{step:08d}")

    def best(self, metric: str, lowest: bool) -> Optional[tuple[int, float]]:
        """The committed checkpoint whose held-out evaluation (its metadata's `eval`) was best
        by `metric` (the earliest of equals), and its value; None where none records it: what
        `checkpoint.best` keeps and `baton export --best` exports."""
        scored = []
        for s in self.committed_steps():
            try:
                value = float(self.read_meta(s).get("eval", {})[metric])
            except (OSError, ValueError, KeyError, TypeError, AttributeError, CheckpointError):
                continue  # not evaluated (a survivors' checkpoint), or its metadata unreadable
            if math.isfinite(value):
                scored.append((value if lowest else -value, s, value))
        return min(scored)[1:] if scored else None

    def _drop(self, step: int) -> None:
        """Delete checkpoint `step`'s folder off the caller's path: its marker first, so that
        what is left is torn (never loaded, and dropped by a later commit if this process ends
        before the rest is gone), then the rest on a thread of its own (`settle` waits for
        it). Deleting a 1.37 GB checkpoint took 0.36 s on a local ext4 disk here, in which the
        commit held the coordinator and the workers ran out of queued steps (a GPU's steps
        of 50-70 ms, two queued); on an object store it is a listing and a request per file."""
        d = self.step_dir(step)
        with self._dropping_lock:
            if d in self._dropping:
                return
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(f"{d}/{MARKER}")
            if self._dropper is None:
                self._dropper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-drop")
            self._dropping[d] = self._dropper.submit(self._delete, d)

    def _delete(self, d: str) -> None:
        try:
            self.fs.delete_dir(d)
        except FileNotFoundError:
            pass
        except OSError as e:  # the store's to tidy later: a failed deletion loses nothing
            print(f"baton: warning: could not delete the old checkpoint {storage.redact(d)} "
                  f"({reason(e)}); a later commit tries again", flush=True)
        finally:
            with self._dropping_lock:
                self._dropping.pop(d, None)

    def settle(self, folder: Optional[str] = None) -> None:
        """Wait for the old checkpoints being deleted (`commit`'s retention), or for `folder`."""
        with self._dropping_lock:
            dropping = [f for d, f in self._dropping.items() if folder in (None, d)]
        concurrent.futures.wait(dropping)

    # -- verifying ------------------------------------------------------------------------------

    def verify(self, step: int, sums: Optional[Sums] = None) -> Optional[str]:
        """None when checkpoint `step` is whole: its metadata readable and every part it records
        present, at its size and checksum; else what is wrong, in a few words. A checkpoint
        written before parts were recorded (before baton 0.7) has only its metadata checked.
        `sums(step, parts)` checks the checksums: by default this process reads every part
        (`check_sums`); the workers read their shares (`WorkerGroup.check_sums`); `sizes_only`
        leaves them to whoever loads the checkpoint. A store that does not answer, tried again
        (`storage.retried`), raises `StoreUnavailable`: not a verdict on the checkpoint."""
        try:
            parts = self.recorded_parts(step)
            return self._wrong_size(step, parts) or (sums or self.check_sums)(step, parts)
        except CheckpointError as e:
            return str(e)
        except (OSError, ValueError, KeyError, TypeError) as e:  # ValueError: JSON's errors
            return f"{type(e).__name__}: {e}"

    def recorded_parts(self, step: int) -> dict:
        """{part name: its record} from checkpoint `step`'s metadata (OSError, ValueError: not
        readable; CheckpointError: not a checkpoint's)."""
        path = f"{self.step_dir(step)}/{META}"
        meta = json.loads(storage.read_retried(self.fs, path))
        parts = meta.get("parts", {}) if isinstance(meta, dict) else None
        if not isinstance(parts, dict) or "step" not in meta:
            raise CheckpointError(f"{META} is not a checkpoint's metadata")
        return parts

    def check_sums(self, step: int, parts: dict) -> Optional[str]:
        """The first of `parts` ({name: record}) whose bytes do not match the checksum its
        record carries, in a few words; None when all match."""
        for name, rec in sorted(parts.items()):
            kind, path = storage.checksum_kind(rec), f"{self.step_dir(step)}/{name}"
            try:
                got = storage.retried(lambda: storage.file_record(self.fs, path, kind), path)
            except FileNotFoundError as e:
                return f"part {name}: {type(e).__name__}: {e}"
            if got[kind] != rec[kind]:
                return f"part {name} does not match its checksum"
        return None

    def _wrong_size(self, step: int, parts: dict) -> Optional[str]:
        for name, rec in sorted(parts.items()):
            path = f"{self.step_dir(step)}/{name}"
            got = storage.retried(lambda: storage.size_of(self.fs, path), path)
            if got != rec["size"]:
                return (f"part {name} is {got} bytes, {rec['size']} when written" if got >= 0
                        else f"part {name} is missing")
        return None

    def latest_verified(self, sums: Optional[Sums] = None) -> tuple[Optional[int], list[tuple[int, str]]]:
        """The newest committed checkpoint that verifies (`verify`, with `sums`), and the newer
        ones that did not (step, what failed), newest first. Reads only: `reject` marks the
        failed ones."""
        failed = []
        for step in sorted(self.committed_steps(), reverse=True):
            problem = self.verify(step, sums)
            if problem is None:
                return step, failed
            failed.append((step, problem))
        return None, failed

    def none_verifies(self, failed: list[tuple[int, str]]) -> str:
        """What to say when no committed checkpoint verifies (`failed`: each one's problem)."""
        what = "; ".join(f"checkpoint {step}: {why}" for step, why in failed)
        return (f"no checkpoint in {storage.redact(self.root)} verifies ({what}); move the folder "
                "aside to start over")

    def reject(self, step: int, why: str) -> None:
        """Mark a committed checkpoint that failed verification: never loaded again, and
        replaced when training reaches its step again (kept until then, for a post-mortem)."""
        storage.write_durably(self.fs, f"{self.step_dir(step)}/{REJECTED}", why.encode())

    def write_status(self, status: dict) -> None:
        """The running job's state for `baton status` (written by the coordinator), whole or
        not at all (on object storage without the copy a rename costs there)."""
        if not self.status_written:
            self.fs.create_dir(self.path, recursive=True)
            self.status_written = True
        storage.write_durably(self.fs, f"{self.path}/{STATUS}", json.dumps(status, indent=1).encode())

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
        return json.loads(storage.read_retried(self.fs, f"{self._committed_dir(step)}/{META}"))

    def read_tensors(self, step: int, name: str) -> Any:
        import torch

        data = storage.read_retried(self.fs, f"{self._committed_dir(step)}/{name}")
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


_zip_checksums = {"lock": threading.Lock(), "writes": 0, "before": True}


@contextlib.contextmanager
def no_zip_checksums():
    """torch.save without the CRC-32 its zip format computes over every tensor's bytes (0.24 s
    of a core per 685 MB here, `benchmarks/write_cost.py`): each part's own checksum covers its
    whole file, and torch.load never reads the zip's (`unzip -t` would report them). The
    setting is process-wide in torch (2.6 to 2.13): off while any baton write runs, on thread
    or another, and back as it was after the last. Nothing where a torch lacks it."""
    import torch

    switch = getattr(torch.serialization, "set_crc32_options", None)
    if switch is None:
        yield
        return
    with _zip_checksums["lock"]:
        if _zip_checksums["writes"] == 0:
            _zip_checksums["before"] = torch.serialization.get_crc32_options()
            switch(False)
        _zip_checksums["writes"] += 1
    try:
        yield
    finally:
        with _zip_checksums["lock"]:
            _zip_checksums["writes"] -= 1
            if _zip_checksums["writes"] == 0:
                switch(_zip_checksums["before"])


def _missing(meta: dict, parts: dict) -> Optional[str]:
    """The first part a checkpoint of `meta`'s layout needs and `parts` lacks."""
    if not parts:
        return "no parts were written"
    if any(name.startswith(f"{SHARDS}/") for name in parts):
        need = [f"{SHARDS}/{METADATA}"]
    else:
        pp = meta.get("layout", {}).get("pp", 1)
        need = [f"{kind}-{i:04d}.pt" for i in range(pp) for kind in ("model", "optim")]
    need += meta.get("rng", [])
    return next((f"part {name} is missing" for name in need if name not in parts), None)


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
