"""The job spec's values: every bound, every combination, every path, checked before anything
is built, started or written (`check_values`, run by `spec_from_dict` on every spec), and
whether a job's workers fit a cluster (`check_fits`). `spec.py` holds the tree and how it is
read; this holds what makes a well-typed tree a job that can run."""

from __future__ import annotations

import os
import re
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Optional

from baton.errors import SpecError, reason

if TYPE_CHECKING:
    from baton.spec import JobSpec


def show(value: Any, most: int = 80) -> str:
    """A value for a one-line message: huge integers by their size (their digits can take
    seconds to print, and Python refuses past 4,300), long text cut."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= most else f"{text[:most - 20]}... ({len(text)} characters)"


def check_values(spec: JobSpec, source: str, one_world: bool = False) -> None:
    """Every value in bounds and every combination possible, or one SpecError naming the
    file, the key, the value and the fix."""

    def need(ok: bool, key: str, value: Any, fix: str) -> None:
        if not ok:
            raise SpecError(f"{source}: {key}: {show(value)} is invalid; {fix}")

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
    if m.init_from is not None:
        problem = path_problem(m.init_from)
        need(problem is None, "model.init_from", m.init_from, problem or "")
    for key, names, what in (("init_fresh", m.init_fresh, "to leave out of model.init_from's"),
                             ("init_grow", m.init_grow, "whose first rows come from model.init_from's")):
        need(not names or (m.init_from is not None and not hf), f"model.{key}", names,
             f"names parameters {what}, for a model of baton's or your builder's"
             + ("; an hf: model's from_pretrained reads its own" if hf else ": set model.init_from"))
        need(all(names), f"model.{key}", names, "an empty name matches no parameter")
    if m.lora is not None:
        _check_lora(spec, need)
    if m.frozen:
        _check_frozen(spec, need)
    need(not hf or p.pp == 1, "parallel.pp", p.pp, "hf: models are not an nn.Sequential of "
         "layers to cut into stages; use pp: 1 (data parallel or sharded)")
    # (the hint is only worked out when needed; a llama's head width may be given instead)
    if m.name in ("gpt", "llama") and m.width % m.heads and not (m.name == "llama" and "head_dim" in m.options):
        near = _divisor_near(m.width, m.heads)
        need(False, "model.heads", m.heads,
             f"must divide model.width ({m.width})" + (f"; try {near}" if near else ""))
    if m.name == "llama":
        _check_llama(m, need)
    need(bool(d.path), "data.path", d.path, "give a folder or URI of Parquet files")
    need(bool(d.token_column), "data.token_column", d.token_column, "name the token column")
    need(d.shuffle_block >= 1, "data.shuffle_block", d.shuffle_block, "must be at least 1 sample")
    if d.mix:
        _check_mix(spec, need)
    else:
        need(not d.mix_phases, "data.mix_phases", [asdict(p) for p in d.mix_phases],
             "changes the weights of data.mix: give data.mix too")
    _check_task(spec, need)
    if c.best is not None or c.best_mode is not None:  # (after the task's checks: it names it)
        _check_best(spec, need)
    _check_patience(spec, need)

    for key in ("steps", "global_batch"):
        need(getattr(t, key) >= 1, f"train.{key}", getattr(t, key), "must be at least 1")
    need(t.micro_batch is None or t.micro_batch >= 1, "train.micro_batch", t.micro_batch,
         "must be at least 1")
    need(t.lr > 0, "train.lr", t.lr, "must be > 0 (e.g. 3e-4)")
    need(0 <= t.min_lr <= t.lr, "train.min_lr", t.min_lr, f"must be in [0, train.lr = {t.lr}]")
    need(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be >= 0")
    need(t.decay_steps is None or t.schedule == "wsd", "train.decay_steps", t.decay_steps,
         f"is wsd's (warmup-stable-decay); train.schedule is {t.schedule}")
    need(t.decay_steps is None or 1 <= t.decay_steps <= t.steps, "train.decay_steps",
         t.decay_steps, f"must be in [1, train.steps = {t.steps}]")
    need(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be >= 0")
    need(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", t.betas,
         "give two numbers in [0, 1), e.g. [0.9, 0.95]")
    need(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be >= 0 (0 turns clipping off)")
    need(0 <= t.skip_nonfinite <= 10**6, "train.skip_nonfinite", t.skip_nonfinite,
         "must be 0 (a step whose gradient is not finite fails the run) to 1,000,000 (steps in a "
         "row skipped before it fails)")
    need(0 <= d.skip_bad_row_groups <= 10**6, "data.skip_bad_row_groups", d.skip_bad_row_groups,
         "must be 0 (bad rows found as they are read stop the run) to 1,000,000 (row groups "
         "skipped before they do)")
    need(t.ema is None or 0 < t.ema < 1, "train.ema", t.ema,
         "is the average's decay, in (0, 1): e.g. 0.999 (about the last 1,000 steps' weights)")
    spike = t.rewind_on_spike
    if spike is not None:
        need(1 < spike.factor <= 10**6, "train.rewind_on_spike.factor", spike.factor,
             "must be above 1 (a loss that many times the window's median is a spike), at most 1e6")
        need(2 <= spike.window <= 10**4, "train.rewind_on_spike.window", spike.window,
             "must be 2 to 10,000 steps (the median of their losses is the level a spike is judged by)")
        need(1 <= spike.most <= 1000, "train.rewind_on_spike.most", spike.most,
             "must be 1 to 1,000 rewinds in a run (the next spike fails it)")
    ac = t.activation_checkpointing
    need(isinstance(ac, str) or 1 <= ac.every <= MOST["model.layers"][0],
         "train.activation_checkpointing.every", getattr(ac, "every", ac),
         f"must be in [1, {MOST['model.layers'][0]}] blocks")

    need(p.dp >= 1, "parallel.dp", p.dp, "must be at least 1")
    need(p.pp >= 1, "parallel.pp", p.pp, "must be at least 1")
    need(p.tp >= 1, "parallel.tp", p.tp, "must be at least 1")
    need(p.cp >= 1, "parallel.cp", p.cp, "must be at least 1")
    need(p.dp * spec.per_replica <= MOST_WORKERS, "parallel.dp", p.dp,
         f"dp x pp x tp x cp = {p.dp * spec.per_replica:,} workers; at most {MOST_WORKERS:,}")
    need(p.timeout_s > 0, "parallel.timeout_s", p.timeout_s, "must be > 0 seconds")
    need(p.shard_unit_mib >= 0, "parallel.shard_unit_mib", p.shard_unit_mib, "must be >= 0 MiB")
    need(p.grad_comm != "powersgd" or (p.pp == 1 and p.shard in ("none", "optimizer")),
         "parallel.grad_comm", p.grad_comm, "PowerSGD runs through DDP's communication hook: "
         "use it with parallel.shard none or optimizer and pp 1 (bf16 works everywhere)")
    _check_batching(spec, need)
    if p.tp > 1:
        _check_tensor(spec, need)
    if p.sequence_parallel:
        _check_sequence(spec, need)
    if p.shard != "none" or p.shard_group is not None:
        _check_sharding(spec, need, one_world)
    if p.ep != 1:
        _check_experts(spec, need)
    if p.cp > 1:
        _check_context(spec, need)
    need(p.cp > 1 or p.cp_attention == "all_to_all", "parallel.cp_attention", p.cp_attention,
         "says how context parallelism's workers attend: set parallel.cp > 1, or leave it out")
    if p.pp > 1 or p.schedule == "interleaved-1f1b" or p.chunks or p.partition != "params":
        _check_pipeline(spec, source, need)

    need(r.cpus_per_worker > 0, "resources.cpus_per_worker", r.cpus_per_worker, "must be > 0")
    need(r.gpus_per_worker >= 0, "resources.gpus_per_worker", r.gpus_per_worker, "must be >= 0")
    need(r.wait_for_nodes_s >= 0, "resources.wait_for_nodes_s", r.wait_for_nodes_s, "must be >= 0 seconds")
    need(r.keep_warm_s >= 0, "resources.keep_warm_s", r.keep_warm_s, "must be >= 0 seconds")
    need(r.priority >= 0, "resources.priority", r.priority, "must be >= 0 (0: takes no room from other jobs)")
    need(r.queue_timeout_s is None or r.queue_timeout_s > 0, "resources.queue_timeout_s",
         r.queue_timeout_s, "must be > 0 seconds, or null to wait as long as it takes")
    need(r.quota is None or QUOTA_NAME.fullmatch(r.quota) is not None, "resources.quota", r.quota,
         "names a quota (baton quota NAME): 1 to 64 letters, digits, _ . -")
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
    problem = tracking_uri_problem(tr.uri)
    need(problem is None, "tracking.uri", tr.uri, problem or "")
    _check_elastic(spec, need, one_world)


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
    "train.decay_steps": (10**12, "steps"),
    "train.seed": (2**32 - 1, "a 32-bit seed"),
    "parallel.dp": (2**16, "replicas"),
    "parallel.pp": (2**10, "pipeline stages"),
    "parallel.microbatches": (2**17, "micro-batches a step"),
    "parallel.chunks": (2**10, "chunks a pipeline rank"),
    "parallel.shard_group": (2**16, "replicas"),
    "parallel.ep": (2**16, "replicas"),
    "parallel.shard_unit_mib": (2**20, "MiB"),
    "parallel.timeout_s": _SECONDS,
    "resources.cpus_per_worker": (2**10, "CPUs"),
    "resources.gpus_per_worker": (64, "GPUs on one node"),
    "resources.threads_per_worker": (2**10, "threads"),
    "resources.wait_for_nodes_s": _SECONDS,
    "resources.keep_warm_s": _SECONDS,
    "resources.priority": (10**6, "a priority"),
    "resources.queue_timeout_s": _SECONDS,
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
    "elastic.spares": (64, "standby workers"),
    "eval.every_steps": (10**12, "steps"),
    "eval.seed": (2**32 - 1, "a 32-bit seed"),
    "eval.patience": (10**6, "evaluations"),
}
MOST_WORKERS = 2**16  # replicas x pipeline stages
MOST_SOURCES = 256  # datasets in data.mix: each has a feed reading ahead in the driver
QUOTA_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # resources.quota, `baton quota NAME`
MOST_PHASES = 1024  # data.mix_phases: each checkpoint's metadata lists them
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
        return f"a name in it is longer than file systems allow (255 bytes): {show(too_long[0], 40)}"
    return None


def tracking_uri_problem(uri: Optional[str]) -> Optional[str]:
    """Why MLflow cannot open `uri` as a tracking store, where that is known without touching
    it (None: it may). A folder is MLflow's file store, which MLflow 3 refuses to open unless
    $MLFLOW_ALLOW_FILE_STORE says otherwise (found by a run that set `./mlruns`, which failed
    with MLflow's traceback after Ray had started)."""
    if uri is None:
        return None
    if "\x00" in uri or len(uri.encode()) > 4096:
        return "contains a NUL character or is longer than 4,096 bytes"
    scheme = uri.partition(":")[0] if re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", uri) else ""
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")
    if scheme in ("", "file") and not allowed:
        return ("a folder is MLflow's file store, which MLflow refuses unless "
                "MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///PATH/mlflow.db or an http(s):// server")
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
    need(spec.task == "language_model" or d.loss_mask_column is None, "data.loss_mask_column",
         d.loss_mask_column, f"marks a language model's targets; task {spec.task} reads "
         "data.columns (a task of your own may read a mask column there)")
    need(d.source == "parquet" or d.loss_mask_column is None, "data.loss_mask_column",
         d.loss_mask_column, f"the built-in {d.source} data has no loss mask; prepare yours "
         "(baton data prepare text --prompt-column ...) and set data.source: parquet")
    need(spec.task == "language_model" or not d.document_mask, "data.document_mask",
         d.document_mask, f"separates the documents of a language model's rows; task "
         f"{spec.task} reads data.columns")
    need(not (d.document_mask and spec.model.name.startswith("hf:")), "data.document_mask",
         d.document_mask, f"{spec.model.name}'s attention takes no document mask here: use "
         "model.name: gpt or llama, or prepare one document a row (baton data prepare text --one-per-row)")
    need(d.eod_token is None or d.document_mask, "data.eod_token", d.eod_token,
         "is read by data.document_mask alone: set data.document_mask: true, or leave it out")
    need(d.eod_token is None or 0 <= d.eod_token < spec.model.vocab_size, "data.eod_token",
         d.eod_token, f"give a token id of the vocabulary, 0 to {spec.model.vocab_size - 1}")
    if spec.task != "language_model":
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


def _check_best(spec: JobSpec, need) -> None:
    """checkpoint.best names a metric every checkpoint's evaluation reports."""
    from baton.tasks import make_task

    c, e = spec.checkpoint, spec.eval
    need(c.best is not None, "checkpoint.best_mode", c.best_mode, "says which way "
         "checkpoint.best's metric is better; name the metric (e.g. checkpoint.best: eval_loss)")
    reported = make_task(spec).metrics
    # (train.ema: the average of the weights evaluated too, as eval_ema_*)
    kinds = ["eval_"] + (["eval_ema_"] if spec.train.ema is not None else [])
    names = [f"{kind}{m}" for kind in kinds for m in ["loss", *(reported or ())]]
    need(c.best.startswith("eval_") if reported is None else c.best in names, "checkpoint.best",
         c.best, "names a metric of the held-out evaluation: "
         + (", ".join(names) if reported is not None else "eval_loss or eval_ and your task's metric"))
    need(c.best_mode is not None or c.best in ("eval_loss", "eval_ema_loss"), "checkpoint.best_mode", c.best_mode,
         f"say min or max: which way {c.best} is better")
    need(e.enabled, "checkpoint.best", c.best, "keeps the checkpoint whose held-out evaluation "
         "was best: set eval.fraction or eval.path")
    need(e.every_steps >= 1 and c.every_steps % e.every_steps == 0, "eval.every_steps",
         e.every_steps, f"must divide checkpoint.every_steps ({c.every_steps}) so that every "
         f"checkpoint is evaluated for checkpoint.best (e.g. {c.every_steps})")


def _check_mix(spec: JobSpec, need) -> None:
    d = spec.data
    need(d.source == "parquet", "data.source", d.source, "data.mix reads Parquet datasets: "
         "set data.source: parquet")
    need(len(d.mix) >= 2, "data.mix", [m.path for m in d.mix], "mixes two or more datasets "
         "(one is data.path)")
    need(len(d.mix) <= MOST_SOURCES, "data.mix", f"{len(d.mix)} sources", f"at most {MOST_SOURCES}")
    for k, m in enumerate(d.mix):
        problem = path_problem(m.path)
        need(problem is None and bool(m.path), f"data.mix[{k}].path", m.path,
             problem or "give a folder or URI")
        need(0 < m.weight <= 10**6, f"data.mix[{k}].weight", m.weight,
             "must be > 0 and at most 1,000,000 (its share is weight / the sum of the weights)")
    need(len(d.mix_phases) <= MOST_PHASES, "data.mix_phases", f"{len(d.mix_phases)} phases",
         f"at most {MOST_PHASES:,}")
    after = 0
    for k, p in enumerate(d.mix_phases):
        need(p.after_step > after, f"data.mix_phases[{k}].after_step", p.after_step,
             "must be at least 1" if k == 0 else
             f"must be after the phase before it (data.mix_phases[{k - 1}].after_step: {after})")
        after = p.after_step
        need(len(p.weights) == len(d.mix), f"data.mix_phases[{k}].weights", p.weights,
             f"give one weight for each of the {len(d.mix)} sources of data.mix, in its order")
        need(all(0 <= w <= 10**6 for w in p.weights) and sum(p.weights) > 0,
             f"data.mix_phases[{k}].weights", p.weights,
             "each must be 0 to 1,000,000 (0: none of that source's samples), and one above 0")
    labels = [m.label for m in d.mix]
    for k, m in enumerate(d.mix):
        need(m.name is None or re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", m.name), f"data.mix[{k}].name",
             m.name, "names its held-out metrics (eval_loss/NAME): 1 to 64 letters, digits, _ . -")
        need(labels.count(labels[k]) == 1, f"data.mix[{k}].name", m.name,
             f"{labels[k]!r} names two sources; give each a name of its own (data.mix[{k}].name)")


def _check_patience(spec: JobSpec, need) -> None:
    """eval.patience watches checkpoint.best's metric: one metric says which model is best and
    whether training still improves it, and the run that stops early keeps that model."""
    e = spec.eval
    need(e.patience >= 0, "eval.patience", e.patience, "must be >= 0 evaluations (0: no early stop)")
    need(e.min_delta >= 0, "eval.min_delta", e.min_delta, "must be >= 0 (an improvement counts "
         "when it is larger than this)")
    need(e.min_delta == 0 or e.patience > 0, "eval.min_delta", e.min_delta,
         "counts only with eval.patience (how many evaluations without improvement stop the run)")
    need(e.patience == 0 or spec.checkpoint.best is not None, "eval.patience", e.patience,
         "stops the run when checkpoint.best's metric stops improving: name it (e.g. "
         "checkpoint.best: eval_loss), and its checkpoint is kept")


def _check_elastic(spec: JobSpec, need, one_world: bool) -> None:
    e, dp = spec.elastic, spec.parallel.dp
    lo, hi = spec.dp_range
    need(lo >= 1, "elastic.min_dp", e.min_dp, "must be at least 1")
    need(lo <= dp, "elastic.min_dp", e.min_dp, f"must be <= parallel.dp = {dp}")
    need(hi >= dp, "elastic.max_dp", e.max_dp, f"must be >= parallel.dp = {dp}")
    need(hi * spec.per_replica <= MOST_WORKERS, "elastic.max_dp", e.max_dp,
         f"max_dp x pp x tp x cp = {hi * spec.per_replica:,} workers; at most {MOST_WORKERS:,}")
    need(e.max_failures >= 0, "elastic.max_failures", e.max_failures, "must be >= 0")
    need(e.rescale_check_s > 0, "elastic.rescale_check_s", e.rescale_check_s, "must be > 0 seconds")
    need(e.hang_timeout_s > 0, "elastic.hang_timeout_s", e.hang_timeout_s, "must be > 0 seconds")
    need(e.spares >= 0, "elastic.spares", e.spares, "must be >= 0 (0: no standby workers)")
    need(e.recovery == "replace" or lo < hi or one_world, "elastic.recovery", e.recovery,
         "continue goes on with fewer replicas after a loss: it needs elastic.min_dp below "
         "elastic.max_dp")
    if lo < hi:
        valid = spec.valid_dps()
        for key, value in (("elastic.min_dp", lo), ("elastic.max_dp", hi)):
            need(value in valid, key, value,
                 f"train.global_batch {spec.train.global_batch} cannot be split over {value} "
                 f"replicas under batch_policy {spec.batch_policy}; dp values that work: "
                 + (f"{valid}" if len(valid) <= 12 else f"{str(valid[:12])[:-1]}, ... ({len(valid)} in all)]"))


def _check_lora(spec: JobSpec, need) -> None:
    """Adapters of a sensible size on linear layers the model has."""
    lora = spec.model.lora
    need(1 <= lora.rank <= 65_536, "model.lora.rank", lora.rank, "must be in [1, 65,536] (e.g. 8)")
    need(0 < lora.alpha <= 1e6, "model.lora.alpha", lora.alpha,
         "must be in (0, 1,000,000] (an adapter is scaled by alpha / rank; e.g. 2 x rank)")
    need(0.0 <= lora.dropout < 1.0, "model.lora.dropout", lora.dropout, "must be in [0, 1) (e.g. 0.05)")
    for key, names in (("targets", lora.targets), ("whole", lora.whole)):
        need(all(names), f"model.lora.{key}", names, "an empty name matches no layer")
    need(bool(lora.targets), "model.lora.targets", lora.targets,
         "name the linear layers to adapt (shell patterns: \"*\" is every one)")
    if lora.init_from is not None:
        problem = path_problem(lora.init_from)
        need(problem is None, "model.lora.init_from", lora.init_from, problem or "")
    from baton.models.lora import problem

    trouble = problem(_names_of(spec, need, "model.lora", asdict(lora)), spec.model)
    need(trouble is None, "model.lora.targets", lora.targets, trouble or "")


def _check_frozen(spec: JobSpec, need) -> None:
    """Patterns that each name a parameter, and something left to train."""
    m = spec.model
    need(all(m.frozen), "model.frozen", m.frozen, "an empty name matches no parameter")
    need(m.lora is None, "model.frozen", m.frozen, "model.lora freezes every parameter but "
         "model.lora.whole's already: name those to train there")
    from baton.models.frozen import problem

    trouble = problem(_names_of(spec, need, "model.frozen", m.frozen), m)
    need(trouble is None, "model.frozen", m.frozen, trouble or "")


def _names_of(spec: JobSpec, need, key: str, value: Any):
    """The model built on the meta device, for the names `key` matches: a builder of the
    user's that fails there is one line about `key`."""
    from baton.models import _on_meta

    try:
        return _on_meta(spec.model)
    except Exception as e:
        need(False, key, value, "its names are found on the model built on the meta device, "
             f"and building it there failed: {reason(e)}")


def _check_tensor(spec: JobSpec, need) -> None:
    """Tensor parallelism runs with everything else (data parallel replicas under DDP,
    ZeRO-1 or FSDP2, pipeline stages, compiled blocks, any grad_comm): what it needs is a
    model whose blocks say how they split, into equal pieces."""
    p = spec.parallel
    from baton.models import _on_meta
    from baton.parallel.tensor import plan_problem

    problem = plan_problem(_on_meta(spec.model), spec.model.name, p.tp)
    need(problem is None, "parallel.tp", p.tp, problem or "")


def _check_sequence(spec: JobSpec, need) -> None:
    """Sequence parallelism splits the sequence over the tp workers of a replica after the
    module marked `tp_sequence_after` (in a pipeline, one of the model's layers)."""
    from baton.models import _on_meta
    from baton.parallel.tensor import sequence_start

    p, m = spec.parallel, spec.model
    start = sequence_start(_on_meta(m)) if p.tp > 1 else ""
    key = "parallel.sequence_parallel"
    for ok, what in ((p.tp > 1, "splits the sequence over the tp workers: set parallel.tp > 1"),
                     (start is not None, f"model {m.name!r} marks no module tp_sequence_after "
                                         "(where the sequence is split: docs/parallelism.md)"),
                     (p.pp == 1 or "." not in (start or ""),
                      f"in a pipeline the module marked tp_sequence_after must be one of the "
                      f"model's layers, not {start!r} inside one"),
                     (m.seq_len % max(p.tp * p.cp, 1) == 0,
                      f"splits model.seq_len = {m.seq_len} over tp = {p.tp}"
                      + (f", each of cp = {p.cp} parts of it" if p.cp > 1 else "")
                      + f": make it a multiple of {p.tp * p.cp}")):
        need(ok, key, p.sequence_parallel, what)


def _check_context(spec: JobSpec, need) -> None:
    """Context parallelism (parallel.cp): this version's, for language modelling with the
    built-in models' blocks (gpt's, llama's, or a builder's made of them: their attention
    takes the split) under DDP or ZeRO (sharded over dp_shard x cp), with tensor parallelism
    and in pipeline stages, every block's heads split evenly over the cp workers (a tp-th of
    them each) unless they gather keys and values or pass them around a ring."""
    from baton.models import _on_meta

    p, m = spec.parallel, spec.model
    need(spec.task == "language_model", "parallel.cp", p.cp,
         f"splits the sequence of a language model's rows, not task {spec.task!r}'s")
    need(m.seq_len % p.cp == 0, "parallel.cp", p.cp,
         f"splits model.seq_len = {m.seq_len} into equal parts: make it a multiple of cp")
    model = _on_meta(m)
    blocks = [(path, layer) for path, layer in model.named_modules() if hasattr(layer, "cp_problem")]
    need(bool(blocks), "parallel.cp", p.cp,
         f"model {m.name!r} has no block whose attention takes a split sequence (the built-in "
         "gpt's and llama's blocks, with a cp_problem method: docs/parallelism.md)")
    problem = next((f"{m.name}'s layer {path}: {why}" for path, layer in blocks
                    if p.cp_attention == "all_to_all" and (why := layer.cp_problem(p.cp, p.tp))), None)
    need(problem is None, "parallel.cp", p.cp, f"{problem}: each cp worker attends with a "
         "cp-th of every block's heads" + (" (of its tp worker's share)" if p.tp > 1 else "")
         + "; parallel.cp_attention: all_gather or ring splits none")
    need(p.cp_attention != "ring" or m.seq_len % (2 * p.cp) == 0, "parallel.cp", p.cp,
         f"on a ring splits model.seq_len = {m.seq_len} into 2 x cp equal pieces (each worker "
         f"two, zigzag): make it a multiple of {2 * p.cp}")
    need(p.cp_attention != "ring" or not m.dropout, "model.dropout", m.dropout,
         "drops attention's probabilities, which ring attention (parallel.cp_attention: ring) "
         "does not: set it to 0, or take all_to_all or all_gather")


def _check_experts(spec: JobSpec, need) -> None:
    """Expert parallelism (parallel.ep): this version's, under DDP, ZeRO-2 or -3 (the rest of
    the model, or of each pipeline stage, sharded over each group of ep replicas)."""
    from baton.models import _on_meta, routed

    p = spec.parallel
    need(p.ep >= 1, "parallel.ep", p.ep, "must be at least 1")
    blocks = routed(_on_meta(spec.model))  # (the built-in llama's mixtures, a builder's of them)
    experts = blocks[0].mixture.experts if blocks else 0
    need(experts, "parallel.ep", p.ep, "splits a mixture of experts' experts, and the model has "
         "none (model.options.experts of the built-in llama)")
    need(experts % p.ep == 0, "parallel.ep", p.ep,
         f"must divide model.options.experts ({experts}): each replica of a group holds as many")
    lo, hi = spec.dp_range
    need(p.dp % p.ep == 0 and lo % p.ep == 0 and hi % p.ep == 0, "parallel.ep", p.ep,
         f"must divide parallel.dp ({p.dp}) and elastic.min_dp and max_dp ({lo}, {hi}): "
         "every world holds whole groups of ep replicas")
    need(p.shard != "optimizer", "parallel.shard", p.shard, f"is not built with expert "
         f"parallelism (parallel.ep = {p.ep}) in this version (ZeRO-1's optimizer splits every "
         "parameter by its place in the model): use grads or full, which shard the rest over "
         "each group of ep replicas, or none")
    need(p.shard == "none" or not p.shard_group or p.shard_group == p.ep, "parallel.shard_group",
         p.shard_group, f"must equal parallel.ep ({p.ep}) under expert parallelism: the replicas "
         "that split the experts shard the rest of the model (leave it out: it is ep)")


def _check_sharding(spec: JobSpec, need, one_world: bool) -> None:
    p = spec.parallel
    need(p.shard != "none", "parallel.shard_group", p.shard_group,
         "hybrid sharding needs a shard level: set parallel.shard to optimizer, grads or full")
    need(one_world or spec.dp_range[1] >= 2 or p.cp > 1, "parallel.shard", p.shard,
         "sharding splits state across replicas and this job has one (parallel.dp and "
         "elastic.max_dp are 1); raise parallel.dp or use shard: none")
    need(p.pp == 1 or p.shard != "optimizer", "parallel.shard", p.shard,
         f"ZeRO-1 inside pipeline stages (parallel.pp = {p.pp}) is not supported (torch's "
         "ZeroRedundancyOptimizer steps through DDP, which pipelines do not use); use grads "
         "or full with pp")
    if p.shard_group is not None:
        least = 1 if p.cp > 1 else 2  # (1: over each replica's cp workers alone)
        need(p.shard_group >= least, "parallel.shard_group", p.shard_group,
             f"must be at least {least} (null shards across all of dp)")
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


def _check_llama(m, need) -> None:
    """Rotary positions turn pairs of a head's numbers, and grouped-query attention shares
    each key-value head among as many query heads."""
    kv_heads = m.options.get("kv_heads", m.heads)
    need(m.heads % kv_heads == 0, "model.options.kv_heads", kv_heads,
         f"must divide model.heads ({m.heads}): each key-value head serves as many query heads")
    if "head_dim" in m.options:
        need(m.options["head_dim"] % 2 == 0, "model.options.head_dim", m.options["head_dim"],
             "must be even: rotary positions turn pairs of numbers")
    else:
        need((m.width // m.heads) % 2 == 0, "model.heads", m.heads,
             f"must leave an even head width (model.width {m.width} / heads {m.heads} is "
             f"{m.width // m.heads}): rotary positions turn pairs of numbers")
    scaling = [k for k in ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len")
               if k in m.options]
    need("rope_factor" in m.options or not scaling, f"model.options.{scaling[0] if scaling else ''}",
         m.options.get(scaling[0]) if scaling else None,
         "scales the rotary embedding with model.options.rope_factor (Llama 3.1's scaling), "
         "which is not given")
    experts = m.options.get("experts", 0)
    routing = [k for k in ("experts_per_token", "norm_topk", "router_aux_loss", "router_z_loss",
                           "shared_expert") if k in m.options]
    need(experts or not routing, f"model.options.{routing[0] if routing else ''}",
         m.options.get(routing[0]) if routing else None,
         "routes tokens among a mixture's experts, and model.options.experts is not given")
    k = m.options.get("experts_per_token", 2)
    need(not experts or k <= experts, "model.options.experts_per_token", k,
         f"must be at most model.options.experts ({experts}): each token goes to that many experts")
    low, high = m.options.get("rope_low_freq_factor", 1.0), m.options.get("rope_high_freq_factor", 4.0)
    need(low < high, "model.options.rope_high_freq_factor", high,
         f"must be more than rope_low_freq_factor ({low}): between them the frequencies are interpolated")


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
    workers = dp * spec.per_replica
    if workers * r.cpus_per_worker > cpus + 1e-9:
        fit = int(cpus // r.cpus_per_worker)
        raise SpecError(
            f"{source}: {key}: {dp} is invalid; {workers} workers x "
            f"resources.cpus_per_worker {r.cpus_per_worker} need {workers * r.cpus_per_worker:g} "
            f"CPUs but {where} has {cpus:g}; use dp <= {fit // spec.per_replica} or lower cpus_per_worker")
    if r.gpus_per_worker and workers * r.gpus_per_worker > gpus + 1e-9:
        raise SpecError(
            f"{source}: {key}: {dp} is invalid; {workers} workers x "
            f"resources.gpus_per_worker {r.gpus_per_worker} need {workers * r.gpus_per_worker:g} "
            f"GPUs but {where} has {gpus:g}")
