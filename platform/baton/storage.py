"""Paths and URIs: a local folder or any pyarrow filesystem URI (s3://, gs://, hdfs://)."""

from __future__ import annotations

import os

import pyarrow.fs as pafs


STORAGE_ENV = "BATON_STORAGE"


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


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path within it (relative local paths: see `local_root`)."""
    if "://" in path and not path.startswith("file://"):
        return pafs.FileSystem.from_uri(path)
    return pafs.LocalFileSystem(), os.path.normpath(local_path(path))


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    with fs.open_output_stream(path) as f:
        f.write(data)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def list_dirs(fs: pafs.FileSystem, path: str) -> list[str]:
    """Base names of the folders directly inside `path` (none if it does not exist)."""
    if not exists(fs, path):
        return []
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=False))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
