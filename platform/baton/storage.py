"""Paths and URIs: a local folder or any pyarrow filesystem URI (s3://, gs://, hdfs://)."""

from __future__ import annotations

import os

import pyarrow.fs as pafs


def resolve(path: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and the path within it. Relative local paths are taken from the cwd."""
    if "://" in path and not path.startswith("file://"):
        return pafs.FileSystem.from_uri(path)
    local = path[len("file://"):] if path.startswith("file://") else path
    return pafs.LocalFileSystem(), os.path.abspath(local)


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
