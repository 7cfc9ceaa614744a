"""`baton sweep`: one job trained over a grid of settings on one Ray, a trial after another
or, with `concurrent=N`, up to N at once where the cluster holds them (`drive`).

Each trial is the job with one combination of the grid's values, under a name of its own
(the job's name and the values: `quickstart-lr0.001-width64`), so it has its own checkpoints
and MLflow run and is an ordinary job: `baton status`, `report`, `export` and `eval` take its
name. Every trial's job file is checked before anything runs. A trial already done (every
step trained, or stopped early) is not trained again, and one that stopped part-way resumes:
running a sweep again finishes it. A trial that fails (a learning rate that diverges) is
reported and the rest go on. The trials share one Ray (started once) and, unless the job says
otherwise, keep their workers warm for the next (`resources.keep_warm_s`).

With `trials=N` (`--trials N`) the sweep is a random search instead: N trials, each drawing
every axis's value: one of a list's values, or from a range, `loguniform(LOW, HIGH)` (a
learning rate), `uniform(LOW, HIGH)` or `randint(LOW, HIGH)` (both ends included). Draws are
seeded (`seed`), so the same sweep run again draws the same trials (and finishes itself), and
a drawn float keeps 3 significant digits (trial names stay short, and no finer setting is
told apart by a run). Random search finds good settings in fewer trials than a grid where
few of the axes matter (Bergstra and Bengio, 2012).

With `halving=ETA` (`--halving ETA`) the trials are judged as they train, the worse ones cut
(successive halving, synchronous or not: `halving.py`).

At the end a table ranks the trials by a metric: `checkpoint.best`'s where the job keeps a
best checkpoint (that checkpoint's value), else the last held-out loss, else the last
training loss; under halving, those that trained furthest first.
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from baton.errors import BatonError, SpecError
from baton.spec import JobSpec

KEEP_WARM_S = 60  # a trial's workers wait this long for the next trial's (resources.keep_warm_s)
MOST_TRIALS = 1024


@dataclass(eq=False)
class Trial:
    name: str
    values: dict  # grid key -> this trial's value
    state: str = "pending"  # finished | stopped early | done before | failed | paused | cut
    step: int = 0
    loss: Optional[float] = None
    metric: Optional[float] = None  # the sweep's metric (see `ranked_by`)
    run_id: Optional[str] = None
    error: Optional[str] = None
    rung: int = 0  # under halving, the last rung it trained to (0 the first)
    reached: int = 0  # under halving, that rung's step (train.steps for the last)
    bracket: int = 0  # under Hyperband (--brackets), its bracket, from 1
    spec: Optional[JobSpec] = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        """Trains no further: every step trained, stopped early, or failed."""
        return self.state in ("finished", "stopped early", "done before", "failed")


def grid(axes: dict[str, list]) -> list[dict]:
    """Every combination of the axes' values, the first axis slowest."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


@dataclass(frozen=True)
class Draw:
    """A range a random search draws an axis's value from."""
    kind: str  # loguniform | uniform | randint
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.kind}({self.low:g}, {self.high:g})"

    def sample(self, rng) -> float | int:
        if self.kind == "randint":
            return rng.randint(int(self.low), int(self.high))
        x = (math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
             if self.kind == "loguniform" else rng.uniform(self.low, self.high))
        return float(f"{x:.3g}")


_DRAW = re.compile(r"\s*(loguniform|uniform|randint)\s*\(\s*([^,\s]+)\s*,\s*([^)\s]+)\s*\)\s*")


def parse_draw(text: str) -> Draw:
    """`loguniform(1e-4, 1e-2)`, `uniform(0, 0.2)` or `randint(1, 8)`; ValueError (what is
    wrong) for anything else."""
    m = _DRAW.fullmatch(text)
    if not m:
        raise ValueError("give a YAML list, or a range: loguniform(LOW, HIGH), uniform(LOW, HIGH) "
                         "or randint(LOW, HIGH)")
    kind, low, high = m.group(1), float(m.group(2)), float(m.group(3))
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"{kind}: LOW must be below HIGH, both finite numbers")
    if kind == "loguniform" and low <= 0:
        raise ValueError("loguniform: LOW must be above 0")
    if kind == "randint" and not (low.is_integer() and high.is_integer()):
        raise ValueError("randint: LOW and HIGH must be whole numbers")
    return Draw(kind, low, high)


def drawn(axes: dict[str, list | Draw], n: int, seed: int) -> list[dict]:
    """`n` distinct random trials (`Draw` axes drawn, list axes chosen from), seeded. Fewer
    distinct ones than `n` in the space (short lists, a narrow randint): SpecError."""
    import random

    rng, out, seen = random.Random(seed), [], set()
    for _ in range(100 * n):
        values = {k: v.sample(rng) if isinstance(v, Draw) else rng.choice(v) for k, v in axes.items()}
        key = json.dumps(values, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(values)
            if len(out) == n:
                return out
    raise SpecError(f"--trials {n}: only {len(out)} distinct trials could be drawn from these "
                    "axes; ask for fewer, or give wider ranges")


def trial_name(job: str, values: dict) -> str:
    """The job's name and each value, after its key's last part (`train.lr=0.001` -> lr0.001),
    in characters a job name may hold; a hash of the values where that is too long."""
    import hashlib

    parts = [f"{key.rsplit('.', 1)[-1]}{json.dumps(v) if not isinstance(v, str) else v}"
             for key, v in values.items()]
    name = re.sub(r"[^A-Za-z0-9_.-]", "", "-".join([job, *parts]))
    if len(name) <= 63:
        return name
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:10]
    return f"{job[:52]}-{digest}"


def ranked_by(spec: JobSpec) -> tuple[str, bool]:
    """The metric trials are ranked by, and whether lower is better."""
    if spec.checkpoint.best:
        return spec.checkpoint.best, spec.checkpoint.best_lowest
    return ("eval_loss" if spec.eval.enabled else "loss"), True


def plan(job, axes: dict[str, list | Draw], overrides: list[str] = (),
         trials: Optional[int] = None, seed: int = 0) -> list[Trial]:
    """The trials of `job` (a YAML file's path, a dict or a JobSpec): every combination of
    the axes' values, or with `trials` that many drawn at random (`drawn`); each one's job
    checked (one line naming the key at fault)."""
    job, where = _source(job)
    axes = parsed_axes(where, axes, trials)
    combos = grid(axes) if trials is None else drawn(axes, trials, seed)
    if len(combos) > MOST_TRIALS:
        raise SpecError(f"{where}: the grid holds {len(combos):,} trials; at most {MOST_TRIALS:,}")
    make = maker(job, overrides)
    trials = [make(values) for values in combos]
    names = [t.name for t in trials]
    if len(set(names)) < len(names):
        raise SpecError(f"{where}: two trials would share the name {next(n for n in names if names.count(n) > 1)!r}; "
                        "give values that differ once written out")
    return trials


def _source(job) -> tuple:
    """(the job as `load` takes it, what messages call it)."""
    if isinstance(job, JobSpec):
        job = job.to_dict()
    return job, job if isinstance(job, str) else "<spec>"


def parsed_axes(where: str, axes: dict, trials: Optional[int]) -> dict[str, list | Draw]:
    """The sweep's axes, each a list of values or a range (`Draw`, for `trials` drawn), checked."""
    if not axes:
        raise SpecError(f"{where}: a sweep needs --grid KEY=[VALUES] (e.g. --grid 'train.lr=[1e-3, 3e-3]')")
    axes = dict(axes)
    for key, values in axes.items():
        if isinstance(values, str):
            try:
                axes[key] = values = parse_draw(values)
            except ValueError as e:
                raise SpecError(f"{where}: --grid {key}={values}: {e}") from None
        if isinstance(values, Draw):
            if trials is None:
                raise SpecError(f"{where}: --grid {key}={values}: a range is drawn from by a random "
                                "search; give --trials N (or a list of values)")
        elif not isinstance(values, list) or not values:
            raise SpecError(f"{where}: --grid {key}: give a list of values, e.g. {key}=[1, 2]")
    if trials is not None and not 1 <= trials <= MOST_TRIALS:
        raise SpecError(f"{where}: --trials {trials}: give 1 to {MOST_TRIALS:,}")
    return axes


def maker(job, overrides: list[str] = ()) -> Callable[[dict], Trial]:
    """A trial of `job` for given values of the axes: its name and its checked job."""
    from baton import load

    job, _ = _source(job)
    base = load(job, list(overrides))
    warm = [] if base.resources.keep_warm_s else [f"resources.keep_warm_s={KEEP_WARM_S}"]

    def make(values: dict) -> Trial:
        name = trial_name(base.name, values)
        sets = [*overrides, *warm, *(f"{k}={json.dumps(v)}" for k, v in values.items()), f"name={name}"]
        return Trial(name, values, spec=load(job, sets))
    return make


def train(t: Trial, run: Callable[[JobSpec, Optional[int]], object], log: Callable[[str], None],
          until: Optional[int] = None) -> None:
    """Train trial `t` by `run(spec, until)` (api.run) to its end, or to step `until` (a
    rung), unless it is there already; record where it got to."""
    from baton import api

    metric, _ = ranked_by(t.spec)
    meta = done(t.spec, until)
    if meta is not None:
        t.state = "done before" if api.finished_why(t.spec, meta) is not None else "paused"
        t.step, t.loss, t.run_id = meta["step"], meta.get("loss"), meta.get("mlflow_run_id")
        t.metric = metric_of(t.spec, meta)
        log(f"  {t.name}: {'done' if t.state == 'done before' else 'trained'} before, at step {t.step}")
        return
    try:
        result = run(t.spec, until)
    except BatonError as e:
        t.state, t.error = "failed", str(e).splitlines()[0]
        log(f"  {t.name}: failed: {t.error}")
        return
    t.state = "stopped early" if result.stopped_early else result.state  # finished | paused
    t.step, t.loss, t.run_id = result.step, result.loss, result.run_id
    t.metric = _metric_of(t.spec, metric, result.eval, result.loss,
                          result.best[1] if result.best else None)
    log(f"  {t.name}: {t.state} at step {t.step}, loss {t.loss:.4f}"
        + (f", {metric} {t.metric:.4g}" if t.metric is not None and metric != "loss" else "")
        + f"; MLflow run {t.run_id}")


def done(spec: JobSpec, until: Optional[int] = None) -> Optional[dict]:
    """The newest checkpoint's metadata where the job is done at it (api.finished_why), or
    where it is at step `until` or later."""
    from baton import api
    from baton.checkpoint import CheckpointStore
    from baton.checkpoint.store import sizes_only

    store = CheckpointStore(spec.checkpoint_dir)
    step, _ = store.latest_verified(sizes_only)
    if step is None:
        return None
    meta = store.read_meta(step)
    if meta.get("fingerprint") != spec.fingerprint():
        return None  # another recipe: api.run says so
    if until is not None and step >= until:
        return meta
    return meta if api.finished_why(spec, meta) is not None else None


def progress(spec: JobSpec) -> str:
    """Where a trial is, for `baton sweep --list`: its status file's state, step and loss
    (a run at work, paused, finished or failed), else its newest checkpoint's step; "" for
    one not begun."""
    from baton.checkpoint import CheckpointStore
    from baton.status import state_of

    s = CheckpointStore(spec.checkpoint_dir).read_status()
    if s is None:
        meta = done(spec, 1)
        return f"at step {meta['step']}" if meta else ""
    loss = f", loss {s['loss']:.4f}" if s.get("loss") is not None else ""
    return f"{state_of(s)}, step {s['step']} of {s['steps']}{loss}"


def most_room(spec: JobSpec) -> dict[str, float]:
    """What a trial's workers may hold at once: its largest world's CPUs and GPUs."""
    r, n = spec.resources, spec.dp_range[1] * spec.per_replica
    return {"CPU": n * r.cpus_per_worker, "GPU": n * r.gpus_per_worker}


def fit_together(specs: list[JobSpec], total: dict) -> bool:
    """Whether the largest worlds of `specs` fit in a cluster of `total` resources at once."""
    held: dict[str, float] = {}
    for spec in specs:
        for key, amount in most_room(spec).items():
            held[key] = held.get(key, 0.0) + amount
    return all(amount <= total.get(key, 0.0) + 1e-9 for key, amount in held.items())


def most_at_once(trials: list[Trial], total: dict) -> int:
    """How many of `trials`, in order, fit in a cluster of `total` resources together (their
    largest worlds; at least one): `--concurrent auto`."""
    n = 1
    while n < len(trials) and fit_together([t.spec for t in trials[:n + 1]], total):
        n += 1
    return n


class Listed:
    """The trials in order, each to step `until` (None: to train.steps): what `drive` trains
    for a plain sweep or one rung of a synchronous halving."""

    def __init__(self, trials: list[Trial], until: Optional[int], log: Callable[[str], None]):
        self.pending, self.until, self.log, self.n = list(enumerate(trials, 1)), until, log, len(trials)

    def peek(self) -> Optional[tuple[Trial, Optional[int]]]:
        return (self.pending[0][1], self.until) if self.pending else None

    def take(self) -> tuple[Trial, Optional[int]]:
        k, t = self.pending.pop(0)
        self.log(f"trial {k} of {self.n}: {t.name} ({values_of(t)})")
        return t, self.until

    def ended(self, t: Trial) -> None:
        pass


def values_of(t: Trial) -> str:
    return ", ".join(f"{key}={v}" for key, v in t.values.items())


def train_each(trials: list[Trial], run: Callable[..., object], log: Callable[[str], None],
               until: Optional[int] = None, concurrent: int = 1, total: Optional[dict] = None) -> None:
    """Train each trial (`train`) to step `until`, a trial after another or up to
    `concurrent` at once (`drive`)."""
    drive(Listed(trials, until, log), run, log, concurrent, total)


def drive(lineup, run: Callable[..., object], log: Callable[[str], None], concurrent: int = 1,
          total: Optional[dict] = None) -> None:
    """Train what `lineup` hands out (`peek()` the next trial and the step to train it to, or
    None while there is nothing; `take()` it; told each one that `ended(t)`), a trial after
    another, or with `concurrent` > 1 up to that many at once where their largest worlds fit
    in the cluster's `total` resources together (one always runs), each on a thread of this
    driver. A trial that fails is reported and the rest go on; an error of another kind, or
    Ctrl-C, stops every trial running (each at a step's end, its MLflow run marked KILLED, its
    checkpoints kept) and is raised. `run(spec, until, on_step)` is api.run's."""
    if concurrent <= 1:
        while lineup.peek() is not None:
            t, until = lineup.take()
            train(t, lambda spec, end: run(spec, end, None), log, until)
            lineup.ended(t)
        return
    stop, ended = threading.Event(), queue.Queue()

    def on_step(_) -> None:  # the way into a trial's thread: signals reach the main one only
        if stop.is_set():
            raise KeyboardInterrupt(signal.SIGINT)

    def work(t: Trial, until: Optional[int]) -> None:
        try:
            train(t, lambda spec, end: run(spec, end, on_step), log, until)
        except BaseException as e:
            ended.put((t, e))
            return
        ended.put((t, None))

    running, errors = [], []
    try:
        while True:
            while len(running) < concurrent and not errors:
                nxt = lineup.peek()
                if nxt is None or (running and not fit_together(
                        [*(t.spec for t in running), nxt[0].spec], total or {})):
                    break
                t, until = lineup.take()
                running.append(t)
                threading.Thread(target=work, args=(t, until), name=f"baton-trial-{t.name}",
                                 daemon=True).start()
            if not running:
                break
            try:
                t, error = ended.get(timeout=0.5)
            except queue.Empty:
                continue
            running.remove(t)
            if error is not None and not errors:
                errors.append(error)
                stop.set()
            elif error is None:
                lineup.ended(t)
    except KeyboardInterrupt:
        stop.set()
        _wait_out(running, ended, STOP_WAIT_S)
        raise
    if errors:
        raise errors[0]


STOP_WAIT_S = 60.0  # how long stopping a sweep waits for its running trials to stop


def _wait_out(running: list, ended: queue.Queue, wait_s: float) -> None:
    """Take the trials that end from `running`, for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while running and time.monotonic() < deadline:
        try:
            t, _ = ended.get(timeout=0.5)
        except queue.Empty:
            continue
        running.remove(t)


def _best_value(spec: JobSpec) -> Optional[float]:
    from baton.checkpoint import CheckpointStore

    if not spec.checkpoint.best:
        return None
    found = CheckpointStore(spec.checkpoint_dir).best(spec.checkpoint.best, spec.checkpoint.best_lowest)
    return found[1] if found else None


def metric_of(spec: JobSpec, meta: dict) -> Optional[float]:
    """The sweep's metric of a trial done at checkpoint `meta`."""
    metric, _ = ranked_by(spec)
    return _metric_of(spec, metric, meta.get("eval", {}), meta.get("loss"), _best_value(spec))


def _metric_of(spec: JobSpec, metric: str, evaluated: dict, loss: Optional[float],
               best: Optional[float]) -> Optional[float]:
    if spec.checkpoint.best:
        return best
    value = loss if metric == "loss" else evaluated.get(metric)
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def rank(trials: list[Trial], metric: str, lowest: bool) -> list[Trial]:
    """Best first: those that reached a later rung (halving: a later step, whatever their
    bracket) before the others, then by the metric; trials without a value (failed, never
    evaluated) last, in grid order."""
    def key(t: Trial):
        if t.metric is None:
            return (1, 0, 0.0)
        return (0, -t.reached, t.metric if lowest else -t.metric)
    return sorted(trials, key=key)


def table(trials: list[Trial], metric: str) -> list[str]:
    """The lines `baton sweep` prints: a trial a row, its values (its bracket under
    Hyperband), state, step, loss, metric."""
    keys = list(trials[0].values)
    brackets = any(t.bracket for t in trials)
    head = ["trial", *keys, *(["bracket"] if brackets else []), "state", "step", "loss", metric]
    rows = [[t.name, *(json.dumps(t.values[k]) if not isinstance(t.values[k], str) else t.values[k]
                       for k in keys), *([str(t.bracket)] if brackets else []),
             t.state, str(t.step), "" if t.loss is None else f"{t.loss:.4f}",
             "" if t.metric is None else f"{t.metric:.4g}"] for t in trials]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]
    lines += [f"  {t.name}: {t.error}" for t in trials if t.error]
    return lines
