"""The dataset before Ray starts: it exists, its shape fits the model, and its manifest.

Nothing here reads rows beyond the first one: the manifest comes from the Parquet footers, and
the rows stream through Ray Data once the job runs (`feed.py`).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from baton import storage
from baton.data.feed import Columns
from baton.data.manifest import Manifest
from baton.errors import SpecError
from baton.spec import JobSpec


def needs_prepare(spec: JobSpec) -> bool:
    """True when the job uses the built-in corpus and it has not been prepared yet."""
    fs, path = storage.resolve(spec.data.path)
    return spec.data.source == "stdlib" and not storage.exists(fs, path)


def preflight(spec: JobSpec, source: str) -> Manifest:
    """Check the dataset exists and is shaped for the model, without Ray; return its manifest."""
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
    try:
        manifest = Manifest.build(d.path, ds)
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(f"{source}: data.path: {d.path!r}: cannot read the Parquet footers ({e})") from None
    if manifest.num_samples == 0:
        raise SpecError(f"{source}: data.path: {d.path!r} holds no rows")
    # the first row of the first row group, read alone: a dataset scan (head) reads ahead
    # through whole files, hundreds of MB of a large corpus
    unit = next(u for u in manifest.units if u.rows)
    with fs.open_input_file(unit.file) as f:
        first = pq.ParquetFile(f).read_row_group(unit.row_group, columns=[d.token_column]).column(0)
    length = len(first[0].values) if first[0].is_valid else 0
    if length != want:
        raise SpecError(
            f"{source}: model.seq_len: {spec.model.seq_len} does not fit the data; rows of "
            f"{d.path!r} hold {length} tokens, so set model.seq_len: {length - 1} or prepare "
            f"data with --seq-len {spec.model.seq_len}")
    return manifest


def columns(spec: JobSpec) -> Columns:
    d = spec.data
    return Columns(d.token_column, d.id_column, spec.model.seq_len + 1, spec.model.vocab_size)
