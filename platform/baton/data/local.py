"""A whole corpus in one process, in manifest order: for single-process references and plain
PyTorch baselines (the tests, the benchmarks), which must train on exactly the batches a baton
job trains on. baton's own path never does this: it streams (`feed.py`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from baton import storage
from baton.data.manifest import Manifest
from baton.data.order import EpochOrder


def read_corpus(path: str, token_column: str = "tokens",
                id_column: str | None = "sample_id") -> tuple[np.ndarray, np.ndarray]:
    """(ids, tokens (rows, seq_len + 1)): row i is the sample at position i."""
    manifest = Manifest.build(path)
    fs = storage.resolve(path)[0]
    tables = []
    for u in manifest.units:
        with fs.open_input_file(u.file) as f:
            tables.append(pq.ParquetFile(f).read_row_group(u.row_group))
    table = pa.concat_tables(tables)
    tokens = table.column(token_column).combine_chunks().flatten().to_numpy()
    ids = (table.column(id_column).to_numpy() if id_column
           else np.arange(table.num_rows, dtype=np.int64))
    return ids, tokens.reshape(table.num_rows, -1)


def job_order(spec, path: str | None = None) -> EpochOrder:
    """The epoch order a job trains in (on its data.path, or `path`), held-out row groups
    left out."""
    from baton.data.source import held_out

    manifest = Manifest.build(path or spec.data.path)
    uids = held_out(manifest, spec.eval.fraction, spec.eval.seed, "")[0] if spec.eval.fraction else None
    return EpochOrder(manifest.unit_rows, spec.train.seed, spec.data.shuffle_block, uids)
