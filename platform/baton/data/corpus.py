"""The built-in corpus: the Python standard library's own source files, one document each,
byte-level tokenised and packed by the text path (`text.py`) like any user's documents.

Real text that every Python installation carries, so a job trains on something nobody here
wrote without reaching any hub. Deterministic: the same Python version gives the same parts.
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

from baton.errors import DataError

STDLIB_PARTS = 8  # inputs to the text path, so parts of about 4 MB


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


def prepare_stdlib(out_dir: str | os.PathLike, seq_len: int, parts: int = STDLIB_PARTS) -> dict:
    """Write the corpus into `out_dir` through the text path (`baton data prepare text`, run
    in this process): each source file is a document (read as UTF-8; the few bytes that are
    not become U+FFFD), byte tokens, each document followed by the end-of-document token 0;
    the files, in path order, are cut into `parts` inputs of about equal size."""
    from baton.data.text import prepare_text

    files = stdlib_files()
    texts = [f.read_bytes().decode("utf-8", errors="replace") for f in files]
    bounds = np.searchsorted(np.cumsum([len(t) for t in texts]),
                             np.linspace(0, sum(map(len, texts)), parts + 1)[1:-1])
    with tempfile.TemporaryDirectory(prefix="baton-stdlib-") as docs:
        for k, (a, b) in enumerate(zip([0, *bounds], [*bounds, len(texts)])):
            if a == b:
                continue
            with open(Path(docs) / f"docs-{k:03d}.jsonl", "w", encoding="utf-8") as out:
                out.writelines(json.dumps({"text": t}) + "\n" for t in texts[a:b])
        return prepare_text(docs, str(out_dir), seq_len, on_ray=False,
                            about={"source": "python-stdlib", "python": sys.version.split()[0],
                                   "files": len(files)})


@contextlib.contextmanager
def staged_corpus(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out`, renamed to `out` when the block completes and removed
    when it fails: a crash leaves either nothing or a complete corpus."""
    if out.exists():
        raise FileExistsError(f"{out} already exists")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:  # a folder this process may not make (under a file, read-only, /proc)
        raise DataError(f"cannot write a corpus to {out} ({type(e).__name__}: "
                        f"{e.strerror or e}); choose another folder") from None
    try:
        yield tmp
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
