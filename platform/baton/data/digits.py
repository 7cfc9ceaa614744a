"""The digits dataset as Parquet: 1,797 8 x 8 images of handwritten digits (UCI's optical
recognition of handwritten digits, the test half, as scikit-learn ships it inside its wheel:
no download). Real data nobody here wrote, small enough to train a classifier on 2 cores.

Columns: `pixels` (64 integers in 0..16, a fixed-size list), `label` (0-9), `sample_id`. Row
groups of 64 images, so that held-out evaluation (by row group) can take about any fraction."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from baton.data.corpus import staged_corpus
from baton.errors import SpecError

ROW_GROUP = 64


def prepare_digits(out_dir: str | os.PathLike) -> dict:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SpecError("data.source: digits is read from scikit-learn's bundled copy; install "
                        "it with `pip install 'baton[examples]'` (or scikit-learn)") from None
    digits = load_digits()
    pixels = digits.data.astype(np.int8)  # (1797, 64), values 0..16
    labels = digits.target.astype(np.int8)
    # a fixed shuffle, so that every row group holds all the classes (the file is in order of
    # the writers who drew them)
    order = np.random.default_rng(0).permutation(len(labels))
    pixels, labels = pixels[order], labels[order]
    table = pa.table({
        "pixels": pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), pixels.shape[1]),
        "label": pa.array(labels),
        "sample_id": pa.array(np.arange(len(labels), dtype=np.int64)),
    })
    with staged_corpus(Path(out_dir)) as tmp:
        pq.write_table(table, tmp / "digits.parquet", row_group_size=ROW_GROUP)
        info = {"source": "sklearn.datasets.load_digits", "samples": len(labels),
                "features": int(pixels.shape[1]), "classes": int(labels.max()) + 1,
                "row_groups": -(-len(labels) // ROW_GROUP)}
        (tmp / "_about.json").write_text(json.dumps(info, indent=1))
    return info
