"""One writer per job: a lease on the job's checkpoint folder, held for the whole run.

Two runs of one job (a second `baton run`, or a resubmission while the first still runs) would
otherwise write one folder: each deletes the other's uncommitted checkpoint, retention deletes
its torn folders, and both log the same steps to one MLflow run. The second run is refused, in
one line naming the holder, before Ray starts.

On a local or shared disk (NFS included) the lease is an exclusive `flock` on the folder's
`LEASE` file, whose content names the holder; the holder deletes the file as it lets go. The
kernel drops the lock when the holding process ends, however it ends (SIGKILL included), so a
lease whose holder is gone is free at once and nothing has to expire.

Object storage has no locks and pyarrow no conditional writes, so there the lease is a record
(holder, a random token, a heartbeat time) that the holder rewrites every `heartbeat_s`; it is
stale `ttl_s` after its last heartbeat, and then taken over with a warning. To take it, a run
writes its record, waits `settle_s` (longer than the gap between another run's read and its
write: two RPCs), and holds it only if its own record is still there: of two runs that both
found it free, the later writer wins and the earlier sees that and is refused. A holder whose
heartbeat finds another's record has lost the lease (it stalled past `ttl_s`): its next
checkpoint commit fails instead of writing over the new holder's (`check`). Hosts' clocks must
agree to well within `ttl_s`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Optional

import pyarrow.fs as pafs

from baton import storage
from baton.errors import CheckpointError, reason

LEASE = "LEASE"
TTL_S = 60.0
HEARTBEAT_S = 10.0
SETTLE_S = 2.0


def holder() -> dict:
    """Who this process is, as another run's refusal names it."""
    job = None
    try:  # the Ray job a `baton submit` made, if this is its entrypoint
        job = json.loads(os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"])["metadata"]["job_submission_id"]
    except (KeyError, TypeError, ValueError):
        pass
    return {"host": socket.gethostname(), "pid": os.getpid(), "ray_job": job, "since": time.time(),
            "token": uuid.uuid4().hex}


def describe(record: Optional[dict]) -> str:
    if not record:
        return "another run"
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record["since"])))
        job = f", Ray job {record['ray_job']}" if record.get("ray_job") else ""
        return f"host {record['host']}, pid {record['pid']}{job}, since {since}"
    except (KeyError, TypeError, ValueError):
        return "another run"


class Lease:
    def __init__(self, root: str, *, ttl_s: float = TTL_S, heartbeat_s: float = HEARTBEAT_S,
                 settle_s: float = SETTLE_S, warn: Callable[[str], None] = print):
        self.root = root
        self.fs, self.path = storage.resolve(root)
        self.file = f"{self.path}/{LEASE}"
        self.ttl_s, self.heartbeat_s, self.settle_s, self.warn = ttl_s, heartbeat_s, settle_s, warn
        self.me = holder()
        self.fd: Optional[int] = None  # local: the locked file
        self.lost: Optional[dict] = None  # object storage: whose record replaced ours
        self.stop = threading.Event()
        self.beat: Optional[threading.Thread] = None

    def __enter__(self) -> "Lease":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def refusal(self, record: Optional[dict]) -> CheckpointError:
        return CheckpointError(
            f"{storage.redact(self.root)} is in use by another run of this job ({describe(record)}): "
            "one run writes a job's checkpoints at a time; wait for it to end, or stop it")

    def acquire(self) -> None:
        self.made = []  # the folders this creates, deepest first: removed again if left empty
        try:
            folder = self.path
            while folder and not storage.exists(self.fs, folder):
                self.made.append(folder)
                folder = os.path.dirname(folder)
            self.fs.create_dir(self.path, recursive=True)
        except OSError as e:  # a folder this run may not make or write (FileNotFoundError too)
            raise CheckpointError(f"checkpoint.path: cannot make {storage.redact(self.root)} "
                                  f"({reason(e)}); give a folder this run may write") from None
        if storage.is_local(self.fs):
            self._lock()
        else:
            self._claim()

    def check(self) -> None:
        """Raise if this run no longer holds the lease (before writing a checkpoint)."""
        if self.lost is not None:
            raise CheckpointError(
                f"lost the lease on {storage.redact(self.root)} to {describe(self.lost)}: this run "
                f"sent no heartbeat for {self.ttl_s:.0f} s and another run took the job over")

    def release(self) -> None:
        """Let go; a folder this lease created and nothing else wrote to goes too, so a run
        refused after taking it (the cluster too small) leaves nothing behind."""
        if self.fd is not None:
            os.unlink(self.file)  # while still locked: see _lock
            os.close(self.fd)
            self.fd = None
        elif self.beat is not None:
            self.stop.set()
            self.beat.join()
            self.beat = None
            if self.lost is None and (self._read() or {}).get("token") == self.me["token"]:
                self.fs.delete_file(self.file)
        else:
            return
        for folder in self.made:
            if self.fs.get_file_info(pafs.FileSelector(folder)):
                break
            self.fs.delete_dir(folder)

    # -- a local or shared disk: flock ----------------------------------------------------------

    def _lock(self) -> None:
        import fcntl

        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                raise self.refusal(record) from None
            # a holder unlinks the file as it lets go: a lock taken on a file no longer at
            # the path is no lease (another run may be creating the next one); try again
            try:
                if os.stat(self.file).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        data = json.dumps(self.me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        self.fd = fd

    # -- object storage: a record with a heartbeat ----------------------------------------------

    def _read(self) -> Optional[dict]:
        if not storage.exists(self.fs, self.file):
            return None
        return _parse(storage.read_bytes(self.fs, self.file))

    def _write(self) -> None:
        storage.write_bytes(self.fs, self.file, json.dumps({**self.me, "heartbeat": time.time()}).encode())

    def _claim(self) -> None:
        record = self._read()
        if record is not None:
            age = time.time() - float(record.get("heartbeat", 0) or 0)
            if age < self.ttl_s:
                raise self.refusal(record)
            self.warn(f"warning: taking over the lease on {storage.redact(self.root)} from "
                      f"{describe(record)}: no heartbeat for {age:.0f} s")
        self._write()
        time.sleep(self.settle_s)
        record = self._read()
        if (record or {}).get("token") != self.me["token"]:
            raise self.refusal(record)
        self.beat = threading.Thread(target=self._heartbeat, name="baton-lease", daemon=True)
        self.beat.start()

    def _heartbeat(self) -> None:
        while not self.stop.wait(self.heartbeat_s) and self.renew():
            pass

    def renew(self) -> bool:
        """One heartbeat: False once another run's record has replaced this one's."""
        try:
            record = self._read()
            if (record or {}).get("token") != self.me["token"]:
                self.lost = record or {}
                return False
            self._write()
        except OSError as e:  # the store is unreachable: try again at the next beat
            self.warn(f"warning: could not renew the lease on {storage.redact(self.root)} ({e})")
        return True


def _parse(data: bytes) -> Optional[dict]:
    try:
        record = json.loads(data)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
