"""The manifest: what the corpus is, read from Parquet footers alone (no rows).

A corpus is a list of units, the Parquet row groups of its files in a canonical order (files
sorted by path, row groups by index). A sample's *position* is its index in that order; the
epoch order (`order.py`) permutes positions, and a reader fetches the units that hold them.
The driver holds this and a cursor, never the rows.

The manifest is recorded in every checkpoint, and its digest pins the corpus: a resume on
other files (one added, removed, rewritten to another size or row-group layout) is refused.
A row group of no rows is no unit (it holds no position; read, it held no column's values).

A manifest built from the footers also keeps what each file's footer says of its columns
(`footers`: the schema, and for each column its nulls, least and greatest values and values
a row, from the writer's statistics), so that a column missing from one file, a null, a
label out of range or a token row of another length is refused before anything starts
(`footers.check_footers`) rather than when its row group is read, hours into a run. A
manifest read back from a checkpoint has none: the files are checked again as they are read.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from baton import storage
from baton.data.footers import ColumnFacts, footer_facts

if TYPE_CHECKING:
    import pyarrow.dataset as pads

FOOTER_THREADS = 16  # footers are small reads: on object storage, latency is what matters


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the corpus root ('' when the root is the file itself)
    size: int  # bytes on storage
    row_groups: tuple[int, ...]  # rows of each row group


@dataclass(frozen=True)
class Unit:
    """One row group: what a reader fetches and a worker holds."""

    uid: int  # index in the manifest's unit order
    file: str  # full path within the filesystem
    row_group: int
    rows: int
    offset: int  # position of its first row


class Manifest:
    def __init__(self, root: str, files: list[FileEntry], footers: Optional[dict] = None):
        self.root = root
        # path -> footer_facts(its footer), when built from the footers
        self.footers: Optional[dict[str, tuple[Any, dict[str, ColumnFacts]]]] = footers
        self.files = sorted(files, key=lambda f: f.path)
        fs_root = storage.resolve(root)[1]
        self.units: list[Unit] = []
        offset = 0
        for f in self.files:
            full = f"{fs_root}/{f.path}" if f.path else fs_root
            for g, rows in enumerate(f.row_groups):
                if rows:
                    self.units.append(Unit(len(self.units), full, g, rows, offset))
                    offset += rows
        self.num_samples = offset
        self.unit_rows = np.array([u.rows for u in self.units], dtype=np.int64)
        self._starts = np.array([u.offset for u in self.units], dtype=np.int64)

    @classmethod
    def build(cls, root: str, dataset: Optional[pads.Dataset] = None,
              columns: Optional[set[str]] = None) -> "Manifest":
        """Read every file's footer under `root` (a folder or URI, or one file), and the
        facts of `columns` (None: every column) in it."""
        fs, path = storage.resolve(root)
        if dataset is None:
            # imported here: workers import this module (through the feed's Batch) and never
            # list a corpus; pyarrow.dataset and the pandas it imports were about 0.2 s and
            # 36 MiB of each worker's start (docs/benchmarks.md)
            import pyarrow.dataset as pads

            dataset = pads.dataset(path, filesystem=fs, format="parquet", exclude_invalid_files=False)
        fragments = list(dataset.get_fragments())
        infos = fs.get_file_info([f.path for f in fragments])

        def entry(pair) -> tuple[FileEntry, tuple]:
            fragment, info = pair
            meta = fragment.metadata  # the footer
            rel = fragment.path[len(path):].lstrip("/")
            groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
            return FileEntry(rel, info.size, groups), footer_facts(meta, columns)

        with ThreadPoolExecutor(FOOTER_THREADS) as pool:
            read = list(pool.map(entry, zip(fragments, infos)))
        return cls(root, [f for f, _ in read], {f.path: facts for f, facts in read})

    def to_json(self) -> dict:
        return {"files": [[f.path, f.size, list(f.row_groups)] for f in self.files]}

    @classmethod
    def from_json(cls, root: str, data: dict) -> "Manifest":
        return cls(root, [FileEntry(p, int(s), tuple(int(r) for r in g)) for p, s, g in data["files"]])

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    def rows_digest(self) -> str:
        """The digest of the files' paths and their row groups' rows, not their sizes: what
        the order of the samples depends on."""
        rows = [[f.path, list(f.row_groups)] for f in self.files]
        return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]

    def summary(self) -> dict:
        return {"files": len(self.files), "row_groups": len(self.units), "samples": self.num_samples,
                "bytes": self.bytes, "digest": self.digest(), "rows_digest": self.rows_digest()}

    def trained(self, meta: dict) -> bool:
        """Whether checkpoint metadata `meta` was written on this corpus."""
        return meta.get("data", {}).get("digest") == self.digest()

    def same_rows(self, meta: dict) -> bool:
        """Whether checkpoint `meta`'s corpus had these files with these row groups (their
        bytes may differ: a file whose bad rows were fixed in place), so that its cursor means
        the same samples here (checkpoints written before the rows' digest: no)."""
        return meta.get("data", {}).get("rows_digest") == self.rows_digest()

    def changes_from(self, old: "Manifest") -> Optional[str]:
        """What changed since `old`, in one line ('2 files added (part-9.parquet, ...)'), or
        None for the same corpus."""
        if old.digest() == self.digest():
            return None
        before = {f.path: f for f in old.files}
        after = {f.path: f for f in self.files}
        parts = []
        for label, names in (("added", sorted(after.keys() - before.keys())),
                             ("removed", sorted(before.keys() - after.keys())),
                             ("changed", sorted(p for p in before.keys() & after.keys()
                                                if before[p] != after[p]))):
            if names:
                shown = ", ".join(n or "(the file)" for n in names[:3]) + (", ..." if len(names) > 3 else "")
                parts.append(f"{len(names)} file{'s' * (len(names) != 1)} {label} ({shown})")
        return "; ".join(parts) or "the row groups differ"

    def unit_of(self, positions: np.ndarray) -> np.ndarray:
        """The uid of the unit holding each position."""
        return np.searchsorted(self._starts, positions, side="right") - 1
