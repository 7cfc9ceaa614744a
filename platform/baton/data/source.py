"""The dataset before Ray starts: it exists, its shape fits the model and the task, its
manifest, and the held-out evaluation split.

Nothing here reads rows beyond the first row group: the manifest comes from the Parquet footers,
and the rows stream through Ray Data once the job runs (`feed.py`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from baton import storage
from baton.data.feed import Columns, DataFeed, Field, read_unit, token_columns
from baton.data.footers import check_footers
from baton.data.manifest import Manifest
from baton.data.mix import Mixture, mixed_feed
from baton.data.order import EpochOrder
from baton.errors import SpecError, reason
from baton.spec import JobSpec


@dataclass
class EvalSet:
    """Held-out data: row groups `uids` of a corpus (None: all of it), named by the mix's
    source it was held out of (its metrics are also reported on their own), or None."""

    name: Optional[str]
    manifest: Manifest
    uids: Optional[np.ndarray] = None

    @property
    def samples(self) -> int:
        return int(self.manifest.unit_rows[self.uids if self.uids is not None else slice(None)].sum())

    def order(self, shuffle_block: int) -> EpochOrder:
        """Every held-out sample once an epoch, in manifest order."""
        return EpochOrder(self.manifest.unit_rows, 0, shuffle_block, self.uids, shuffle=False)


@dataclass
class JobData:
    """A job's data as checked before Ray starts: the training corpus's manifest, the columns
    the workers read, and the held-out evaluation sets (row groups of the corpus, or a
    dataset of its own). Held-out row groups are never in the training order. A mix of
    corpora (data.mix) is one `Mixture` in place of the manifest, holding each source's
    training row groups; `eval.fraction` holds out row groups of each source, a set each."""

    manifest: Manifest | Mixture
    columns: Columns
    train_uids: Optional[np.ndarray] = None  # None: every row group trains
    eval_sets: list[EvalSet] = field(default_factory=list)

    def order(self, spec: JobSpec) -> EpochOrder:
        return EpochOrder(self.manifest.unit_rows, spec.train.seed, spec.data.shuffle_block,
                          self.train_uids)

    def feed(self, spec: JobSpec):
        """The training batches' feed: the corpus's (feed.DataFeed), or each source's (mix.py)."""
        spread, skip = spec.data.read == "spread", spec.data.skip_bad_row_groups
        if isinstance(self.manifest, Mixture):
            return mixed_feed(self.manifest, self.columns, spec.train.seed, spec.data.shuffle_block,
                              spread, skip)
        return DataFeed(self.manifest, self.order(spec), self.columns, spread, skip)

    @property
    def train_samples(self) -> int:
        if isinstance(self.manifest, Mixture):
            return self.manifest.train_samples
        if self.train_uids is None:
            return self.manifest.num_samples
        return int(self.manifest.unit_rows[self.train_uids].sum())

    @property
    def train_files(self) -> set[str]:
        manifests = self.manifest.manifests if isinstance(self.manifest, Mixture) else [self.manifest]
        return {u.file for m in manifests for u in m.units}

    @property
    def eval_samples(self) -> int:
        return sum(s.samples for s in self.eval_sets)


def needs_prepare(spec: JobSpec) -> bool:
    """True when the job uses built-in data and it has not been prepared yet."""
    fs, path = storage.resolve(spec.data.path)
    return spec.data.source in ("stdlib", "digits") and not storage.exists(fs, path)


def preflight(spec: JobSpec, source: str) -> JobData:
    """Check the data exists and is shaped for the model and the task, without Ray; return
    what the run reads."""
    if spec.data.mix:
        data = _mixed(spec, source)
    else:
        manifest, schema = _dataset(spec, spec.data.path, "data.path", source)
        columns = job_columns(spec, schema, source, manifest)
        _check_first_rows(manifest, columns)
        data = JobData(manifest, columns)
    columns, manifest = data.columns, data.manifest
    e = spec.eval
    if e.fraction and isinstance(manifest, Mixture):  # row groups of each source, a set each
        for k, m in enumerate(manifest.manifests):
            manifest.train_uids[k], held = held_out(m, e.fraction, e.seed, source, k)
            data.eval_sets.append(EvalSet(manifest.names[k], m, held))
    elif e.fraction:
        data.train_uids, held = held_out(manifest, e.fraction, e.seed, source)
        data.eval_sets = [EvalSet(None, manifest, held)]
    elif e.path:
        held, eval_schema = _dataset(spec, e.path, "eval.path", source)
        data.eval_sets = [EvalSet(None, held)]
        trained = "data.mix" if spec.data.mix else "data.path"
        shared = data.train_files & {u.file for u in held.units}
        if shared:
            raise SpecError(f"{source}: eval.path: {e.path!r} shares {len(shared)} file(s) with "
                            f"{trained} (e.g. {sorted(shared)[0]!r}): held-out data must never be "
                            "trained on; give a dataset of its own, or eval.fraction")
        theirs = job_columns(spec, eval_schema, source, held, key="eval.path")
        if theirs != columns:
            raise SpecError(f"{source}: eval.path: {e.path!r} holds other columns than {trained} "
                            "(names, types or sizes); evaluation reads what training reads")
        _check_first_rows(held, columns)
    if spec.task != "language_model":
        problem = task_problem_on_meta(spec, columns)
        if problem:
            raise SpecError(f"{source}: task: {spec.task}: {problem}")
    return data


def _mixed(spec: JobSpec, source: str) -> JobData:
    """data.mix: every source a Parquet dataset of the same columns, each checked as data.path
    is (its footers, its first row group)."""
    manifests, columns = [], None
    for k, mixed in enumerate(spec.data.mix):
        key = f"data.mix[{k}].path"
        manifest, schema = _dataset(spec, mixed.path, key, source)
        mine = job_columns(spec, schema, source, manifest, key=key, where=mixed.path)
        if columns is not None and mine != columns:
            raise SpecError(f"{source}: {key}: {mixed.path!r} holds other columns than "
                            f"data.mix[0].path {spec.data.mix[0].path!r} (names, types or sizes); "
                            "every source of a mix is read as one corpus")
        _check_first_rows(manifest, mine)
        manifests.append(manifest)
        columns = mine
    # token ids mean one vocabulary: corpora `baton data prepare` tokenised otherwise differ
    from baton.data.text import tokenised_by

    known = [(k, t["tokenizer"]) for k, t in enumerate(tokenised_by(m.path) for m in spec.data.mix)
             if t is not None]
    other = next(((k, t) for k, t in known if t != known[0][1]), None)
    if other is not None:
        raise SpecError(f"{source}: data.mix[{other[0]}].path: {spec.data.mix[other[0]].path!r} was "
                        f"tokenised by {other[1]}, data.mix[{known[0][0]}].path by {known[0][1]}; a "
                        "model reads one vocabulary: prepare every source with one tokenizer")
    return JobData(Mixture([m.path for m in spec.data.mix], manifests,
                           [m.weight for m in spec.data.mix], [m.label for m in spec.data.mix],
                           [(p.after_step, p.weights) for p in spec.data.mix_phases]),
                   columns)


def _check_first_rows(manifest: Manifest, columns: Columns) -> None:
    """The first row group, read and checked as a worker reads it (token ids inside the
    vocabulary, labels inside the classes, lists of one length, no nulls): data that does not
    fit the model is refused here, in a second, and not after Ray and the workers have started
    (10 s on a 2-core machine) and the first block is read. Later row groups are checked as
    they are read (DataError, naming the file and row group)."""
    read_unit(manifest.root, next(u for u in manifest.units if u.rows), columns)


def task_problem_on_meta(spec: JobSpec, columns: Columns) -> Optional[str]:
    """Why the task cannot train this model on these columns (None: it can): the model and
    the task run on two padding rows on the meta device (shapes only, no memory, no time)."""
    import torch
    import torch.fx.experimental._config as fx_config

    from baton.models import _on_meta
    from baton.tasks import VALID, Counts, make_task, padded

    task = make_task(spec)
    try:
        model = _on_meta(spec.model)
        # a mask's rows (`loss[batch["valid"]]`) have a data-dependent count, which the meta
        # device refuses by default; taken as every row here, as the two rows are valid
        with torch.device("meta"), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
            batch = {k: v.to("meta") for k, v in padded({}, 2, columns.shapes()).items()}
            batch[VALID] = torch.ones(2, dtype=torch.bool, device="meta")
            output = model(task.inputs(batch))
            loss, metrics = task.loss(output, batch)
    except Exception as e:
        return (f"the model's output on the data's inputs {list(columns.shapes().get('inputs', ((),))[0])} "
                f"failed: {reason(e)}")

    def scalar(v) -> bool:
        return torch.is_tensor(v) and v.dim() == 0

    def pair(v) -> bool:  # a ratio metric: (numerator, denominator), of sums or of classes' sums
        return (isinstance(v, (tuple, list)) and len(v) == 2 and all(map(torch.is_tensor, v))
                and v[0].shape == v[1].shape and v[0].dim() <= 1)

    bad = [k for k, v in {"loss": loss, **metrics}.items()
           if not (scalar(v) or (k != "loss" and (pair(v) or isinstance(v, Counts))))]
    if bad:
        return (f"must return scalar tensors (sums over the batch's rows; a metric may be a "
                f"pair of them, numerator and denominator, a pair of vectors of one length, "
                f"each class's, or baton.tasks.auroc or average_precision); {', '.join(bad)} is not")
    return None


def held_out(manifest: Manifest, fraction: float, seed: int, source: str,
             mixed: Optional[int] = None) -> tuple:
    """(training uids, held-out uids): round(fraction x row groups) row groups (at least one),
    drawn by `seed` (and, for source `mixed` of a mix, its index). By row group, not by row, so
    that an evaluation reads only its own part of a corpus of any size."""
    n = len(manifest.units)
    k = max(1, round(fraction * n))
    where = "data.path" if mixed is None else f"data.mix[{mixed}].path"
    if k >= n:
        raise SpecError(f"{source}: eval.fraction: {fraction} holds out {k} of the {n} row groups "
                        f"of {where}, leaving none to train on; hold-out is by row group: "
                        "write the data in more row groups, lower the fraction, or give eval.path")
    key = [seed, 0xE7A1] + ([mixed] if mixed is not None else [])
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(key)))
    chosen = np.zeros(n, dtype=bool)
    chosen[rng.permutation(n)[:k]] = True
    return np.flatnonzero(~chosen), np.flatnonzero(chosen)


def _dataset(spec: JobSpec, where: str, key: str, source: str) -> tuple[Manifest, pa.Schema]:
    d = spec.data
    fs, path = storage.resolve(where)
    try:
        found = storage.exists(fs, path)
    except OSError as e:  # an endpoint that does not answer, credentials it refuses
        raise SpecError(f"{source}: {key}: cannot read {storage.redact(where)!r} "
                        f"({reason(e)}); check its address and credentials") from None
    if not found:
        fix = ("run `baton data prepare stdlib --out DIR`, or use data.source: stdlib"
               if d.source == "parquet" or key != "data.path" else "it is prepared on first run")
        raise SpecError(f"{source}: {key}: {where!r} does not exist; {fix}")
    try:
        ds = pads.dataset(path, filesystem=fs, format="parquet", exclude_invalid_files=False)
        schema = ds.schema
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(f"{source}: {key}: {where!r} is not a Parquet dataset ({e})") from None
    try:
        manifest = Manifest.build(where, ds, read_columns(spec))
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(f"{source}: {key}: {where!r}: cannot read the Parquet footers ({e})") from None
    if manifest.num_samples == 0:
        raise SpecError(f"{source}: {key}: {where!r} holds no rows")
    return manifest, schema


def read_columns(spec: JobSpec) -> set[str]:
    """The columns a job reads: its tokens, or `data.columns`'s, and its ids."""
    d = spec.data
    named = ([d.token_column, *([d.loss_mask_column] if d.loss_mask_column else [])]
             if spec.task == "language_model" else [c for v in d.columns.values() for c in (v if isinstance(v, list) else [v])])
    return {*named, *([d.id_column] if d.id_column else [])}


def job_columns(spec: JobSpec, schema: pa.Schema, source: str, manifest: Manifest,
                key: str = "data.path", where: Optional[str] = None) -> Columns:
    """What the workers read, checked against the schema: a language model's token rows of
    seq_len + 1, or the task's `data.columns` (numbers, or lists of numbers of one length)."""
    d = spec.data
    where = where or (spec.data.path if key == "data.path" else spec.eval.path)
    if d.id_column is not None and d.id_column not in schema.names:
        raise SpecError(f"{source}: data.id_column: {d.id_column!r} is not a column of {where!r}; "
                        f"columns: {', '.join(schema.names)}")
    if spec.task == "language_model":
        if d.token_column not in schema.names:
            raise SpecError(f"{source}: data.token_column: {d.token_column!r} is not a column of "
                            f"{where!r}; columns: {', '.join(schema.names)}")
        want = spec.model.seq_len + 1
        length = _first_length(manifest, d.token_column)
        if length != want:
            raise SpecError(
                f"{source}: model.seq_len: {spec.model.seq_len} does not fit the data; rows of "
                f"{where!r} hold {length} tokens, so set model.seq_len: {length - 1} or prepare "
                f"data with --seq-len {spec.model.seq_len}")
        mask = d.loss_mask_column
        if mask is not None:
            if mask not in schema.names:
                near = difflib.get_close_matches(mask, schema.names, 1)
                raise SpecError(f"{source}: data.loss_mask_column: {mask!r} is not a column of "
                                f"{where!r}" + (f"; did you mean {near[0]!r}?" if near else "")
                                + f" (columns: {', '.join(schema.names)[:300]})")
            t = schema.field(mask).type
            if not (pa_list(t) and (pa.types.is_integer(t.value_type) or pa.types.is_boolean(t.value_type))):
                raise SpecError(f"{source}: data.loss_mask_column: {mask!r} holds {t}; a loss mask "
                                f"is a list of {want} integers (0 or 1) a row, as its token row")
            length = _first_length(manifest, mask)
            if length != want:
                raise SpecError(f"{source}: data.loss_mask_column: rows of {mask!r} hold {length} "
                                f"values, and of {d.token_column!r} {want}: a loss mask marks each "
                                "token of its row")
        tokens = token_columns(d.token_column, d.id_column, want, spec.model.vocab_size, mask,
                               _document_end(spec, source, key, where))
        check_footers(manifest, tokens, schema, source, where)
        return tokens
    fields = []
    for name, value in d.columns.items():
        sources = tuple(value if isinstance(value, list) else [value])
        spec_key = f"data.columns.{name}"
        width, integers, tensor = 0, True, None
        for column in sources:
            if column not in schema.names:
                near = difflib.get_close_matches(column, schema.names, 1)
                raise SpecError(f"{source}: {spec_key}: {column!r} is not a column of {where!r}"
                                + (f"; did you mean {near[0]!r}?" if near else "")
                                + f" (columns: {', '.join(schema.names)[:300]})")
            t = schema.field(column).type
            if isinstance(t, pa.FixedShapeTensorType):  # an Arrow tensor: its shape per row
                tensor, t = tuple(t.shape), t.storage_type
            values = t.value_type if pa_list(t) else t
            if not (pa.types.is_integer(values) or pa.types.is_floating(values)
                    or pa.types.is_boolean(values)):
                raise SpecError(f"{source}: {spec_key}: {column!r} holds {t}; the task reads "
                                "numbers, lists of numbers or Arrow tensors")
            integers = integers and not pa.types.is_floating(values)
            if name in d.pad:
                if len(sources) > 1 or not pa_list(t) or pa.types.is_fixed_size_list(t):
                    raise SpecError(f"{source}: data.pad.{name}: pads one column of lists of "
                                    f"any length; {', '.join(sources)} is not one")
                width += d.pad[name]
            else:
                width += (t.list_size if pa.types.is_fixed_size_list(t)
                          else _first_length(manifest, column) if pa_list(t) else 1)
        scalar = len(sources) == 1 and not pa_list(t)
        if tensor is not None and len(sources) > 1:
            tensor = None  # tensors concatenated with other columns: flat features
        high = None
        if spec.task == "classification" and name == "label":
            if not (scalar and integers):
                raise SpecError(f"{source}: {spec_key}: classification needs one integer class "
                                f"per row; {', '.join(sources)} is not")
            high = spec.model.options.get("classes") if spec.model.name == "classifier" else None
        # integers stay integers (token ids for a transformer); the classifier model reads
        # integer features as floats
        dtype = "int64" if integers else "float32"
        shape = () if scalar else tensor or (width,)
        fields.append(Field(name, sources, shape, dtype, high, spec_key, padded=name in d.pad))
    if spec.model.name == "classifier" and "inputs" in d.columns:
        features = next(f for f in fields if f.name == "inputs").shape or (1,)
        if features[0] != spec.model.options.get("inputs"):
            raise SpecError(f"{source}: model.options.inputs: {spec.model.options.get('inputs')} "
                            f"does not fit the data; data.columns.inputs gives {features[0]} "
                            f"values a row, so set model.options.inputs: {features[0]}")
    found = Columns(tuple(fields), d.id_column)
    check_footers(manifest, found, schema, source, where)
    return found


def _document_end(spec: JobSpec, source: str, key: str, where: str) -> Optional[int]:
    """The token after which a document of the corpus at `where` ends, where the job masks
    attention between documents (data.document_mask): data.eod_token, or the one
    `baton data prepare` recorded in the corpus's _corpus.json."""
    d = spec.data
    if not d.document_mask or d.eod_token is not None:
        return d.eod_token if d.document_mask else None
    from baton.data.text import tokenised_by

    eod = (tokenised_by(where) or {}).get("eod_token")
    if eod is None:
        raise SpecError(f"{source}: data.document_mask: {key} {where!r} does not say where its "
                        "documents end (it has no _corpus.json of baton data prepare); set "
                        "data.eod_token to its end-of-document token id")
    return int(eod)


def columns(spec: JobSpec) -> Columns:
    """A language model's columns, from the spec alone (no schema to read)."""
    d = spec.data
    return token_columns(d.token_column, d.id_column, spec.model.seq_len + 1, spec.model.vocab_size,
                         d.loss_mask_column)


def pa_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_large_list(t)


def _first_length(manifest: Manifest, column: str) -> int:
    """Values in the first row of a list column: the first row of the first row group, read
    alone (a dataset scan (head) reads ahead through whole files, hundreds of MB of a corpus)."""
    fs = storage.resolve(manifest.root)[0]
    unit = next(u for u in manifest.units if u.rows)
    with fs.open_input_file(unit.file) as f:
        first = pq.ParquetFile(f).read_row_group(unit.row_group, columns=[column]).column(0)
    return len(first[0].values) if first[0].is_valid else 0
