"""Paths and URIs: a local folder or any pyarrow filesystem URI (s3://, gs://, hdfs://)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import threading
import time
import zlib
from typing import Any, Callable, Optional, TypeVar

import pyarrow.fs as pafs

from baton.errors import StoreUnavailable


STORAGE_ENV = "BATON_STORAGE"


# the user and password of a URI (s3://KEY:SECRET@bucket, https://user:pass@host), and query
# parameters that carry a secret (?secret_key=..., &session_token=..., ?sig=...)
_USERINFO = re.compile(r"(?<=://)[^\s'\"]*@")  # to the last @: an AWS secret may hold a raw /
_SECRET_PARAM = re.compile(r"(?i)(?<=[?&;])((?:[a-z_]*(?:secret|password|passwd|token|key|credential|"
                           r"signature)[a-z_]*|sig)=)[^&#\s'\"]*")


def redact(value: Any) -> Any:
    """`value` with the credentials of every URI in it replaced by ***: a string (a URI, or a
    message naming one), or the strings inside a dict or list. What baton records or prints
    (MLflow params and tags, events, checkpoint metadata, errors) goes through here; the
    credentials stay usable only where they are needed, in the spec in memory."""
    if isinstance(value, str):
        if "://" not in value and "=" not in value:
            return value
        return _SECRET_PARAM.sub(r"\1***", _USERINFO.sub("***@", value))
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def local_root() -> str:
    """Where a job's relative local paths (data, checkpoints, the default MLflow store) live:
    $BATON_STORAGE when set (a shared folder on a cluster: `baton submit --storage`, the
    Kubernetes volume), else the working directory. A submitted job's working directory is a
    package folder that the next submission does not reuse, so keeping state there would lose
    it."""
    return os.path.abspath(os.environ.get(STORAGE_ENV) or os.getcwd())


def local_path(path: str) -> str:
    """An absolute local path: relative ones are taken from `local_root()`."""
    local = path[len("file://"):] if path.startswith("file://") else path
    return os.path.join(local_root(), os.path.expanduser(local))


def is_uri(path: str) -> bool:
    """`path` names a filesystem of its own (`s3://...`), not a local path."""
    return "://" in path and not path.startswith("file://")


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path within it (relative local paths: see `local_root`)."""
    if is_uri(path):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.normpath(local_path(path))


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def write_durably(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """`data` at `path`, whole or not at all, and on the disk when this returns (see
    `durable_writer`)."""
    with durable_writer(fs, path) as f:
        f.write(data)


class Crc32:
    """zlib's CRC-32 behind hashlib's interface (`update`, `hexdigest`)."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


# The checksums a part's record may carry, by the key it is recorded under. New records
# carry CRC-32: it finds what a checkpoint's checksum is there for (a truncated file, a
# flipped bit, a burst of bad bytes) at 2.4 times SHA-256's speed here (2.85 against
# 1.2 GB/s on one core, `benchmarks/write_cost.py`), and a writer's CPU is what a save costs
# a busy host. Neither guards against someone who can rewrite the files: meta.json, which
# holds the checksums, sits beside them. Older checkpoints carry SHA-256, and verify with it.
CHECKSUMS = {"crc32": Crc32, "sha256": hashlib.sha256}
CHECKSUM = "crc32"


def checksum_kind(record: dict) -> str:
    """The kind of checksum a part's record carries (KeyError when none)."""
    for kind in CHECKSUMS:
        if kind in record:
            return kind
    raise KeyError(f"no checksum among {sorted(record)}")


class ChecksumWriter:
    """A binary stream's writer that counts and checksums what goes through it, so a part's
    record comes with its one write, without a second pass or a copy in memory. What DCP's
    writer asks of its streams is here too (`tell`, `fileno`); `close` leaves the stream to
    whoever opened it."""

    def __init__(self, f):
        self.f, self.size, self.sum = f, 0, CHECKSUMS[CHECKSUM]()

    def write(self, data) -> int:
        n = memoryview(data).nbytes  # len() counts a typed buffer's items, not its bytes
        self.sum.update(data)
        self.size += n
        self.f.write(data)
        return n

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.flush()

    def record(self) -> dict:
        return {"size": self.size, CHECKSUM: self.sum.hexdigest()}


@contextlib.contextmanager
def durable_writer(fs: pafs.FileSystem, path: str):
    """A `ChecksumWriter` whose content is at `path` whole or not at all, and on the disk, once
    the block ends without an error: on a local disk written under a temporary name,
    fsynced, renamed, and the folder fsynced; on object storage one upload, which stores the
    object whole or not at all."""
    if not is_local(fs):
        with fs.open_output_stream(path) as f:
            yield ChecksumWriter(f)
        return
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "wb") as f:
            yield ChecksumWriter(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(fs, os.path.dirname(path))


def fsync_dir(fs: pafs.FileSystem, path: str) -> None:
    """Make a local folder's entries (files created or renamed in it) durable."""
    if is_local(fs):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_record(fs: pafs.FileSystem, path: str, kind: str = CHECKSUM) -> dict:
    """{"size", kind: the checksum} of a file, read in 8 MiB pieces."""
    h, size = CHECKSUMS[kind](), 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, kind: h.hexdigest()}


def size_of(fs: pafs.FileSystem, path: str) -> int:
    """A file's size in bytes; -1 when it does not exist."""
    info = fs.get_file_info(path)
    return -1 if info.type == pafs.FileType.NotFound else info.size


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


T = TypeVar("T")
READ_TRIES, READ_FIRST_WAIT_S = 4, 0.5  # waits 0.5, 1 and 2 s between the tries


def retried(read: Callable[[], T], path: str) -> T:
    """`read()` (of `path`), tried again after 0.5, 1 and 2 s when the store fails to answer:
    an OSError other than the file being absent, which is an answer. After the last try,
    `StoreUnavailable`: a checkpoint that could not be read has not been found wrong."""
    tries = 0
    while True:
        try:
            return read()
        except FileNotFoundError:
            raise
        except OSError as e:
            tries += 1
            if tries == READ_TRIES:
                raise StoreUnavailable(f"could not read {redact(path)} ({READ_TRIES} tries): "
                                       f"{type(e).__name__}: {e}") from e
            time.sleep(READ_FIRST_WAIT_S * 2 ** (tries - 1))


def read_retried(fs: pafs.FileSystem, path: str) -> bytes:
    """A whole file's bytes, the read tried again when the store fails to answer (`retried`)."""
    return retried(lambda: read_bytes(fs, path), path)


READ_WINDOW_BYTES = 1 << 20  # one request's worth of a file read in small pieces


class RetryingInput(io.RawIOBase):
    """A file of `fs` open for random reads (what DCP's reader seeks in and reads), in few
    requests, each tried again when the store fails to answer (`retried`).

    Reads smaller than READ_WINDOW_BYTES are served from one window of the file, fetched in
    one request and kept until a read falls outside it; larger reads are one request each.
    DCP loads each tensor with `torch.load` on a view of its file: a zip archive read in
    pieces of a few bytes (its directory at the end, a header per record), and on an object
    store each piece was a request of its own. Measured resuming a 2-layer GPT's ZeRO-3
    checkpoint from moto's S3 server under DDP at dp 2, for one step: 8,528 GET requests of
    the shards' files and 64 s for the run before the window, 6 and 12.6 s with it.

    A seek is only a position. A failed request is made again from a file opened again, so a
    connection that an object store drops halfway through a shard costs a new request, not
    the load."""

    def __init__(self, fs: pafs.FileSystem, path: str):
        super().__init__()
        self.fs, self.path, self.pos = fs, path, 0
        self.file: Optional[pafs.NativeFile] = None
        self.size = self._call(lambda f: f.size())  # opened now: a missing file fails here
        self._window: tuple[int, bytes] = (0, b"")

    def _call(self, op: Callable[[Any], T]) -> T:
        def once() -> T:
            try:
                if self.file is None:  # (again)
                    self.file = self.fs.open_input_file(self.path)
                return op(self.file)
            except OSError:
                broken, self.file = self.file, None
                if broken is not None:
                    with contextlib.suppress(OSError):
                        broken.close()
                raise
        return retried(once, self.path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        pos = offset + {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        if pos < 0:
            raise ValueError(f"negative seek position {pos} in {redact(self.path)}")
        self.pos = pos
        return pos

    def read(self, size: int = -1) -> bytes:
        want = self.size - self.pos if size is None or size < 0 else size
        buffer = bytearray(max(0, min(want, self.size - self.pos)))
        return bytes(buffer[:self.readinto(buffer)])

    def readinto(self, buffer) -> int:
        n, at = max(0, min(len(buffer), self.size - self.pos)), self.pos
        if n == 0:
            return 0
        view = memoryview(buffer).cast("B")[:n]
        if n >= READ_WINDOW_BYTES:
            def whole(f) -> int:
                f.seek(at)
                return f.readinto(view)
            n = self._call(whole)
        else:
            start, data = self._window
            if not start <= at <= at + n <= start + len(data):
                start = max(0, min(at, self.size - READ_WINDOW_BYTES))
                data = self._call(lambda f: f.read_at(READ_WINDOW_BYTES, start))
                self._window = (start, data)
            n = max(0, min(n, start + len(data) - at))  # a file cut short since it was opened
            view[:n] = data[at - start:at - start + n]
        self.pos += n
        return n

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        self._window = (0, b"")
        super().close()


def list_dirs(fs: pafs.FileSystem, path: str) -> list[str]:
    """Base names of the folders directly inside `path` (none if it does not exist)."""
    if not exists(fs, path):
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
