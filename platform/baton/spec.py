"""The job spec: one typed tree, loaded strictly from YAML.

Every default lives here. A mistake (unknown key, wrong type, impossible value or combination)
raises one `SpecError` whose message names the file, the key path, the value and what would be
valid, before any Ray work starts and before anything is written. This module reads the tree
(keys, types, YAML, overrides); `spec_checks.py` checks its values and combinations.
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
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from baton.errors import SpecError
from baton.spec_checks import MOST, MOST_INT, check_values
from baton.spec_checks import show as _show


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
    # a cluster with an autoscaler and too little room now (scaled to zero): how long the
    # start waits for the nodes it asked for before refusing the job
    wait_for_nodes_s: float = 600.0


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
    # warm standby workers kept in room the job cannot grow into: a lost worker is replaced in
    # well under a second instead of the seconds a new process takes; each holds a worker's
    # CPUs and GPUs while it waits
    spares: int = 0


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
    check_values(spec, source, one_world)
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
    if _flow_depth(text) > 4 * MAX_DEPTH:  # before PyYAML's recursion spends a second on it
        raise SpecError(f"{where}the YAML is nested too deeply")
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


def _flow_depth(text: str) -> int:
    """How deep `[` and `{` nest in `text`, quotes and comments skipped (roughly: a lone `'`
    or `#` in a plain value hides the rest of it, so deep nesting may go unseen here and end
    in PyYAML's RecursionError, with the same message). PyYAML parses nesting by recursion:
    5,000 levels took 0.6 s to end in a RecursionError on a 2-core machine, and more than the
    1-s budget of validation while the machine was busy (a flaky test, found this way)."""
    depth = most = 0
    quote = None
    comment = False
    for ch in text:
        if comment:
            comment = ch != "\n"
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#":
            comment = True
        elif ch in "[{":
            depth += 1
            most = max(most, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return most


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

