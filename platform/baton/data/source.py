"""Reading the token dataset: a pre-flight check before Ray starts, then Ray Data reads it.

The whole token table goes into Ray's object store once; every worker on a node maps the same
shared-memory copy (zero-copy numpy) and indexes its rows of each step by position. This holds
datasets up to the object store's size; streaming larger ones is future work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from baton import storage
from baton.errors import DataError, SpecError
from baton.spec import JobSpec


@dataclass
class TokenTable:
    ids: np.ndarray  # (N,) int64 sample ids, sorted
    tokens: np.ndarray  # (N, seq_len + 1) token ids

    def __len__(self) -> int:
        return len(self.ids)


def needs_prepare(spec: JobSpec) -> bool:
    """True when the job uses the built-in corpus and it has not been prepared yet."""
    fs, path = storage.resolve(spec.data.path)
    return spec.data.source == "stdlib" and not storage.exists(fs, path)


def preflight(spec: JobSpec, source: str) -> int:
    """Check the dataset exists and is shaped for the model, without Ray; return its row count."""
    d, want = spec.data, spec.model.seq_len + 1
    fs, path = storage.resolve(d.path)
    if not storage.exists(fs, path):
        fix = ("run `baton data prepare stdlib --out DIR`, or use data.source: stdlib"
               if d.source == "parquet" else "it is prepared on first run")
        raise SpecError(f"{source}: data.path: {d.path!r} does not exist; {fix}")
    try:
        ds = pads.dataset(path, filesystem=fs, format="parquet", exclude_invalid_files=False)
        schema = ds.schema
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(f"{source}: data.path: {d.path!r} is not a Parquet dataset ({e})") from None
    for key, column in (("token_column", d.token_column), ("id_column", d.id_column)):
        if column is not None and column not in schema.names:
            raise SpecError(f"{source}: data.{key}: {column!r} is not a column of {d.path!r}; "
                            f"columns: {', '.join(schema.names)}")
    rows = ds.count_rows()
    if rows == 0:
        raise SpecError(f"{source}: data.path: {d.path!r} holds no rows")
    first = ds.head(1, columns=[d.token_column]).column(0)
    length = len(first[0].values) if first[0].is_valid else 0
    if length != want:
        raise SpecError(
            f"{source}: model.seq_len: {spec.model.seq_len} does not fit the data; rows of "
            f"{d.path!r} hold {length} tokens, so set model.seq_len: {length - 1} or prepare "
            f"data with --seq-len {spec.model.seq_len}")
    return rows


def _to_numpy(tokens: pa.ChunkedArray, want: int) -> np.ndarray:
    arr = tokens.combine_chunks()
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    if arr.null_count or (lengths != want).any():
        raise DataError(f"every token row must hold {want} tokens; found lengths "
                        f"{sorted(set(lengths.tolist()))[:5]} and {arr.null_count} null rows")
    return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(arr), want)


def load_table(spec: JobSpec) -> TokenTable:
    """Read the dataset with Ray Data (needs a connected Ray) into one sorted TokenTable."""
    import ray

    d = spec.data
    fs, path = storage.resolve(d.path)
    columns = [d.token_column] + ([d.id_column] if d.id_column else [])
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # row positions are ids when there is no id column
    ds = ray.data.read_parquet(path, filesystem=fs).select_columns(columns)
    table = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    tokens = _to_numpy(table.column(d.token_column), spec.model.seq_len + 1)
    if d.id_column:
        ids = table.column(d.id_column).to_numpy().astype(np.int64)
        order = np.argsort(ids, kind="stable")
        ids, tokens = ids[order], tokens[order]
        if len(ids) > 1 and (np.diff(ids) == 0).any():
            raise DataError(f"data.id_column {d.id_column!r} holds duplicate ids")
    else:
        ids = np.arange(len(tokens), dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= spec.model.vocab_size):
        raise DataError(f"data.path: token ids in {d.path!r} lie in [{tokens.min()}, {tokens.max()}] "
                        f"but model.vocab_size is {spec.model.vocab_size}; set model.vocab_size: "
                        f"{int(tokens.max()) + 1} or more")
    return TokenTable(ids=ids, tokens=np.ascontiguousarray(tokens))
