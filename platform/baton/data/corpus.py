"""The built-in corpus: the Python standard library's own source files, byte-level tokenised.

Real text that every Python installation carries, so a job trains on something nobody here
wrote without reaching any hub. Deterministic: the same Python version gives the same shards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SHARD_ROWS = 8192


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def stdlib_stream() -> tuple[np.ndarray, int]:
    """All stdlib sources concatenated, as bytes (vocabulary 256); and how many files."""
    files = stdlib_files()
    return np.frombuffer(b"".join(p.read_bytes() for p in files), dtype=np.uint8), len(files)


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """Rows of seq_len + 1 tokens (inputs and their next-token targets), stride seq_len, so
    every token but the first is a target exactly once."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def prepare_stdlib(out_dir: str | os.PathLike, seq_len: int, shard_rows: int = SHARD_ROWS) -> dict:
    """Write the corpus as Parquet shards (columns sample_id, tokens) into `out_dir`.

    Written to a temporary folder beside it and renamed into place, so a crash leaves either
    nothing or a complete corpus."""
    with staged_corpus(Path(out_dir)) as tmp:
        stream, num_files = stdlib_stream()
        rows = windows(stream, seq_len)
        for shard, start in enumerate(range(0, len(rows), shard_rows)):
            block = rows[start:start + shard_rows]
            tokens = pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), seq_len + 1)
            table = pa.table({"sample_id": pa.array(np.arange(start, start + len(block))),
                              "tokens": tokens})
            pq.write_table(table, tmp / f"part-{shard:05d}.parquet")
        info = {"source": "python-stdlib", "python": sys.version.split()[0], "files": num_files,
                "tokens": int(len(stream)), "seq_len": seq_len, "samples": int(len(rows)),
                "vocab_size": 256}
        (tmp / "_corpus.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


@contextlib.contextmanager
def staged_corpus(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed to `out` when the block completes and removed
    when it fails: a crash leaves either nothing or a complete corpus."""
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
