"""`baton scale`: an elastic job's largest world, set from outside while it runs.

A job grows into room when nodes join and shrinks when it loses workers; on a cluster it
shares, its owner may want room back without stopping it (a colleague's job, a debugging
session), or to let it take more again. `baton scale JOB.yaml --max-dp N` writes the ceiling
into the job's checkpoint folder (`scale.json`, beside `status.json`: a local folder or object
storage, wherever the job writes). The coordinator looks for it as often as it looks for room
(`elastic.rescale_check_s`): above the ceiling, it gives the workers of the replicas beyond it
back at the next step boundary (a checkpoint of that step, and the world re-formed smaller
from it: nothing is trained twice or lost); below it, it grows as far as the ceiling allows.
The file stays until `baton scale JOB.yaml --clear`, so a resumed run keeps to it. `--max-dp
0` suspends any job, elastic or not: a checkpoint of the step it reached, every worker let go,
and its driver waits until `--clear` to go on from there. A job of
higher priority that needs room sets a ceiling of its own while it runs (`priorities.py`).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Optional

from baton import storage
from baton.checkpoint import CheckpointStore
from baton.errors import SpecError
from baton.spec import JobSpec

FILE = "scale.json"


def ask(spec: JobSpec, max_dp: Optional[int], source: str = "<spec>") -> None:
    """Set the ceiling of `spec`'s job to `max_dp` replicas (None: the job's own max_dp; 0:
    suspended, any job); SpecError (one line) for a job that is not elastic or a ceiling
    outside its range."""
    low, high = spec.dp_range
    if low == high and max_dp not in (0, None):  # --clear: any job
        raise SpecError(f"{source}: job {spec.name!r} is not elastic (elastic.min_dp and max_dp "
                        f"are both {low}): its world does not change size (--max-dp 0 "
                        "suspends it)")
    if max_dp is not None and max_dp != 0 and not low <= max_dp <= high:
        raise SpecError(f"{source}: --max-dp {max_dp}: give {low} (elastic.min_dp) to "
                        f"{high} (elastic.max_dp), or 0 to suspend it")
    store = CheckpointStore(spec.checkpoint_dir)
    path = f"{store.path}/{FILE}"
    if max_dp is None:
        if storage.exists(store.fs, path):
            store.fs.delete_file(path)
        return
    store.fs.create_dir(store.path, recursive=True)
    storage.write_durably(store.fs, path, json.dumps(
        {"max_dp": max_dp, "at": round(time.time(), 3), "by": socket.gethostname()}).encode())


def asked(store: CheckpointStore) -> Optional[int]:
    """The ceiling in the job's folder (0: suspended), or None (none set, or a file that does
    not read as one: a ceiling is a wish, and a broken one is not obeyed)."""
    path = f"{store.path}/{FILE}"
    try:
        if not storage.exists(store.fs, path):
            return None
        value = json.loads(storage.read_bytes(store.fs, path)).get("max_dp")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class Ceiling:
    """What the coordinator knows of the ceiling: `baton scale`'s and the claims of jobs of
    higher priority on this one (`priorities.py`), the lowest of them (0: suspended); read at
    the start, then every `check_s`."""

    def __init__(self, store: CheckpointStore, spec: JobSpec, priorities=None):
        self.store, self.check_s, self.priorities = store, spec.elastic.rescale_check_s, priorities
        self.elastic = spec.dp_range[0] < spec.dp_range[1]
        self.scaled: Optional[int] = None  # baton scale's
        self.max_dp: Optional[int] = None  # the lowest
        self._read()
        self.next_check = time.monotonic() + self.check_s

    def changed(self) -> bool:
        """Whether the ceiling changed since it was last read (read when due)."""
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.check_s
        before = self.max_dp
        self._read()
        return self.max_dp != before

    @property
    def claimant(self) -> Optional[str]:
        """The job of higher priority whose claim sets the ceiling (None: `baton scale`'s)."""
        held = self.priorities.holding if self.priorities else []
        if held and (self.scaled is None or held[0]["max_dp"] < self.scaled):
            return held[0]["by"]
        return None

    @property
    def lent_back(self) -> bool:
        """Whether the claim that sets the ceiling takes back room its job lent this one while
        it waited ahead of it in line (`priorities.backfills`), not room of a job of higher
        priority."""
        held = self.priorities.holding if self.priorities else []
        return bool(self.claimant) and held[0]["priority"] <= self.priorities.priority

    @property
    def why(self) -> str:
        """Who set the ceiling, as the run record and the status file say it."""
        if not self.claimant:
            return "baton scale"
        return f"{'line' if self.lent_back else 'priority'}: {self.claimant}"

    @property
    def given(self) -> str:
        """To whom the room goes, as the console says it."""
        return (f"given back to job {self.claimant}, ahead of it in line" if self.lent_back
                else f"given to job {self.claimant}, of higher priority")

    def _read(self) -> None:
        # a job that is not elastic keeps to one ceiling only: 0, suspended
        self.scaled = asked(self.store)
        if not self.elastic and self.scaled:
            self.scaled = None
        claimed = self.priorities.ceiling() if self.priorities else None
        self.max_dp = min((v for v in (self.scaled, claimed) if v is not None), default=None)
