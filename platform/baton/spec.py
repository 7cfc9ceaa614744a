"""The job spec: one typed tree, loaded strictly from YAML.

Every default lives here. A mistake (unknown key, wrong type, impossible value or combination)
raises one `SpecError` whose message names the file, the key path, the value and what would be
valid, before any Ray work starts and before anything is written. This module reads the tree
and its defaults; `spec_yaml.py` reads a job file into it (keys, types, YAML, overrides) and
`spec_checks.py` checks its values and combinations.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

from baton.errors import SpecError
from baton.spec_checks import MOST


@dataclass(frozen=True)
class LoRASpec:
    """model.lora: low-rank adapters trained beside the linear layers `targets` names, the
    rest of the model frozen (models/lora.py)."""

    rank: int = 8  # the adapters' inner width
    alpha: float = 16.0  # an adapter's product is scaled by alpha / rank
    # rank-stabilised LoRA (Kalajdzievski 2023, PEFT's use_rslora): scaled by alpha / sqrt(rank)
    rslora: bool = False
    # the linear layers adapted, by name in the model (shell patterns: "*.qkv", "*.proj")
    targets: list[str] = field(default_factory=lambda: ["*"])
    # parameters trained whole beside them (shell patterns: "*.ln1.*"); model.init_fresh's
    # and init_grow's always are (init_from gave them no values)
    whole: list[str] = field(default_factory=list)
    # dropout on each adapter's input in training (PEFT's lora_dropout: 0.05, 0.1)
    dropout: float = 0.0
    # a PEFT LoRA folder (baton export --adapters, or PEFT's save_pretrained) whose adapters
    # the job starts from, instead of A drawn and B zeros; null: fresh adapters
    init_from: Optional[str] = None


@dataclass(frozen=True)
class ModelSpec:
    name: str = "gpt"  # gpt, llama, mlp, classifier, "hf:TYPE" or "package.module:function"
    layers: int = 4  # transformer blocks (gpt, llama) or hidden layers (mlp)
    width: int = 128  # embedding width (gpt, llama) or hidden width (mlp)
    heads: int = 4  # attention heads (gpt, llama)
    seq_len: int = 128  # tokens of context the model sees per sample
    vocab_size: int = 256
    context: int = 8  # previous tokens an MLP position sees (mlp only)
    dropout: float = 0.0
    options: dict = field(default_factory=dict)  # passed to a user builder as keyword arguments
    config: dict = field(default_factory=dict)  # hf: models: the transformers configuration
    # the weights to start from: a `baton export` folder (any model whose parameters it
    # names; hf: models also take any local save_pretrained folder)
    init_from: Optional[str] = None
    # parameters (by name, shell patterns: "5.*", "*.lm.weight") that keep their
    # initialization instead of init_from's values: a new head on a pretrained backbone
    init_fresh: list[str] = field(default_factory=list)
    # parameters whose first dimension grew (tokens added at a vocabulary's end: "0.tok.weight",
    # "*.lm.weight"): init_from's rows fill their first rows, the rest keep their initialization
    init_grow: list[str] = field(default_factory=list)
    # parameters that do not train (shell patterns: ["0.*", "1.*"]; ["*"] with init_fresh: a
    # new head trained on a frozen backbone); init_fresh's and init_grow's always train
    frozen: list[str] = field(default_factory=list)
    # low-rank adapters (LoRA) trained in place of the whole model; null: the whole trains
    lora: Optional[LoRASpec] = None

    @property
    def partly_frozen(self) -> bool:
        """Whether some of the model's own parameters do not train (models/frozen.py)."""
        return self.lora is not None or bool(self.frozen)


@dataclass(frozen=True)
class MixSource:
    path: str  # a Parquet dataset, as data.path
    weight: float = 1.0  # its share of the samples: weight / the sum of the weights
    # its held-out metrics' suffix under eval.fraction (eval_loss/NAME); null: the folder's name
    name: Optional[str] = None

    @property
    def label(self) -> str:
        return self.name or re.sub(r"[^A-Za-z0-9_.-]", "_", self.path.rstrip("/").rsplit("/", 1)[-1]
                                   .split("?", 1)[0]) or "source"


@dataclass(frozen=True)
class MixPhase:
    """data.mix's weights from a step on (an annealing phase on other proportions)."""
    after_step: int  # they hold for the steps after this one (step after_step + 1 on)
    weights: list[float]  # one per data.mix source, in its order; 0: none of that source's samples


@dataclass(frozen=True)
class DataSpec:
    # stdlib and digits: built-in data, prepared into data.path on first run
    source: Literal["stdlib", "digits", "parquet"] = "stdlib"
    path: str = "data/stdlib"  # local folder or a pyarrow filesystem URI (s3://, gs://)
    token_column: str = "tokens"  # what a language model reads
    # a language model's targets: a column of seq_len + 1 values a row, beside the tokens, 1
    # where a token is one to predict (a response's), 0 where not (a prompt's, padding): the
    # loss is the mean over the batch's targets (null: every token but a row's first is one)
    loss_mask_column: Optional[str] = None
    # documents packed into a row attend each to itself alone, positions counted from each
    # document's start (models/documents.py); where a document ends: after each eod_token
    # (null: the one the corpus's _corpus.json records, `baton data prepare`'s)
    document_mask: bool = False
    eod_token: Optional[int] = None
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
    # where row groups are read: spread over the cluster's nodes (Ray Data's default), or all
    # on the driver's node (data only that node can see: a folder on its own disk)
    read: Literal["spread", "driver"] = "spread"
    # several Parquet datasets trained on as one stream, each sample drawn from a source in
    # proportion to its weight (data.path is then not read): [{path: web, weight: 3}, ...]
    mix: list[MixSource] = field(default_factory=list)
    # the mix's weights from steps on: [{after_step: 900, weights: [1, 9]}, ...] (the schedule
    # starts again at each, as a resume with --rebase-data onto new weights does)
    mix_phases: list[MixPhase] = field(default_factory=list)
    # training row groups whose rows are found bad as they are read (a NaN, a null, an
    # undecodable page) that are skipped, their rows not trained, before the run stops (on a
    # checkpoint of the step reached); 0: the first stops it
    skip_bad_row_groups: int = 0

    @property
    def paths(self) -> list[str]:
        """The datasets training reads: the mix's, or data.path."""
        return [m.path for m in self.mix] or [self.path]


@dataclass(frozen=True)
class Every:
    every: int  # every this many blocks


@dataclass(frozen=True)
class SpikeRewind:
    """train.rewind_on_spike: a step whose loss is above `factor` times the median of the
    `window` steps before it (or is not a number) sends the run back to its newest checkpoint,
    the batches from there to the spike skipped; at most `most` times a run."""

    factor: float = 3.0
    window: int = 20
    most: int = 3


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
    # after the warm-up: cosine or linear to min_lr at the last step; constant; or wsd
    # (warmup-stable-decay): lr until the last decay_steps, then down to min_lr as 1 - sqrt
    schedule: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    decay_steps: Optional[int] = None  # wsd's decay; null: the last fifth of train.steps
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = 1.0  # 0 turns clipping off
    # steps in a row whose gradient is not finite (a NaN or an infinity: a bad batch, a
    # spike) that are skipped, their update not applied, before the run fails; 0: the first
    # such step fails it (its last checkpoint kept)
    skip_nonfinite: int = 0
    # a loss spike (PaLM's remedy, Chowdhery et al. 2022): back to the newest checkpoint and
    # on past the batches from there to the spike; null: a spike trains on
    rewind_on_spike: Optional[SpikeRewind] = None
    seed: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"  # bf16: autocast matmuls; weights stay fp32
    # lamb: AdamW's direction scaled per tensor by ||x|| / ||update|| (large batches)
    optimizer: Literal["adamw", "lamb"] = "adamw"
    # an exponential moving average of the trained weights, kept beside the optimizer's own
    # state (sharded, checkpointed and resharded as it is): ema = decay ema + (1 - decay) w
    # after each step, from the weights the first step starts from; null: none
    ema: Optional[float] = None
    # recompute activations in the backward instead of keeping them: none | blocks (every
    # repeated block) | {every: N} (every Nth): memory for time, the same gradients
    activation_checkpointing: Union[Literal["none", "blocks"], Every] = "none"
    # torch.compile each block (in place: names, checkpoints and parallelism unchanged);
    # compiling is paid at the first step of each new worker process (less from the cache).
    # auto: on for workers on GPUs (1.18x on an H200), off on CPUs (0.98x): docs/benchmarks.md
    compile: Literal[True, False, "auto"] = "auto"

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step `step` (0-based): linear warm-up, then `schedule`
        down to min_lr at the last step. wsd holds lr until its decay's first step, then
        decays as 1 - sqrt(progress), the shape Hägele et al. (2024, "Scaling Laws and
        Compute-Optimal Training Beyond Fixed Training Durations") found to match cosine
        where linear decay falls short."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        start = self.warmup_steps if self.schedule != "wsd" else max(
            self.warmup_steps, self.steps - self.wsd_decay_steps)
        if step < start:
            return self.lr
        x = min(1.0, (step - start) / max(1, self.steps - start - 1))  # the decay's progress
        left = (0.5 * (1 + math.cos(math.pi * x)) if self.schedule == "cosine"
                else 1 - x if self.schedule == "linear" else 1 - math.sqrt(x))
        return self.min_lr + (self.lr - self.min_lr) * left

    @property
    def wsd_decay_steps(self) -> int:
        return self.decay_steps if self.decay_steps is not None else max(1, self.steps // 5)


@dataclass(frozen=True)
class ParallelSpec:
    dp: int = 1
    pp: int = 1  # pipeline stages: the model's layers are cut into pp contiguous runs
    tp: int = 1  # tensor parallelism: each layer of a replica split over tp workers
    # with tp: the residual stream between the split layers (norms, dropout, residual adds)
    # split along the sequence over the tp workers too (Megatron-LM's sequence parallelism)
    sequence_parallel: bool = False
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
    # expert parallelism: each mixture of experts' experts split over groups of this many
    # replicas (each holds experts / ep of them; a token goes to its experts' holders and
    # back, all-to-all), the rest of the model replicated (parallel/experts.py)
    ep: int = 1
    # context parallelism: each row's sequence split over this many workers of a replica
    # (each embeds and computes the loss of its part; attention gathers the whole sequence
    # for its share of the heads, all-to-all: parallel/context.py)
    cp: int = 1
    # how a cp worker's attention sees the whole sequence: all_to_all (DeepSpeed-Ulysses: a
    # cp-th of the heads over every position; tp x cp must divide the heads) or all_gather
    # (Llama 3's: its own positions' queries over every position's keys and values, gathered;
    # any number of heads) or ring (keys and values passed around the workers a part at a
    # time: parallel/ring.py; any number of heads, neither the whole row's keys nor its mask held)
    cp_attention: Literal["all_to_all", "all_gather", "ring"] = "all_to_all"


@dataclass(frozen=True)
class ResourcesSpec:
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    placement: Literal["pack", "spread"] = "pack"
    threads_per_worker: int = 1  # torch intra-op threads in each worker
    # a cluster with an autoscaler and too little room now (scaled to zero): how long the
    # start waits for the nodes it asked for before refusing the job
    wait_for_nodes_s: float = 600.0
    # after a run that finishes, keep its workers (and their resources) this long for the
    # next run of the same driver, which then starts no new processes (a sweep, a notebook)
    keep_warm_s: float = 0.0
    # on a cluster shared with other jobs: room this job lacks is taken from running elastic
    # jobs of lower priority, which shrink toward their min_dp while it runs (0: takes none)
    priority: int = 0
    # no room for the job's smallest world because other baton jobs hold it: how long it waits
    # in line (priority first, then the time it came) before it stops; null: as long as it takes
    queue_timeout_s: Optional[float] = None
    # the quota (`baton quota NAME --cpus N --gpus M`, set on the cluster) this job's workers
    # count against with the other jobs that name it: it starts and grows only within it
    quota: Optional[str] = None


@dataclass(frozen=True)
class CheckpointSpec:
    path: str = "checkpoints"  # local folder or a pyarrow filesystem URI; the job name is appended
    every_steps: int = 50
    keep: int = 2
    timeout_s: float = 600.0  # a save or load (a slow store is slow, not failed: not parallel.timeout_s)
    # `async` in a job file (a Python keyword): write checkpoints on a thread of each worker
    # while training goes on, from a copy of the state taken between two steps
    async_: bool = field(default=False, metadata={"key": "async"})
    # also keep the checkpoint whose held-out evaluation was best by this metric (eval_loss,
    # eval_accuracy, ...): it is never dropped for a newer one; best_mode: min or max (null:
    # min for eval_loss, which every other metric must say)
    best: Optional[str] = None
    best_mode: Optional[Literal["min", "max"]] = None

    @property
    def best_lowest(self) -> bool:
        return (self.best_mode or "min") == "min"


@dataclass(frozen=True)
class TrackingSpec:
    enabled: bool = True
    uri: Optional[str] = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the cwd
    experiment: str = "baton"
    flush_every_s: float = 30.0  # metrics are also flushed at every checkpoint commit
    # the step whose timeline is saved: a pipeline's (null: min(10, steps)), or, only when set,
    # a data-parallel replica's torch.profiler trace and its comm_overlap
    trace_step: Optional[int] = None
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
    # stop early: when checkpoint.best's metric has not improved by more than min_delta over
    # this many evaluations in a row (0: train every step); the run ends on a checkpoint
    patience: int = 0
    min_delta: float = 0.0

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
    # after a loss with no spare ready: replace waits for new workers (the run trains bit for
    # bit as an unfaulted one); continue goes on at once with the replicas the survivors make
    # (at least min_dp) and grows back once the replacements have started
    recovery: Literal["replace", "continue"] = "replace"


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
        """Replicas that split one copy of the state (1: unsharded): under expert
        parallelism, the replicas that split each mixture's experts (`parallel.ep`), which
        shard the rest of it between them under ZeRO."""
        p = self.parallel
        return p.ep if p.shard == "none" else (p.shard_group or (p.ep if p.ep > 1 else p.dp))

    def dims(self):
        """This job's rank arithmetic (`baton.parallel.ParallelDims`)."""
        from baton.parallel import ParallelDims

        p = self.parallel
        return ParallelDims(p.dp, p.pp, self.dp_shard, p.tp, p.cp,
                            sharded_cp=p.cp > 1 and p.shard != "none")

    @property
    def per_replica(self) -> int:
        """Workers that hold one replica: its pipeline stages, each split tp ways, its rows cp
        ways."""
        return self.parallel.pp * self.parallel.tp * self.parallel.cp

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (the interleaved schedule's v)."""
        p = self.parallel
        return p.chunks or (2 if p.schedule == "interleaved-1f1b" else 1)

    def recipe(self) -> dict:
        """What makes a checkpoint belong to this job: its name, model, data and optimisation
        recipe. Steps (and wsd's decay steps), layout (including micro-batching), resources,
        checkpointing, tracking and train.ema (an average of the weights: it changes none of
        them) may change on resume."""
        d = self.to_dict()
        train = {k: v for k, v in d["train"].items()  # (decay_steps: like steps, a length)
                 if k not in ("steps", "decay_steps", "micro_batch", "activation_checkpointing",
                              "compile", "skip_nonfinite", "rewind_on_spike", "ema")
                 and not (k == "optimizer" and v == "adamw")}  # (v0.7's recipes had none)
        data = {k: v for k, v in d["data"].items()
                if k not in ("mix_phases", "skip_bad_row_groups") and (k not in ("columns", "pad", "mix") or v)
                and (k not in ("document_mask", "eod_token") or (v is not False and v is not None))}  # (where set)
        if "mix" in data:  # its sources; their weights are pinned with their files (a change
            # is resumed with --rebase-data: api.check_corpus), their names label metrics, and
            # the phases that have begun are pinned with them (Mixture.trained)
            data["mix"] = [m["path"] for m in data["mix"]]
        # the task and the held-out split only where set: v0.5's checkpoints keep their recipe
        extra = {**({"task": self.task} if self.task != "language_model" else {}),
                 **({"eval": {"fraction": self.eval.fraction, "seed": self.eval.seed}}
                    if self.eval.fraction else {})}
        # (model.init_fresh, init_grow, frozen and lora only where set: a checkpoint written
        # before them keeps its recipe)
        model = {k: v for k, v in d["model"].items()
                 if k not in ("init_fresh", "init_grow", "frozen", "lora") or v}
        if model.get("lora"):  # (likewise lora.init_from, dropout and rslora)
            model["lora"] = {k: v for k, v in model["lora"].items()
                             if k not in ("init_from", "dropout", "rslora") or v}
        return {"name": d["name"], "model": model, "data": data, "train": train, **extra}

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
        from baton.spec_yaml import spec_from_dict

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
                      if not (p.shard_group and dp % p.shard_group) and dp % p.ep == 0
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


def __getattr__(name: str) -> Any:
    """Reading a job file lives in spec_yaml.py; its entry points are still found here."""
    if name in ("load_spec", "spec_from_dict", "_apply_override"):
        from baton import spec_yaml

        return getattr(spec_yaml, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
