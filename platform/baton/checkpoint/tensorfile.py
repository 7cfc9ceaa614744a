"""safetensors files on any filesystem pyarrow opens (a local folder, `s3://`): written as a
stream, read a tensor at a time by byte range.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range in the data that follows; `__metadata__`: strings),
then the tensors' bytes, contiguous, little-endian. The safetensors package reads and writes
only local paths or whole byte strings: an export to object storage would have to be staged
on a local disk (or in memory) first, and a worker starting from an export there would fetch
whole files to read its layers. Here a file is written straight to its output stream, and a
tensor read with one ranged request. Files written here are what `safetensors.safe_open` and
transformers read (tests/unit/test_export.py), and nothing read is unpickled: a header is JSON,
checked before any range is read.
"""

from __future__ import annotations

import json
import math
import struct
from typing import BinaryIO, Optional

import pyarrow.fs as pafs
import torch

from baton import storage
from baton.errors import CheckpointError

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
          torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32",
          torch.uint64: "U64"}
BY_NAME = {name: dtype for dtype, name in DTYPES.items()}
MOST_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
ALIGN = 8  # the header is padded with spaces to a multiple of 8 bytes, as safetensors pads it
# An object store's output stream uploads its parts in the background and returns from each
# write at once: unflushed, a file's whole content queued in memory beside the tensors it was
# written from (one 340 MB file to moto's S3: 717 MiB resident added, against 349 written
# locally; benchmarks/export.py). A flush waits for the uploads, so at most this much waits.
FLUSH_BYTES = 64 * 2**20


def write(f: BinaryIO, tensors: dict[str, torch.Tensor], metadata: Optional[dict] = None) -> int:
    """`tensors` as one safetensors file into the binary stream `f`, in their order; returns
    the bytes written. Tensors that share memory (a tied weight) are each written whole."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for name, t in tensors.items():
        if t.dtype not in DTYPES:
            raise CheckpointError(f"{name}: safetensors has no {t.dtype}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    unflushed = 0
    for t in tensors.values():
        if t.numel():
            f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            unflushed += t.numel() * t.element_size()
            if unflushed >= FLUSH_BYTES:
                f.flush()
                unflushed = 0
    return 8 + len(text) + at


class TensorFile:
    """A safetensors file of `fs`, its header read when opened and each tensor read alone (one
    request on object storage, tried again when the store fails to answer)."""

    def __init__(self, fs: pafs.FileSystem, path: str):
        self.path = path
        self.input = storage.RetryingInput(fs, path)
        try:
            (length,) = struct.unpack("<Q", self._read(0, 8))
            if length > MOST_HEADER_BYTES or 8 + length > self.input.size:
                raise ValueError(f"a header of {length:,} bytes in a file of {self.input.size:,}")
            header = json.loads(self._read(8, length))
            self.metadata = header.pop("__metadata__", None) or {}
            self.start = 8 + length
            self.entries = {name: _entry(name, e, self.input.size - self.start)
                            for name, e in header.items()}
        except (ValueError, KeyError, TypeError, struct.error) as e:
            self.input.close()
            raise CheckpointError(f"{storage.redact(path)} is not a safetensors file "
                                  f"({type(e).__name__}: {str(e)[:200]})") from None

    def _read(self, at: int, n: int) -> bytearray:
        self.input.seek(at)
        buffer = bytearray(n)
        got = self.input.readinto(buffer) if n else 0
        if got != n:
            raise ValueError(f"{n:,} bytes at {at:,} wanted, {got:,} there")
        return buffer

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, (begin, end) = self.entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        try:
            data = self._read(self.start + begin, end - begin)
        except ValueError as e:  # cut short since its header was read
            raise CheckpointError(f"{storage.redact(self.path)}: {name}: {e}") from None
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def close(self) -> None:
        self.input.close()

    def __enter__(self) -> "TensorFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _entry(name: str, e: dict, data_bytes: int) -> tuple[torch.dtype, tuple[int, ...], tuple[int, int]]:
    """A header entry checked: a dtype torch has, a shape of sizes, a byte range in the file
    that holds exactly that many elements."""
    dtype = BY_NAME.get(e["dtype"])
    shape = tuple(e["shape"])
    begin, end = e["data_offsets"]
    if dtype is None:
        raise ValueError(f"{name}: dtype {str(e['dtype'])[:20]!r}")
    if not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError(f"{name}: shape {list(shape)[:8]}")
    want = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes
            and end - begin == want):
        raise ValueError(f"{name}: bytes {begin}..{end} for {want:,} bytes of {data_bytes:,}")
    return dtype, shape, (begin, end)
