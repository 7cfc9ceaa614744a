"""The job spec: one typed tree, loaded strictly from YAML.

Every default lives here. A mistake (unknown key, wrong type, impossible value or combination)
raises one `SpecError` whose message names the file, the key path, the value and what would be
valid, before any Ray work starts and before anything is written.
"""

from __future__ import annotations

import dataclasses
import copy
import difflib
import functools
import hashlib
import json
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from baton.errors import SpecError


@dataclass(frozen=True)
class ModelSpec:
    name: str = "gpt"  # gpt, mlp, classifier, "hf:TYPE" or "package.module:function"
    layers: int = 4  # transformer blocks (gpt) or hidden layers (mlp)
    width: int = 128  # embedding width (gpt) or hidden width (mlp)
    heads: int = 4  # attention heads (gpt only)
    seq_len: int = 128  # tokens of context the model sees per sample
    vocab_size: int = 256
    context: int = 8  # previous tokens an MLP position sees (mlp only)
    dropout: float = 0.0
    options: dict = field(default_factory=dict)  # passed to a user builder as keyword arguments
    config: dict = field(default_factory=dict)  # hf: models: the transformers configuration
    init_from: Optional[str] = None  # hf: models: a local save_pretrained folder's weights


@dataclass(frozen=True)
class DataSpec:
    # stdlib and digits: built-in data, prepared into data.path on first run
    source: Literal["stdlib", "digits", "parquet"] = "stdlib"
    path: str = "data/stdlib"  # local folder or a pyarrow filesystem URI (s3://, gs://)
    token_column: str = "tokens"  # what a language model reads
    # what other tasks read: batch key -> a Parquet column, or a list of them concatenated
    # (inputs: [pixels] and label: label for classification; any keys for a user's task)
    columns: dict = field(default_factory=dict)
    # batch key -> N: that column holds lists of any length up to N, padded with 0, and the
    # batch gets KEY_mask (True on the values)
    pad: dict = field(default_factory=dict)
    id_column: Optional[str] = "sample_id"  # null: the row's position in the dataset is its id
    # samples shuffled together: row groups are permuted, then samples shuffled within blocks
    # of this many (a corpus this small or smaller gets a full permutation). Ray Data holds
    # about two blocks' row groups in the object store at a time
    shuffle_block: int = 262_144


@dataclass(frozen=True)
class Every:
    every: int  # every this many blocks


@dataclass(frozen=True)
class TrainSpec:
    steps: int = 100
    global_batch: int = 32  # samples per optimizer step, across all replicas
    # samples per forward/backward on one replica; null: from parallel.microbatches, else the
    # largest divisor of global_batch / dp up to 8 (see JobSpec.micro_batch)
    micro_batch: Optional[int] = None
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # 0 turns clipping off
    seed: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast matmuls; weights stay fp32
    # lamb: AdamW's direction scaled per tensor by ||x|| / ||update|| (large batches)
    optimizer: Literal["adamw", "lamb"] = "adamw"
    # recompute activations in the backward instead of keeping them: none | blocks (every
    # repeated block) | {every: N} (every Nth): memory for time, the same gradients
    activation_checkpointing: Union[Literal["none", "blocks"], Every] = "none"
    # torch.compile each block (in place: names, checkpoints and parallelism unchanged);
    # compiling is paid at the first step of each new worker process (less from the cache)
    compile: bool = False


@dataclass(frozen=True)
class ParallelSpec:
    dp: int = 1
    pp: int = 1  # pipeline stages: the model's layers are cut into pp contiguous runs
    schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    microbatches: Optional[int] = None  # per replica per step; null: from train.micro_batch
    chunks: Optional[int] = None  # model chunks per pipeline rank (interleaved-1f1b: default 2)
    partition: Union[Literal["params", "time"], list[int]] = "params"  # or layers per stage
    timeout_s: float = 120.0  # collective timeout: a dead peer surfaces after at most this
    # ZeRO level: none (DDP: whole replicas) | optimizer (ZeRO-1) | grads (ZeRO-2) | full (ZeRO-3)
    shard: Literal["none", "optimizer", "grads", "full"] = "none"
    # hybrid: shard within groups of this many replicas, replicate across the groups (so a
    # lost worker's shard survives in another group); null: shard across all of dp
    shard_group: Optional[int] = None
    # FSDP (grads, full) gathers consecutive blocks together until they hold this many MiB of
    # fp32 parameters: fewer, larger collectives for small blocks; 0: every block alone
    shard_unit_mib: float = 16.0
    # what replicas send each other: fp32 | bf16 (half the bytes) | powersgd (low-rank, DDP)
    grad_comm: Literal["fp32", "bf16", "powersgd"] = "fp32"


@dataclass(frozen=True)
class ResourcesSpec:
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement: Literal["pack", "spread"] = "pack"
    threads_per_worker: int = 1  # torch intra-op threads in each worker


@dataclass(frozen=True)
class CheckpointSpec:
    path: str = "checkpoints"  # local folder or a pyarrow filesystem URI; the job name is appended
    every_steps: int = 50
    keep: int = 2
    timeout_s: float = 600.0  # a save or load (a slow store is slow, not failed: not parallel.timeout_s)
    # `async` in a job file (a Python keyword): write checkpoints on a thread of each worker
    # while training goes on, from a copy of the state taken between two steps
    async_: bool = field(default=False, metadata={"key": "async"})


@dataclass(frozen=True)
class TrackingSpec:
    enabled: bool = True
    uri: Optional[str] = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd
    experiment: str = "baton"
    flush_every_s: float = 30.0  # metrics are also flushed at every checkpoint commit
    trace_step: Optional[int] = None  # step whose pipeline timeline is saved; null: min(10, steps)
    cpu_peak_tflops: Optional[float] = None  # a CPU worker's peak, for MFU; null: no MFU on CPU


@dataclass(frozen=True)
class EvalSpec:
    """Held-out evaluation: the task's loss and metrics, logged as eval_*. On when fraction > 0
    or path is set."""

    every_steps: int = 0  # 0: at the end only
    # row groups of data.path held out, chosen by eval.seed: never trained on
    fraction: float = 0.0
    path: Optional[str] = None  # or a dataset of its own (same columns)
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.fraction > 0 or self.path is not None


@dataclass(frozen=True)
class ElasticSpec:
    """How the run lives through failures and a changing cluster. Without this section the
    world is fixed at parallel.dp and the first failure ends the run."""

    min_dp: Optional[int] = None  # fewest data-parallel replicas to go on with; null: parallel.dp
    max_dp: Optional[int] = None  # most replicas to grow to when resources appear; null: parallel.dp
    max_failures: int = 0  # failures recovered from before the run gives up
    rescale_check_s: float = 10.0  # how often a running job looks for room to grow
    hang_timeout_s: float = 60.0  # a worker that answers no heartbeat this long is declared dead


@dataclass(frozen=True)
class JobSpec:
    name: str
    # what a batch is for: language_model | classification | "package.module:function"
    task: str = "language_model"
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    tracking: TrackingSpec = field(default_factory=TrackingSpec)
    elastic: ElasticSpec = field(default_factory=ElasticSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    # when dp changes: keep_global keeps train.global_batch (each replica takes a larger or
    # smaller share, so the loss curve is unchanged); scale_lr keeps each replica's share and
    # scales global_batch and lr with dp
    batch_policy: Literal["keep_global", "scale_lr"] = "keep_global"

    def to_dict(self) -> dict:
        return _as_dict(self)

    def flat(self) -> dict[str, Any]:
        """The spec as dotted keys, e.g. {"train.lr": 0.003}: MLflow params."""
        out: dict[str, Any] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict) and value:
                for k, v in value.items():
                    walk(f"{prefix}.{k}" if prefix else k, v)
            else:
                out[prefix] = value

        walk("", self.to_dict())
        return out

    @property
    def micro_batch(self) -> int:
        """Samples per forward/backward on one replica (one micro-batch)."""
        t, p = self.train, self.parallel
        per_replica = t.global_batch // p.dp
        if t.micro_batch:
            return t.micro_batch
        if p.microbatches:
            return per_replica // p.microbatches
        return max(d for d in range(1, min(8, per_replica) + 1) if per_replica % d == 0)

    @property
    def microbatches(self) -> int:
        """Micro-batches per replica per step (the pipeline's m)."""
        return self.train.global_batch // (self.parallel.dp * self.micro_batch)

    @property
    def dp_shard(self) -> int:
        """Replicas that split one copy of the state (1: unsharded)."""
        p = self.parallel
        return 1 if p.shard == "none" else (p.shard_group or p.dp)

    def dims(self):
        """This job's rank arithmetic (`baton.parallel.ParallelDims`)."""
        from baton.parallel import ParallelDims

        return ParallelDims(self.parallel.dp, self.parallel.pp, self.dp_shard)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (the interleaved schedule's v)."""
        p = self.parallel
        return p.chunks or (2 if p.schedule == "interleaved-1f1b" else 1)

    def recipe(self) -> dict:
        """What makes a checkpoint belong to this job: its name, model, data and optimisation
        recipe. Steps, layout (including micro-batching), resources, checkpointing and tracking
        may change on resume."""
        d = self.to_dict()
        train = {k: v for k, v in d["train"].items()
                 if k not in ("steps", "micro_batch", "activation_checkpointing", "compile")
                 and not (k == "optimizer" and v == "adamw")}  # (v0.7's recipes had none)
        data = {k: v for k, v in d["data"].items() if k not in ("columns", "pad") or v}
        # the task and the held-out split only where set: v0.5's checkpoints keep their recipe
        extra = {**({"task": self.task} if self.task != "language_model" else {}),
                 **({"eval": {"fraction": self.eval.fraction, "seed": self.eval.seed}}
                    if self.eval.fraction else {})}
        return {"name": d["name"], "model": d["model"], "data": data, "train": train, **extra}

    def fingerprint(self) -> str:
        """The recipe's hash, without the credentials of its URIs (as the checkpoint records
        the recipe): a rotated key resumes the same job."""
        from baton.storage import redact

        return hashlib.sha256(json.dumps(redact(self.recipe()), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def checkpoint_dir(self) -> str:
        return join_path(self.checkpoint.path, self.name)

    @property
    def dp_range(self) -> tuple[int, int]:
        e, dp = self.elastic, self.parallel.dp
        return (e.min_dp or dp, e.max_dp or dp)

    def at_dp(self, dp: int) -> "JobSpec":
        """This job at `dp` replicas, under batch_policy. Raises SpecError if the batch cannot
        be split that way (e.g. global_batch not divisible by dp under keep_global)."""
        if dp == self.parallel.dp:
            return self
        raw = self.to_dict()
        raw["parallel"]["dp"] = dp
        raw["elastic"].update(min_dp=None, max_dp=None)  # one world of the elastic job
        if self.batch_policy == "scale_lr":
            per_replica = self.train.global_batch // self.parallel.dp
            raw["train"]["global_batch"] = per_replica * dp
            for key in ("lr", "min_lr"):
                raw["train"][key] = getattr(self.train, key) * dp / self.parallel.dp
        return spec_from_dict(raw, f"{self.name} at dp={dp}", one_world=True)

    def valid_dps(self) -> list[int]:
        """The replica counts in [min_dp, max_dp] that this job's batch can be split into.

        Not a spec built per dp (max_dp may be 65,536): a world differs from the job only in
        dp, its global batch, its micro-batching and its learning rate. The candidates are the
        dps that split the global batch and hold whole shard groups; under keep_global each
        is checked in full (they divide global_batch: a few hundred at most), under scale_lr
        the smallest and the largest (each replica keeps the job's share and micro-batches,
        so the others differ from these two only in a global batch and a learning rate
        between theirs)."""
        lo, hi = self.dp_range
        t, p = self.train, self.parallel
        keep = self.batch_policy == "keep_global"
        share = t.global_batch // p.dp
        candidates = [dp for dp in (_divisors(t.global_batch, lo, hi) if keep else range(lo, hi + 1))
                      if not (p.shard_group and dp % p.shard_group)
                      and (keep or (share * dp <= MOST["train.global_batch"][0]
                                    and math.isfinite(t.lr * dp / p.dp)))]
        ends = sorted({*candidates[:1], *candidates[-1:]})
        if keep or not all(self._splits_at(dp) for dp in ends):
            return [dp for dp in candidates if self._splits_at(dp)]  # (scale_lr: unforeseen)
        return candidates

    def _splits_at(self, dp: int) -> bool:
        try:
            self.at_dp(dp)
            return True
        except SpecError:
            return False


def _divisors(n: int, lo: int, hi: int) -> list[int]:
    """The divisors of n in [lo, hi], ascending (n at most 2^24: 4,096 trial divisions)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({x for d in small for x in (d, n // d) if lo <= x <= hi})


def join_path(base: str, *parts: str) -> str:
    """Join path parts for local paths and URIs alike (URIs always use '/', and keep their
    query, e.g. s3://bucket/ckpt?endpoint_override=HOST:PORT, after the joined path)."""
    if "://" not in base:
        return str(Path(base, *parts))
    path, sep, query = base.partition("?")
    return "/".join([path.rstrip("/"), *parts]) + sep + query


# ---------------------------------------------------------------------------------------------
# Loading


def load_spec(path: str | os.PathLike, overrides: list[str] = ()) -> JobSpec:
    """Load and validate a job file; `overrides` are "key.path=value" strings (YAML values)."""
    source = str(path)
    if not source.isprintable() or len(source) > 200:  # the message stays one readable line
        source = _show(source, 200)
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the path
        raise SpecError(f"{source}: cannot read the job file "
                        f"({getattr(e, 'strerror', None) or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{source}: the job file is not UTF-8 text (byte {e.start} is "
                        f"{data[e.start]:#04x})") from None
    raw = _yaml(text, f"{source}: ")
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: the top level must be a mapping of sections, got {_kind(raw)}")
    for item in overrides:
        _apply_override(raw, item, source)
    return spec_from_dict(raw, source)


def spec_from_dict(raw: dict, source: str = "<spec>", one_world: bool = False) -> JobSpec:
    """`one_world`: one world size of an elastic job (`JobSpec.at_dp`), which may be smaller
    than the job as written allows on its own (a sharded job shrunk to one replica)."""
    _check_tree(raw, f"{source}: ")
    spec = _build(JobSpec, raw, "", source)
    _check_values(spec, source, one_world)
    return spec


def _apply_override(raw: dict, item: str, source: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SpecError(f"{source}: override {item!r} must look like key.path=value")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SpecError(f"{source}: override {item!r}: {part} is not a section")
    node[parts[-1]] = _yaml(value, f"{source}: override {_show(item)}: ")


def _yaml(text: str, where: str) -> Any:
    """YAML text as plain data (safe_load: no tags that build objects), checked by _check_tree."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise SpecError(f"{where}not valid YAML{at}: {problem}") from None
    except RecursionError:
        raise SpecError(f"{where}the YAML is nested too deeply") from None
    _check_tree(value, where)
    return value


MAX_DEPTH = 16  # a job file is 3 levels deep; model.options may nest a little further


def _check_tree(value: Any, where: str) -> None:
    """Plain data a spec can be read from: mappings keyed by text, no deeper than MAX_DEPTH,
    no recursive aliases (`&a [*a]` loads as a list holding itself). Iterative: no recursion
    for hostile input to exhaust."""
    stack = [(value, "", 0, ())]
    while stack:
        node, path, depth, above = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        at = path or "the top level"
        if id(node) in above:
            raise SpecError(f"{where}{at}: a recursive alias (a value that contains itself)")
        if depth >= MAX_DEPTH:
            raise SpecError(f"{where}{at}: nested more than {MAX_DEPTH} levels deep")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(node, dict) and not isinstance(key, str):
                raise SpecError(f"{where}{at}: the key {_show(key)} ({_kind(key)}) must be text")
            if isinstance(node, list):
                name = f"{path}[{key}]"
            else:
                name = f"{path}.{key}" if path else key
            stack.append((child, name, depth + 1, above + (id(node),)))


def _show(value: Any, most: int = 80) -> str:
    """A value for a one-line message: huge integers by their size (their digits can take
    seconds to print, and Python refuses past 4,300), long text cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= most else f"{text[:most - 20]}... ({len(text)} characters)"


def _kind(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: {where}: expected a mapping, got {_kind(raw)} {_show(raw)}")
    hints = _hints(cls)
    fields = {_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))  # all text: _check_tree saw the keys first
    if unknown:
        key = unknown[0] if len(unknown[0]) <= 80 else _show(unknown[0])
        close = difflib.get_close_matches(unknown[0], fields, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
        raise SpecError(f"{source}: {prefix}{key}: unknown key; {fix}")
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[f.name] = _coerce(hints[f.name], raw[name], f"{prefix}{name}", source)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SpecError(f"{source}: {prefix}{name}: required key is missing")
    return cls(**values)


def _key(f: dataclasses.Field) -> str:
    """A field's key in a job file (its name, unless that is a Python keyword)."""
    return f.metadata.get("key", f.name)


def _as_dict(value: Any) -> Any:
    """A spec (or a section) as the job file's keys and plain values."""
    if dataclasses.is_dataclass(value):
        return {_key(f): _as_dict(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(_as_dict(v) for v in value)
    if isinstance(value, dict):
        return {k: _as_dict(v) for k, v in value.items()}
    return copy.deepcopy(value)


_hints = functools.cache(typing.get_type_hints)  # 3/4 of the time of building a spec, uncached


def _coerce(tp: Any, value: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".", source)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return _coerce(options[0], value, key, source)
        # several shapes (a name, a list, a mapping): the one whose container type matches
        def shape(option):
            if typing.get_origin(option) is list:
                return list
            return dict if dataclasses.is_dataclass(option) or option is dict else None

        mine = list if isinstance(value, list) else dict if isinstance(value, dict) else None
        for option in options:
            if shape(option) is mine:
                return _coerce(option, value, key, source)
        raise SpecError(f"{source}: {key}: unexpected {_kind(value)} {_show(value)}")
    if origin is Literal:
        if value not in args:
            choices = " | ".join(map(str, args))
            raise SpecError(f"{source}: {key}: {_show(value)} is not one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise SpecError(f"{source}: {key}: expected a list, got {_kind(value)} {_show(value)}")
        return [_coerce(args[0], v, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise SpecError(f"{source}: {key}: expected a mapping, got {_kind(value)} {_show(value)}")
        return value
    if tp is float and not isinstance(value, bool):
        number = value
        try:  # YAML 1.1 reads "3e-4" (no dot) as a string
            if isinstance(value, (int, str)):
                number = float(value)
        except OverflowError:
            raise SpecError(f"{source}: {key}: {_show(value)} is too large for a number") from None
        except ValueError:
            pass
        if isinstance(number, float):
            if not math.isfinite(number):
                raise SpecError(f"{source}: {key}: {_show(value)} is invalid; give a finite number")
            return number
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise SpecError(f"{source}: {key}: expected {_kind(tp())}, got {_kind(value)} {_show(value)}")
    if tp is int and abs(value) > MOST_INT:
        raise SpecError(f"{source}: {key}: {_show(value)} is invalid; at most {MOST_INT:,}")
    return value


# ---------------------------------------------------------------------------------------------
# Values and combinations


def _check_values(spec: JobSpec, source: str, one_world: bool = False) -> None:
    def need(ok: bool, key: str, value: Any, fix: str) -> None:
        if not ok:
            raise SpecError(f"{source}: {key}: {_show(value)} is invalid; {fix}")

    m, d, t, p, r, c, tr = (spec.model, spec.data, spec.train, spec.parallel, spec.resources,
                           spec.checkpoint, spec.tracking)
    flat = spec.flat()
    for key, (most, why) in MOST.items():  # first: later checks iterate over some of these
        value = flat[key]
        need(value is None or value <= most, key, value, f"at most {most:,} ({why})")
    need(t.seed >= 0, "train.seed", t.seed, "must be >= 0")
    for key in ("data.path", "checkpoint.path"):
        problem = path_problem(flat[key])
        need(problem is None, key, flat[key], problem or "")
    need(len(tr.experiment) <= 500, "tracking.experiment", tr.experiment, "use at most 500 characters")
    need(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", spec.name)), "name", spec.name,
         "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
    from baton.models import OPTIONS, REQUIRED, check_model_name, options_problem

    problem = check_model_name(m.name)
    need(problem is None, "model.name", m.name, problem or "")
    for key in ("layers", "width", "heads", "seq_len", "vocab_size", "context"):
        need(getattr(m, key) >= 1, f"model.{key}", getattr(m, key), "must be at least 1")
    need(0.0 <= m.dropout < 1.0, "model.dropout", m.dropout, "must be in [0, 1)")
    if m.options or m.name not in OPTIONS or m.name in REQUIRED:  # (after the sizes: a user's builder may run here)
        problem = options_problem(m, on_meta=p.pp > 1 or p.shard in ("grads", "full"))
        need(problem is None, "model.options" if m.options else "model.name",
             m.options if m.options else m.name, problem or "")
    hf = m.name.startswith("hf:")
    need(hf or not m.config, "model.config", m.config, "only hf: models take a configuration; "
         "a builder of your own reads model.options")
    need(hf or m.init_from is None, "model.init_from", m.init_from,
         "only hf: models load weights this way (a local save_pretrained folder)")
    if m.init_from is not None:
        problem = path_problem(m.init_from)
        need(problem is None, "model.init_from", m.init_from, problem or "")
    need(not hf or p.pp == 1, "parallel.pp", p.pp, "hf: models are not an nn.Sequential of "
         "layers to cut into stages; use pp: 1 (data parallel or sharded)")
    if m.name == "gpt" and m.width % m.heads:  # (the hint is only worked out when needed)
        near = _divisor_near(m.width, m.heads)
        need(False, "model.heads", m.heads,
             f"must divide model.width ({m.width})" + (f"; try {near}" if near else ""))
    need(bool(d.path), "data.path", d.path, "give a folder or URI of Parquet files")
    need(bool(d.token_column), "data.token_column", d.token_column, "name the token column")
    need(d.shuffle_block >= 1, "data.shuffle_block", d.shuffle_block, "must be at least 1 sample")
    _check_task(spec, need)

    for key in ("steps", "global_batch"):
        need(getattr(t, key) >= 1, f"train.{key}", getattr(t, key), "must be at least 1")
    need(t.micro_batch is None or t.micro_batch >= 1, "train.micro_batch", t.micro_batch,
         "must be at least 1")
    need(t.lr > 0, "train.lr", t.lr, "must be > 0 (e.g. 3e-4)")
    need(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be in [0, train.lr = {t.lr}]")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", t.betas,
         "give two numbers in [0, 1), e.g. [0.9, 0.95]")
    need(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 turns clipping off)")
    ac = t.activation_checkpointing
    need(isinstance(ac, str) or 1 <= ac.every <= MOST["model.layers"][0],
         "train.activation_checkpointing.every", getattr(ac, "every", ac),
         f"must be in [1, {MOST['model.layers'][0]}] blocks")

    need(p.dp >= 1, "parallel.dp", p.dp, "must be at least 1")
    need(p.pp >= 1, "parallel.pp", p.pp, "must be at least 1")
    need(p.dp * p.pp <= MOST_WORKERS, "parallel.dp", p.dp,
         f"dp x pp = {p.dp * p.pp:,} workers; at most {MOST_WORKERS:,}")
    need(p.timeout_s > 0, "parallel.timeout_s", p.timeout_s, "must be > 0 seconds")
    need(p.shard_unit_mib >= 0, "parallel.shard_unit_mib", p.shard_unit_mib, "must be >= 0 MiB")
    need(p.grad_comm != "powersgd" or (p.pp == 1 and p.shard in ("none", "optimizer")),
         "parallel.grad_comm", p.grad_comm, "PowerSGD runs through DDP's communication hook: "
         "use it with parallel.shard none or optimizer and pp 1 (bf16 works everywhere)")
    _check_batching(spec, need)
    if p.shard != "none" or p.shard_group is not None:
        _check_sharding(spec, need, one_world)
    if p.pp > 1 or p.schedule == "interleaved-1f1b" or p.chunks or p.partition != "params":
        _check_pipeline(spec, source, need)

    need(r.cpus_per_worker > 0, "resources.cpus_per_worker", r.cpus_per_worker, "must be > 0")
    need(r.gpus_per_worker >= 0, "resources.gpus_per_worker", r.gpus_per_worker, "must be >= 0")
    need(r.threads_per_worker >= 1, "resources.threads_per_worker", r.threads_per_worker,
         "must be at least 1")

    need(bool(c.path), "checkpoint.path", c.path, "give a folder or URI")
    need(c.every_steps >= 1, "checkpoint.every_steps", c.every_steps, "must be at least 1")
    need(c.keep >= 1, "checkpoint.keep", c.keep, "must be at least 1")
    need(c.timeout_s > 0, "checkpoint.timeout_s", c.timeout_s, "must be > 0 seconds")
    need(tr.flush_every_s > 0, "tracking.flush_every_s", tr.flush_every_s, "must be > 0")
    need(bool(tr.experiment), "tracking.experiment", tr.experiment, "name an MLflow experiment")
    need(tr.cpu_peak_tflops is None or tr.cpu_peak_tflops > 0, "tracking.cpu_peak_tflops",
         tr.cpu_peak_tflops, "must be > 0 (or null: no MFU on CPU)")
    _check_elastic(spec, need)


MOST_INT = 2**63 - 1  # what a 64-bit integer holds: every count and size, before its own bound
_SECONDS = (10**7, "about 16 weeks")
# The most of every size: what any machine or cluster baton plans for can hold. Checked before
# anything is built or iterated (a model.width of 10^12 + 1 once took minutes to refuse, an
# elastic.max_dp of 10^7 built ten million specs).
MOST: dict[str, tuple[float, str]] = {
    "model.layers": (512, "a model built to check it takes about 1.5 ms a layer"),
    "model.width": (2**17, "16 times GPT-3's"),
    "model.heads": (2**12, "attention heads"),
    "model.seq_len": (2**20, "tokens of context"),
    "model.vocab_size": (2**24, "token ids"),
    "model.context": (2**20, "tokens an MLP position sees"),
    "data.shuffle_block": (2**40, "samples"),
    "train.steps": (10**12, "steps"),
    "train.global_batch": (2**24, "samples a step"),
    "train.micro_batch": (2**24, "samples"),
    "train.warmup_steps": (10**12, "steps"),
    "train.seed": (2**32 - 1, "a 32-bit seed"),
    "parallel.dp": (2**16, "replicas"),
    "parallel.pp": (2**10, "pipeline stages"),
    "parallel.microbatches": (2**17, "micro-batches a step"),
    "parallel.chunks": (2**10, "chunks a pipeline rank"),
    "parallel.shard_group": (2**16, "replicas"),
    "parallel.shard_unit_mib": (2**20, "MiB"),
    "parallel.timeout_s": _SECONDS,
    "resources.cpus_per_worker": (2**10, "CPUs"),
    "resources.gpus_per_worker": (64, "GPUs on one node"),
    "resources.threads_per_worker": (2**10, "threads"),
    "checkpoint.every_steps": (10**12, "steps"),
    "checkpoint.keep": (10**6, "checkpoints"),
    "checkpoint.timeout_s": _SECONDS,
    "tracking.flush_every_s": _SECONDS,
    "tracking.trace_step": (10**12, "steps"),
    "tracking.cpu_peak_tflops": (10**6, "TFLOP/s"),
    "elastic.min_dp": (2**16, "replicas"),
    "elastic.max_dp": (2**16, "replicas"),
    "elastic.max_failures": (10**6, "failures"),
    "elastic.rescale_check_s": _SECONDS,
    "elastic.hang_timeout_s": _SECONDS,
    "eval.every_steps": (10**12, "steps"),
    "eval.seed": (2**32 - 1, "a 32-bit seed"),
}
MOST_WORKERS = 2**16  # replicas x pipeline stages
MOST_PASSES = 2**16  # micro-batches x pipeline stages of one step: a schedule is built from them
_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "file")


def path_problem(path: str) -> Optional[str]:
    """Why `path` cannot name a folder or a URI (None: it can), without touching it."""
    if "\x00" in path:
        return "contains a NUL character"
    if len(path.encode()) > 4096:
        return "longer than any file system allows (4,096 bytes)"
    scheme, sep, rest = path.partition("://")
    if sep and scheme not in _SCHEMES:
        return f"unknown scheme {scheme!r}; use a local path or one of {', '.join(_SCHEMES)}"
    too_long = [part for part in (rest if sep else path).split("/") if len(part.encode()) > 255]
    if too_long:
        return f"a name in it is longer than file systems allow (255 bytes): {_show(too_long[0], 40)}"
    return None


def _check_task(spec: JobSpec, need) -> None:
    from baton.tasks import make_task, task_problem

    d, e = spec.data, spec.eval
    problem = task_problem(spec.task)
    need(problem is None, "task", spec.task, problem or "")
    for key, value in d.columns.items():
        names = value if isinstance(value, list) else [value]
        need(bool(re.fullmatch(r"[A-Za-z_]\w{0,62}", key)) and key != "valid", f"data.columns.{key}",
             key, "name a batch entry with a Python identifier other than 'valid'")
        need(bool(names) and all(isinstance(n, str) and n and len(n) <= 255 for n in names),
             f"data.columns.{key}", value, "give a column name or a list of column names")
    for key, most in d.pad.items():
        need(key in d.columns, f"data.pad.{key}", most, f"pads a key of data.columns "
             f"({', '.join(d.columns) or 'none given'})")
        need(isinstance(most, int) and not isinstance(most, bool) and 1 <= most <= 2**20,
             f"data.pad.{key}", most, "give the most values a row holds, 1 to 1,048,576")
    if spec.task == "language_model":
        need(not d.columns, "data.columns", d.columns, "a language model reads "
             "data.token_column; data.columns is for task: classification or a task of your own")
    else:
        need(d.source != "stdlib", "data.source", d.source, f"the built-in corpus is token rows "
             f"for a language model; task {spec.task} needs data.source: parquet (or digits)")
        missing = [k for k in make_task(spec).needs if k not in d.columns]
        need(not missing, "data.columns", d.columns,
             f"task {spec.task} reads {' and '.join(missing)}: map "
             + ", ".join(f"{k}: COLUMN" for k in missing) + " (e.g. inputs: [pixels], label: label)")
    need(e.every_steps >= 0, "eval.every_steps", e.every_steps, "must be >= 0 (0: at the end only)")
    need(0 <= e.fraction < 1, "eval.fraction", e.fraction, "must be in [0, 1), e.g. 0.1")
    need(not (e.fraction and e.path), "eval.path", e.path,
         "give eval.fraction (held out of data.path) or eval.path (a dataset of its own), not both")
    need(e.seed >= 0, "eval.seed", e.seed, "must be >= 0")
    if e.path is not None:
        problem = path_problem(e.path)
        need(problem is None and bool(e.path), "eval.path", e.path, problem or "give a folder or URI")


def _check_elastic(spec: JobSpec, need) -> None:
    e, dp = spec.elastic, spec.parallel.dp
    lo, hi = spec.dp_range
    need(lo >= 1, "elastic.min_dp", e.min_dp, "must be at least 1")
    need(lo <= dp, "elastic.min_dp", e.min_dp, f"must be <= parallel.dp = {dp}")
    need(hi >= dp, "elastic.max_dp", e.max_dp, f"must be >= parallel.dp = {dp}")
    need(hi * spec.parallel.pp <= MOST_WORKERS, "elastic.max_dp", e.max_dp,
         f"max_dp x pp = {hi * spec.parallel.pp:,} workers; at most {MOST_WORKERS:,}")
    need(e.max_failures >= 0, "elastic.max_failures", e.max_failures, "must be >= 0")
    need(e.rescale_check_s > 0, "elastic.rescale_check_s", e.rescale_check_s, "must be > 0 seconds")
    need(e.hang_timeout_s > 0, "elastic.hang_timeout_s", e.hang_timeout_s, "must be > 0 seconds")
    if lo < hi:
        valid = spec.valid_dps()
        for key, value in (("elastic.min_dp", lo), ("elastic.max_dp", hi)):
            need(value in valid, key, value,
                 f"train.global_batch {spec.train.global_batch} cannot be split over {value} "
                 f"replicas under batch_policy {spec.batch_policy}; dp values that work: "
                 + (f"{valid}" if len(valid) <= 12 else f"{str(valid[:12])[:-1]}, ... ({len(valid)} in all)]"))


def _check_sharding(spec: JobSpec, need, one_world: bool) -> None:
    p = spec.parallel
    need(p.shard != "none", "parallel.shard_group", p.shard_group,
         "hybrid sharding needs a shard level: set parallel.shard to optimizer, grads or full")
    need(one_world or spec.dp_range[1] >= 2, "parallel.shard", p.shard,
         "sharding splits state across replicas and this job has one (parallel.dp and "
         "elastic.max_dp are 1); raise parallel.dp or use shard: none")
    need(p.pp == 1 or p.shard != "optimizer", "parallel.shard", p.shard,
         f"ZeRO-1 inside pipeline stages (parallel.pp = {p.pp}) is not supported (torch's "
         "ZeroRedundancyOptimizer steps through DDP, which pipelines do not use); use grads "
         "or full with pp")
    if p.shard_group is not None:
        need(p.shard_group >= 2, "parallel.shard_group", p.shard_group,
             "must be at least 2 (null shards across all of dp)")
        need(p.dp % p.shard_group == 0, "parallel.shard_group", p.shard_group,
             f"must divide parallel.dp = {p.dp} (hybrid sharding keeps whole groups)")
    if p.shard in ("grads", "full"):
        from baton.models import _on_meta
        from baton.parallel.sharding import wrap_problem

        problem = wrap_problem(_on_meta(spec.model), spec.model.name)
        need(problem is None, "parallel.shard", p.shard, problem or "")


def _check_batching(spec: JobSpec, need) -> None:
    t, p = spec.train, spec.parallel
    need(p.microbatches is None or p.microbatches >= 1, "parallel.microbatches", p.microbatches,
         "must be at least 1")
    need(t.global_batch % p.dp == 0, "train.global_batch", t.global_batch,
         f"must be a multiple of parallel.dp = {p.dp}")
    if t.micro_batch and p.microbatches:
        need(t.micro_batch * p.microbatches * p.dp == t.global_batch, "parallel.microbatches",
             p.microbatches, f"dp x microbatches x train.micro_batch must equal train.global_batch "
             f"({p.dp} x {p.microbatches} x {t.micro_batch} != {t.global_batch}); set only one "
             "of microbatches and micro_batch")
    elif p.microbatches:
        per_replica = t.global_batch // p.dp
        need(per_replica % p.microbatches == 0, "parallel.microbatches", p.microbatches,
             f"must divide the {per_replica} samples each replica gets per step "
             f"(train.global_batch / parallel.dp)")
    per_step = p.dp * spec.micro_batch
    need(t.global_batch % per_step == 0, "train.global_batch", t.global_batch,
         f"must be a multiple of parallel.dp x train.micro_batch = {p.dp} x {spec.micro_batch} "
         f"= {per_step}; try {max(per_step, round(t.global_batch / per_step) * per_step)}")


def _check_pipeline(spec: JobSpec, source: str, need) -> None:
    from baton.models import layer_count
    from baton.parallel import schedule as sched

    p = spec.parallel
    interleaved = p.schedule == "interleaved-1f1b"
    need(not interleaved or p.pp >= 2, "parallel.schedule", p.schedule,
         "interleaving needs parallel.pp >= 2")
    need(p.chunks is None or p.chunks >= 1, "parallel.chunks", p.chunks, "must be at least 1")
    need(interleaved or spec.chunks == 1, "parallel.chunks", p.chunks,
         f"only interleaved-1f1b runs several chunks per rank; {p.schedule} runs 1")
    stages = p.pp * spec.chunks
    need(spec.microbatches * stages <= MOST_PASSES, "parallel.pp", p.pp,
         f"{spec.microbatches:,} micro-batches x {stages:,} stages a step; at most "
         f"{MOST_PASSES:,} (a step's schedule is built from them): use fewer, larger micro-batches")
    layers = layer_count(spec.model)
    what = f"{p.pp} stages x {spec.chunks} chunks" if spec.chunks > 1 else f"{p.pp} stages"
    need(layers >= stages, "parallel.pp", p.pp,
         f"the model has {layers} layers (model.layers plus embedding and head), fewer than "
         f"{what}; use pp <= {layers // spec.chunks}")
    if isinstance(p.partition, list):
        need(len(p.partition) == stages and all(n >= 1 for n in p.partition)
             and sum(p.partition) == layers, "parallel.partition", p.partition,
             f"give {stages} layer counts, each >= 1, summing to the model's {layers} layers "
             f"(e.g. {_even_split(layers, stages)}), or 'params' or 'time'")
    if spec.resources.gpus_per_worker > 0:
        problem = sched.order_problem(sched.build(p.schedule, p.pp, spec.microbatches,
                                                  spec.chunks), p.pp, spec.chunks)
        need(problem is None, "parallel.microbatches", spec.microbatches,
             f"NCCL matches messages by order and this schedule breaks it ({problem}); "
             f"use a multiple of parallel.pp = {p.pp}")


def _even_split(n: int, parts: int) -> list[int]:
    return [n // parts + (i < n % parts) for i in range(parts)]


def _divisor_near(n: int, k: int, window: int = 100_000) -> Optional[int]:
    """The divisor of n nearest k (the smaller on a tie), looked for within `window` of k:
    None beyond it. Scanning outward from k, not every number up to n: a width of 10^12 + 1
    took minutes to refuse."""
    for i in range(window + 1):
        for d in (k - i, k + i):
            if 1 <= d <= n and n % d == 0:
                return d
    return None


def check_fits(spec: JobSpec, cpus: float, gpus: float, source: str, where: str) -> None:
    """Refuse a layout the cluster cannot place (checked against its total resources)."""
    r, p = spec.resources, spec.parallel
    dp = spec.dp_range[0]  # an elastic job starts with what fits, at least min_dp
    key = "parallel.dp" if dp == p.dp else "elastic.min_dp"
    workers = dp * p.pp
    if workers * r.cpus_per_worker > cpus + 1e-9:
        fit = int(cpus // r.cpus_per_worker)
        raise SpecError(
            f"{source}: {key}: {dp} is invalid; {workers} workers x "
            f"resources.cpus_per_worker {r.cpus_per_worker} need {workers * r.cpus_per_worker:g} "
            f"CPUs but {where} has {cpus:g}; use dp <= {fit // p.pp} or lower cpus_per_worker")
    if r.gpus_per_worker and workers * r.gpus_per_worker > gpus + 1e-9:
        raise SpecError(
            f"{source}: {key}: {dp} is invalid; {workers} workers x "
            f"resources.gpus_per_worker {r.gpus_per_worker} need {workers * r.gpus_per_worker:g} "
            f"GPUs but {where} has {gpus:g}")
