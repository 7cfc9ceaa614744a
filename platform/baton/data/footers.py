"""What the Parquet footers say of a corpus's columns, checked before anything starts.

Every file's footer is read for the manifest; it also holds the file's schema and, for each
column chunk, the writer's statistics (nulls, least and greatest value) and how many values
it holds. From those alone, with no row read, a column missing from one file or of another
kind there, a null, a class label or token id out of range, or a list row of another length
is refused in one line naming the file and row group, before Ray starts (`baton validate`
too), instead of when its row group is read, possibly hours into the run. The rows are still
checked as they are read (`feed._field`): a writer that records no statistics, a NaN (never
in the statistics) or a file changed after the listing is found there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa

from baton.errors import SpecError


@dataclass(frozen=True)
class ColumnFacts:
    """What one file's footer says of one column (of one leaf), over its row groups of rows."""

    nulls: Optional[int]  # null rows or values; None: a row group records no count
    null_group: Optional[int]  # the first row group that holds one
    low: Optional[float]  # the least and greatest values the row groups record (numbers only)
    high: Optional[float]
    first_group: int  # the first row group of rows
    per_row: float  # values a row there: a list column's length
    odd_group: Optional[int]  # the first row group with another number of values a row


def footer_facts(meta, columns: Optional[set[str]] = None) -> tuple[Any, dict[str, ColumnFacts]]:
    """(arrow schema, {column: facts}) of one file's footer (`pyarrow.parquet.FileMetaData`),
    for its columns of one leaf each (a number, a list of numbers, a tensor) among `columns`
    (None: all; a job's reads a few of what may be a wide table's many)."""
    leaves: dict[str, list[int]] = {}
    for i in range(meta.num_columns):
        name = meta.schema.column(i).path.split(".")[0]
        if columns is None or name in columns:
            leaves.setdefault(name, []).append(i)
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    facts = {}
    for name, found in leaves.items():
        if len(found) != 1:
            continue
        nulls, null_group, low, high = 0, None, None, None
        first_group, per_row, odd_group = None, None, None
        for g, rg in enumerate(groups):
            if not rg.num_rows:
                continue
            chunk = rg.column(found[0])
            ratio = chunk.num_values / rg.num_rows
            if per_row is None:
                first_group, per_row = g, ratio
            elif ratio != per_row and odd_group is None:
                odd_group = g
            stats = chunk.statistics
            if stats is None or not stats.has_null_count:
                nulls = None
            elif stats.null_count:
                null_group = g if null_group is None else null_group
                nulls = None if nulls is None else nulls + stats.null_count
            if stats is not None and stats.has_min_max and _number(stats.min) and _number(stats.max):
                low = stats.min if low is None else min(low, stats.min)
                high = stats.max if high is None else max(high, stats.max)
        if per_row is not None:  # (a file of empty row groups says nothing)
            facts[name] = ColumnFacts(nulls, null_group, low, high, first_group, per_row, odd_group)
    return meta.schema.to_arrow_schema(), facts


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _form(t: pa.DataType) -> tuple:
    """(shape kind, fixed length, integers): what a column's values are, for comparing files."""
    if isinstance(t, pa.FixedShapeTensorType):
        return ("tensor", tuple(t.shape), _integers(t.value_type))
    if pa.types.is_fixed_size_list(t):
        return ("list", t.list_size, _integers(t.value_type))
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return ("list", None, _integers(t.value_type))
    return ("scalar", None, _integers(t))


def _integers(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_boolean(t)


def check_footers(manifest, columns, schema: pa.Schema, source: str, where: str) -> None:
    """Every file of `manifest` (built from the footers) holds each column `columns` reads, as
    the same kind of values as `schema` (the first file's) says, with no nulls, in range,
    and (lists) as many values a row as the field reads; raises SpecError naming the first
    file and row group that does not."""
    if manifest.footers is None:
        return
    tops = {name: max((f[name].high for _, f in manifest.footers.values()
                       if name in f and f[name].high is not None), default=None)
            for field in columns.fields if field.high is not None for name in field.sources}
    for path, (theirs, facts) in manifest.footers.items():
        file = f"{where.rstrip('/')}/{path}" if path else where
        if columns.id is not None and columns.id not in theirs.names:
            raise SpecError(f"{source}: data.id_column: {columns.id!r} is not a column of {file} "
                            f"(columns: {', '.join(theirs.names)[:300]}); every file must hold it")
        for field in columns.fields:
            for name in field.sources:
                _check_column(field, name, schema.field(name).type, theirs, facts.get(name),
                              file, source, len(field.sources) == 1, tops.get(name))


def _check_column(field, name: str, first: pa.DataType, theirs: pa.Schema,
                  facts: Optional[ColumnFacts], file: str, source: str, single: bool,
                  top: Optional[float]) -> None:
    """One column of one file (`top`: the greatest value any file records, for the fix)."""
    key = f"{source}: {field.key}"
    if name not in theirs.names:
        raise SpecError(f"{key}: {name!r} is not a column of {file} (columns: "
                        f"{', '.join(theirs.names)[:300]}); every file must hold the columns "
                        "data.columns reads")
    t = theirs.field(name).type
    mine, other = _form(first), _form(t)
    if mine[:2] != other[:2] or (field.dtype == "int64" and not other[2]):
        raise SpecError(f"{key}: {name!r} holds {t} in {file}, where the first file holds {first}; "
                        "every file must hold it as the same kind of values")
    if facts is None:
        return
    if facts.nulls:
        raise SpecError(f"{key}: {name!r} has {facts.nulls} null value{'s' * (facts.nulls != 1)} "
                        f"in {file} (the first in row group {facts.null_group}); drop or fill "
                        "them, and write the file again")
    if field.high is not None and facts.low is not None and (facts.low < 0 or facts.high >= field.high):
        low, high, top = int(facts.low), int(facts.high), int(top)
        others = f" (and up to {top} in another file)" if top > high else ""
        if field.key == "data.token_column":
            raise SpecError(f"{key}: token ids in {file} lie in [{low}, {high}]{others} but "
                            f"model.vocab_size is {field.high}; set model.vocab_size: {top + 1} "
                            "or more")
        if field.key == "data.loss_mask_column":
            raise SpecError(f"{key}: values in {file} lie in [{low}, {high}]{others}; a loss mask "
                            "holds 1 where a token is a target, 0 where not")
        raise SpecError(f"{key}: values in {file} lie in [{low}, {high}]{others} but the model "
                        f"has {field.high} classes (model.options.classes); labels must lie in "
                        f"[0, {field.high})")
    if other[0] == "list" and other[1] is None and not field.padded:
        want = math.prod(field.shape) if single else None
        odd = facts.odd_group if want is None or facts.per_row == want else facts.first_group
        if odd is not None:
            tokens = field.key in ("data.token_column", "data.loss_mask_column")
            what = (f"{field.shape[0]} tokens (model.seq_len + 1)" if field.key == "data.token_column"
                    else f"{field.shape[0]} values (model.seq_len + 1, as its token row does)" if tokens
                    else f"{want} values" if want is not None else "as many values")
            raise SpecError(f"{key}: {name!r} holds rows of another length in row group {odd} of "
                            f"{file}: every row must hold {what}"
                            + ("" if tokens else " (lists of any length: data.pad)"))

