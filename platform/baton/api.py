"""baton's Python API; the CLI is a thin shell over it.

Order matters: everything that can be checked without Ray (the spec, the data's shape, the
checkpoint folder) is checked first, so bad input is refused before Ray starts and before any
file, checkpoint or MLflow run is created. The driver imports torch only to check a task other
than a language model on the meta device, or to count an embedded Ray's GPUs: the workers hold
the models (`baton.workers.actor`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable, Optional

from baton import interrupts, ray_settings, storage
from baton.checkpoint import CheckpointStore
from baton.checkpoint.store import sizes_only
from baton.checkpoint.lease import Lease
from baton.console import RayMessages
from baton.data import corpus
from baton.data.manifest import Manifest
from baton.data.mix import Mixture
from baton.data.source import JobData, needs_prepare, preflight
from baton.errors import CheckpointError, ClusterError, SpecError, reason
from baton.spec import JobSpec, load_spec
from baton.spec_checks import check_fits
from baton.tracking import make_tracker

if TYPE_CHECKING:
    from baton.coordinator import Coordinator, RunResult


def validate(path: str, overrides: list[str] = ()) -> tuple[JobSpec, Optional[JobData]]:
    """Load and check a job file without starting anything; the data is checked, and what the
    run would read returned, if it is there (built-in data is prepared on first run)."""
    spec = load_spec(path, overrides)
    check_init_from(spec, str(path), if_present=True)
    return spec, None if needs_prepare(spec) else preflight(spec, str(path))


def check_data(path: str, overrides: list[str] = (), address: Optional[str] = None,
               on_bad: Callable[[str], None] = print) -> dict:
    """Read every row group of the job's data (its corpus or mix, and eval.path) as a run
    would, on an embedded Ray or `address`'s cluster, and call `on_bad(line)` for each whose
    rows a run would refuse (`baton data check`); the footers are checked first (SpecError,
    as `validate`). Returns what was read: {"row_groups", "samples", "bytes", "bad", "s"}."""
    import ray

    from baton.data.check import bad_row_groups

    spec, data = validate(path, overrides)
    if data is None:
        raise SpecError(f"{path}: data.path: {spec.data.path!r} is prepared on first run "
                        "(built-in data): nothing to check yet")
    manifests = list(getattr(data.manifest, "manifests", [data.manifest]))
    manifests += [s.manifest for s in data.eval_sets if s.uids is None]  # eval.path's own
    started = not ray.is_initialized()
    if address:
        probe_cluster(address)
        join_cluster(address)
    elif started:
        start_local_ray()
    t0, bad = time.perf_counter(), 0
    try:
        for manifest in manifests:
            for _, why in bad_row_groups(manifest, data.columns, spec.data.read == "spread"):
                bad += 1
                on_bad(why)
    finally:
        if started:
            shutdown_ray()
    return {"row_groups": sum(len(m.units) for m in manifests),
            "samples": sum(m.num_samples for m in manifests),
            "bytes": sum(m.bytes for m in manifests), "bad": bad,
            "s": time.perf_counter() - t0}


def check_init_from(spec: JobSpec, source: str, if_present: bool = False) -> None:
    """`model.init_from` names weights this model can start from: for a model of baton's (or
    your builder's), a `baton export` folder holding every parameter at its shape (or, for the
    built-in llama, a LlamaForCausalLM `save_pretrained` folder of its settings); an hf:
    model's is read by transformers' from_pretrained on the workers. `model.lora.init_from`
    holds adapters for the layers this job adapts, of its rank and alpha. `if_present` (`baton
    validate`, as for the data): a local folder not here (on a cluster's storage) is not
    checked; a URI (`s3://`) is read from here, its files' headers only."""
    m = spec.model

    def absent(folder: str) -> bool:
        return if_present and not storage.is_uri(folder) and not os.path.exists(folder)
    if m.lora is not None and m.lora.init_from is not None and not absent(m.lora.init_from):
        from baton.models.lora import started

        try:
            started(m)  # (its adapters fit the layers this job adapts)
        except CheckpointError as e:
            raise SpecError(f"{source}: model.lora.init_from: {e}") from None
    if m.init_from is None or m.name.startswith("hf:") or absent(m.init_from):
        return
    from baton.checkpoint.export import Exported
    from baton.models import _on_meta

    try:
        exported = Exported(m.init_from, m.init_fresh, m.init_grow)
        exported.close()
        problem = exported.settings_problem(m) or exported.problem(_on_meta(m))
    except CheckpointError as e:
        problem = str(e)
    if problem:
        raise SpecError(f"{source}: model.init_from: {problem}")


def fresh_names(spec: JobSpec) -> str:
    """The parameters `model.init_fresh` keeps at the model's own initialization, and how many
    values they hold."""
    from baton.models.frozen import named
    from baton.models import _on_meta

    fresh = [(n, t.numel()) for n, t in _on_meta(spec.model).state_dict().items()
             if named(n, spec.model.init_fresh)]
    return f"{', '.join(n for n, _ in fresh)} ({sum(k for _, k in fresh):,} values)"


def grown_names(spec: JobSpec) -> str:
    """The parameters `model.init_grow` fills the first rows of, and how many rows of how many."""
    from baton.checkpoint.export import Exported
    from baton.models.frozen import named
    from baton.models import _on_meta

    exported = Exported(spec.model.init_from)
    exported.close()
    theirs = exported.shapes
    return ", ".join(f"{n} ({theirs[n][0]:,} of {t.shape[0]:,} rows)"
                     for n, t in _on_meta(spec.model).state_dict().items()
                     if named(n, spec.model.init_grow))


def stage_plan(spec: JobSpec) -> str:
    """Layers per pipeline stage as `baton run` will cut them (time: measured at start)."""
    from baton.parallel.partition import plan_stages

    if spec.parallel.partition == "time":
        return "balanced by time measured at start"
    return str(plan_stages(spec, lambda: []))


def plan_resume(spec: JobSpec, source: str,
                resume: Optional[bool]) -> tuple[Optional[dict], list[tuple[int, str]]]:
    """The metadata of the checkpoint to resume from (None for a fresh start), and the newer
    committed checkpoints that failed verification (step, what failed): the run goes back
    to the newest that verifies. Verified here by their metadata and their parts' sizes; the
    workers check the checksums before they load (`Commits.newest_whole`): reading every
    part here would bring the whole checkpoint through this process.

    resume=None resumes automatically when the job's checkpoint folder holds a committed
    checkpoint of this job; resume=True requires one."""
    store = CheckpointStore(spec.checkpoint_dir)
    try:
        step, failed = store.latest_verified(sizes_only)
    except OSError as e:  # an endpoint that does not answer, credentials it refuses
        raise CheckpointError(f"{source}: checkpoint.path: cannot read "
                              f"{storage.redact(spec.checkpoint_dir)} ({reason(e)}); "
                              "check its address and credentials") from None
    if step is None and failed:
        raise CheckpointError(f"{source}: {store.none_verifies(failed)}")
    if step is None:
        if resume:
            raise CheckpointError(f"{source}: --resume given but {spec.checkpoint_dir} holds no "
                                  "committed checkpoint")
        return None, []
    meta = store.read_meta(step)
    _check_recipe(meta, spec, source, step)
    _check_left_out(meta, spec, source)
    done = finished_why(spec, meta)
    if done is not None:
        raise CheckpointError(f"{source}: job {spec.name!r} {done}")
    return meta, failed


def finished_why(spec: JobSpec, meta: dict) -> Optional[str]:
    """Why the job is done at checkpoint `meta` (every step trained, or stopped early under its
    eval.patience), and what trains it on; None while it has steps to go."""
    from baton.coordinator.stopping import stopped_before

    if meta["step"] >= spec.train.steps:
        return (f"already finished: its checkpoint is at step {meta['step']} and train.steps is "
                f"{spec.train.steps}; raise train.steps to train on")
    stopped = stopped_before(spec, meta)
    if stopped is not None:
        return (f"already stopped early at step {meta['step']}: {stopped}; raise eval.patience "
                "(or set it to 0) to train on")
    return None


def _check_recipe(meta: dict, spec: JobSpec, source: str, step: int) -> None:
    if meta.get("job") != spec.name or meta.get("fingerprint") != spec.fingerprint():
        changed = _changed_keys(meta.get("recipe", {}), spec.recipe())
        raise CheckpointError(
            f"{source}: {spec.checkpoint_dir} holds a checkpoint (step {step}) of another recipe "
            f"({changed or 'a different job'}); set checkpoint.path to a new folder, or restore "
            "the old values to resume")


def _check_left_out(meta: dict, spec: JobSpec, source: str) -> None:
    """The export a checkpoint takes its frozen parameters from (a LoRA job's: the model it
    adapts) is still the one it started from (checkpoint/frozen.py)."""
    from baton.checkpoint import frozen

    why = frozen.problem(meta, spec.model)
    if why:
        raise CheckpointError(f"{source}: model.init_from: {why}")


def check_corpus(meta: dict, manifest: Manifest | Mixture, source: str, rebase: bool) -> None:
    """Refuse to resume on a corpus other than the one the checkpoint was trained on: its
    cursor counts samples of that corpus's order. With `rebase`, the run goes on from the start
    of the next epoch on the new corpus, or where it was on files rewritten with the same row
    groups, or, for a mix, as `MixedFeed.rebased` says (`Samples.seek`)."""
    if rebase or manifest.trained(meta):
        return
    old = meta.get("manifest")
    key, then = "data.path", "go on from the next epoch on the new corpus"
    if isinstance(manifest, Mixture):
        key, what = "data.mix", manifest.changed_since(meta)
        then = ("go on with it (a source whose files are unchanged from its place, another "
                "from its next epoch; the new weights from here on)")
    elif old and "files" in old:
        what = manifest.changes_from(Manifest.from_json(manifest.root, old))
        if manifest.same_rows(meta):
            then = "go on where it was (the files hold the row groups they held)"
    else:
        what = ("the checkpoint was trained on a mix (data.mix)" if old
                else "the checkpoint records no manifest (written before baton 0.6)")
    raise CheckpointError(
        f"{source}: {key}: {manifest.root!r} is not the corpus checkpoint {meta['step']} was "
        f"trained on: {what}; restore it, or pass --rebase-data to {then}")


def _changed_keys(old: dict, new: dict, prefix: str = "") -> str:
    """'model.width 128 -> 64, train.lr ...' for the keys whose values differ."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            nested = _changed_keys(a, b, f"{prefix}{key}.")
            out += [nested] if nested else []
        elif a != b:
            out.append(f"{prefix}{key} {a!r} -> {b!r}")
    return ", ".join(out)


def prepare_data(spec: JobSpec, log: Callable[[str], None]) -> None:
    """Write the built-in data a job names into its data.path; where another process wrote it
    meanwhile (two runs of the job started at once), theirs is read (the same data)."""
    try:
        _prepare_data(spec, log)
    except OSError:
        if needs_prepare(spec):
            raise
        log(f"  {spec.data.path} was prepared meanwhile by another run: reading that")


def _prepare_data(spec: JobSpec, log: Callable[[str], None]) -> None:
    out = storage.local_path(spec.data.path)
    if spec.data.source == "digits":
        from baton.data.digits import prepare_digits

        log(f"preparing the digits dataset (scikit-learn's bundled copy) into {spec.data.path} ...")
        info = prepare_digits(out)
        log(f"  {info['samples']:,} images of {info['features']} pixels, {info['classes']} classes, "
            f"{info['row_groups']} row groups")
        return
    log(f"preparing the built-in corpus (Python standard library, seq_len "
        f"{spec.model.seq_len}) into {spec.data.path} ...")
    info = corpus.prepare_stdlib(out, spec.model.seq_len)
    log(f"  {info['files']} files, {info['tokens']:,} tokens, {info['samples']:,} samples")


def run(spec: JobSpec, *, source: str = "<spec>", address: Optional[str] = None,
        resume: Optional[bool] = None, rebase_data: bool = False, record_samples: bool = False,
        show_progress: bool = True, until: Optional[int] = None,
        log: Callable[[str], None] = print,
        on_step: Optional[Callable[[Coordinator], None]] = None, tags: Optional[dict] = None) -> RunResult:
    """Train `spec` to its last step, or to step `until` (`baton run --until`: a checkpoint
    there, and the run's state "paused"; run again, it goes on as if it had not stopped: the
    schedule is train.steps's). Starts an embedded local Ray unless Ray is already connected
    or `address` names a cluster. `on_step(coordinator)` is called after every completed step
    (to observe a run, or to inject faults in tests). `rebase_data`: resume on a corpus other
    than the checkpoint's, from the start of the next epoch. `tags`: on its MLflow run (a
    sweep's trial: its sweep's run as its parent)."""
    if until is not None and until < 1:
        raise SpecError(f"{source}: --until {until}: give a step of 1 or more")
    resume_meta, failed = plan_resume(spec, source, resume)
    if until is not None and resume_meta and until <= resume_meta["step"]:
        raise CheckpointError(f"{source}: --until {until}: job {spec.name!r} is at step "
                              f"{resume_meta['step']} already (its checkpoint); give a later step")
    address = _cluster(address, log)
    if resume_meta is None:  # (a resume takes its checkpoint's weights)
        check_init_from(spec, source)
    data = _fitted_data(spec, source, address, log)
    if resume_meta:
        check_corpus(resume_meta, data.manifest, source, rebase_data)

    # refused here, before Ray starts, while another run writes this job; held to the end
    with Lease(spec.checkpoint_dir, warn=log) as lease:
        back_to = f"checkpoint {resume_meta['step']}" if resume_meta else "step 0"
        for step, why in failed:
            log(f"warning: checkpoint {step} failed verification ({why}); it is set aside and "
                f"the run goes back to {back_to}")
            CheckpointStore(spec.checkpoint_dir).reject(step, why)
        with _on_ray(spec, source, address, log) as tracker:
            from baton.coordinator import Coordinator  # most of it imported by now

            if resume_meta:
                forked = resume_meta.get("forked_from")
                log(f"resuming {spec.name} from step {resume_meta['step']} "
                    f"(checkpoint in {storage.redact(spec.checkpoint_dir)}"
                    + (f"; forked from {forked['job']})" if forked else ")"))
            coordinator = Coordinator(spec, tracker, resume_meta=resume_meta,
                                      record_samples=record_samples, show_progress=show_progress,
                                      on_step=on_step, data=data, lease=lease, until=until,
                                      tags=tags)
            return coordinator.run()


def evaluate(spec: JobSpec, *, source: str = "<spec>", step: Optional[int | str] = None,
             address: Optional[str] = None, show_progress: bool = True,
             log: Callable[[str], None] = print) -> RunResult:
    """The held-out evaluation (eval.fraction or eval.path) of checkpoint `step` of `spec`'s job
    (default: the newest that verifies; "best": the one checkpoint.best kept), on as many
    workers as the job would train on, without training: a new MLflow run, tagged with the
    checkpoint, holds the metrics at its step. Ray as for `run`; no lease (nothing is written
    to the job's checkpoints)."""
    if not spec.eval.enabled:
        raise SpecError(f"{source}: job {spec.name!r} holds out no data to evaluate on: set "
                        "eval.fraction or eval.path (--set eval.path=DIR: a dataset of its own)")
    address = _cluster(address, log)
    meta = _evaluated_checkpoint(spec, source, step)
    if meta is None:  # the weights the job starts from
        check_init_from(spec, source)
    data = _fitted_data(spec, source, address, log)
    with _on_ray(spec, source, address, log) as tracker:
        from baton.coordinator import Coordinator

        log(f"evaluating {spec.name} at step {meta['step']} (checkpoint in "
            f"{storage.redact(spec.checkpoint_dir)})" if meta else
            f"evaluating {spec.name} as it starts: the weights of {spec.model.init_from} "
            "(model.init_from; no checkpoint yet)")
        return Coordinator(spec, tracker, resume_meta=meta, show_progress=show_progress,
                           data=data, evaluate_only=True).run()


def sweep(job, axes: dict, overrides: list[str] = (), *, trials: Optional[int] = None,
          seed: int = 0, halving: Optional[int] = None, first_rung: Optional[int] = None,
          concurrent: int | str = 1, asynchronous: bool = False, brackets: int = 1,
          search: str = "random",
          address: Optional[str] = None, show_progress: bool = True,
          log: Callable[[str], None] = print) -> list:
    """`baton sweep`: the job (a YAML file's path, a dict or a JobSpec) trained for every
    combination of `axes` (key -> values), or for `trials` random draws from them (a value a
    list or a `sweeps.Draw`; seeded by `seed`), on one Ray, a trial after another or up to
    `concurrent` at once where the cluster holds them ("auto": as many as its resources hold
    at once; `sweeps.drive`), those done already skipped; with `halving` (ETA), by
    successive halving from step `first_rung` (`halving.halve`), or `asynchronous` halving
    (`halving.promote`: no rung waits for its slowest trial), in `brackets` halvings
    (Hyperband: `halving.deal`, seeded by `seed`). With `search="tpe"`, the
    `trials` are suggested one at a time from the results so far (`search.Model`), under a
    halving from the rungs judged so far too (BOHB).
    Returns the trials (`sweeps.Trial`) ranked best first (`sweeps.ranked_by`)."""
    import ray

    from baton import halving as halving_
    from baton import search as search_
    from baton import sweeps
    from baton.tracking.sweep import SweepRun

    source = job if isinstance(job, str) else "<spec>"
    model = None
    settings = {"axes": {k: str(v) if isinstance(v, sweeps.Draw) else v for k, v in axes.items()},
                "overrides": list(overrides), "trials": trials, "seed": seed if trials else None,
                "search": search, "halving": halving, "first_rung": first_rung,
                "brackets": brackets if halving else None, "asynchronous": asynchronous or None}
    base = sweeps.maker(job, list(overrides))({})  # the job itself (a suggested trial's is checked as made)
    if search == "tpe":
        if trials is None:
            raise SpecError(f"{source}: --search tpe suggests --trials N trials: give --trials")
        model = search_.Model(job, axes, list(overrides), trials, seed, sweeps.ranked_by(base.spec)[1], log)
        trials = [base] * trials  # what fits and how many at once, by the job's own world
    elif search != "random":
        raise SpecError(f"{source}: --search {search}: use random or tpe")
    else:
        trials = sweeps.plan(job, axes, list(overrides), trials, seed)
    halving_.check_halving(trials, halving, first_rung, source, asynchronous, brackets, model is not None)
    if concurrent != "auto" and (not isinstance(concurrent, int) or concurrent < 1):
        raise SpecError(f"{source}: --concurrent {concurrent}: give 1 or more, or auto")
    if address is None and not ray.is_initialized():  # each trial fits, before Ray starts
        for t in trials:
            check_fits(t.spec, os.cpu_count() or 1,
                       _local_gpus() if t.spec.resources.gpus_per_worker else 0, source, "this machine")
    address = _cluster(address, log)
    record = SweepRun(base.spec, settings)
    if record.open():
        log(f"MLflow run {record.run_id}: this sweep's, its trials' runs nested under it")
    with record.recording(lambda: model.trials if model else trials), ray_session(address, log):
        if concurrent == "auto":
            concurrent = sweeps.most_at_once(trials, ray.cluster_resources())
            log(f"--concurrent auto: {concurrent} trial{'s' * (concurrent > 1)} at once "
                "(the most whose largest worlds this cluster holds together)")
        if concurrent > 1:  # lines from the trials' threads, whole; no progress line to share
            lock, say, show_progress = threading.Lock(), log, False

            def log(line: str) -> None:
                with lock:
                    say(line)

        def train(spec: JobSpec, until: Optional[int], on_step) -> RunResult:
            return run(spec, source=source, address=address, show_progress=show_progress,
                       until=until, on_step=on_step, log=log, tags=record.tags())

        def drive(lineup) -> None:  # the room counted as each grid or rung begins
            sweeps.drive(lineup, train, log, concurrent, ray.cluster_resources())

        if halving is None:
            drive(search_.Suggested(model) if model else sweeps.Listed(trials, None, log))
        else:
            lineups = (search_.brackets(model, halving, first_rung, brackets) if model
                       else halving_.dealt(trials, halving, first_rung, brackets, seed))
            if asynchronous:
                halving_.promote(lineups, halving, drive, log)
            else:
                halving_.halve(lineups, halving, lambda batch, until: drive(
                    sweeps.Listed(batch, until, log)), log)
        if model:
            trials = model.trials
    return sweeps.rank(trials, *sweeps.ranked_by(base.spec))


def _evaluated_checkpoint(spec: JobSpec, source: str, step: Optional[int | str]) -> Optional[dict]:
    """The metadata of the checkpoint `evaluate` loads: `step`, the best, or the newest whole
    one (by its parts' sizes: the workers check the checksums as they load), of this recipe;
    None for a job that has none yet and starts from model.init_from (evaluated as it starts:
    a pretrained model on a new task's data, before fine-tuning)."""
    from baton.checkpoint.export import pick

    store = CheckpointStore(spec.checkpoint_dir)
    try:
        if step is None and spec.model.init_from and not store.committed_steps():
            return None
        chosen = pick(spec, store, step, log=print, verify=sizes_only, doing="evaluating")
    except OSError as e:
        raise CheckpointError(f"{source}: checkpoint.path: cannot read "
                              f"{storage.redact(spec.checkpoint_dir)} ({reason(e)})") from None
    meta = store.read_meta(chosen)
    # the model and the task must be the checkpoint's; how it was trained need not be
    theirs, mine = meta.get("recipe"), spec.recipe()
    changed = theirs is not None and _changed_keys({k: theirs.get(k) for k in ("model", "task")},
                                                   {k: mine.get(k) for k in ("model", "task")})
    if changed:
        raise CheckpointError(f"{source}: checkpoint {chosen} in {storage.redact(spec.checkpoint_dir)} "
                              f"holds another model or task ({changed}); restore the old values")
    _check_left_out(meta, spec, source)
    return meta


def _cluster(address: Optional[str], log: Callable[[str], None]) -> Optional[str]:
    """The cluster to join: `address`, else $RAY_ADDRESS (said), checked to answer; None for
    the embedded Ray (or the one this process is connected to)."""
    import ray

    if address is None and not ray.is_initialized():
        address = cluster_address_from_env()
        if address:
            log(f"joining the Ray cluster at {address} ($RAY_ADDRESS)")
    if address is not None and not ray.is_initialized():
        probe_cluster(address)
    return address


def _fitted_data(spec: JobSpec, source: str, address: Optional[str],
                 log: Callable[[str], None]) -> JobData:
    """What the job reads, prepared (built-in data) and checked, once the embedded Ray (this
    machine) is known to hold the job."""
    import ray

    if not ray.is_initialized() and address is None:  # the embedded Ray is this machine
        check_fits(spec, os.cpu_count() or 1, _local_gpus() if spec.resources.gpus_per_worker else 0,
                   source, "this machine")
    with _PREPARING:  # a sweep's concurrent trials share one built-in corpus: made once
        if needs_prepare(spec):
            prepare_data(spec, log)
    return preflight(spec, source)


_PREPARING = threading.Lock()


@contextlib.contextmanager
def _on_ray(spec: JobSpec, source: str, address: Optional[str], log: Callable[[str], None]):
    """A run's tracker, opened while Ray starts (the embedded one, or `address`'s cluster,
    unless this process is connected already), with SIGTERM ending the run as Ctrl-C does and
    Ray's messages kept off the console; all undone after."""
    tracker = make_tracker(spec.tracking)
    _quiet_library_logs()  # MLflow's notes while it makes a new store's tables
    tracker.open_ahead()  # while Ray starts
    try:
        with ray_session(address, log):
            if address is not None:
                from baton.workers.capacity import fit_or_wait

                fit_or_wait(spec, source, f"the cluster at {address}", log)
            yield tracker
    finally:
        tracker.drop_ahead()  # a run refused before its MLflow run leaves no store
        tracker.wait_finished()  # a finished run's report, drawn meanwhile


def quotas(address: Optional[str] = "auto", set_to: Optional[tuple[str, Optional[float], Optional[float]]] = None,
           clear: Optional[str] = None) -> dict[str, dict]:
    """`baton quota`: on the running cluster at `address` (a head's GCS address, `auto`: the
    one on this machine), set quota `set_to` (name, CPUs, GPUs; None: no bound on that one)
    or `clear` one, then return every quota with its use (`quotas.report`)."""
    import ray

    from baton.coordinator import quotas as quota

    joined = not ray.is_initialized()
    if joined:
        probe_cluster(address)
        join_cluster(address)
    try:
        if set_to is not None:
            quota.set_quota(*set_to)
        if clear is not None:
            quota.clear_quota(clear)
        return quota.report()
    finally:
        if joined:
            shutdown_ray()


@contextlib.contextmanager
def ray_session(address: Optional[str], log: Callable[[str], None]):
    """Ray for what runs inside (the embedded one, or `address`'s cluster), unless this process
    is connected already, with SIGTERM ending a run as Ctrl-C does and Ray's messages kept off
    the console; shut down after. Runs one after another inside one session (a sweep's trials)
    share it, and the workers each keeps warm (resources.keep_warm_s)."""
    import ray

    if ray.is_initialized():
        yield
        return
    if address is None:
        start_local_ray()
    else:
        join_cluster(address)
    ray_messages = RayMessages.for_this_ray().install()
    # SIGTERM (kill, Kubernetes stopping a pod) ends a run like Ctrl-C: the workers shut
    # down, the MLflow run is marked KILLED, the last checkpoint stays for a resume.
    # Installed after ray.init, which replaces SIGTERM's handler with one that only dumps
    # a stack; both wait for a write to the run's record to finish (interrupts.py).
    previous_handlers = interrupts.install()
    try:
        yield
    finally:
        shutdown_ray()
        ray_messages.restore()
        interrupts.restore(previous_handlers)
        if ray_messages.where():
            log(ray_messages.where())


def shutdown_ray() -> None:
    """`ray.shutdown()` with no garbage collection on any thread while it runs. Ray's
    ObjectRefGenerator (the streaming results of Ray Data's read tasks) calls its core worker
    from `__del__` whenever the process still has one; `ray.shutdown` stops the core worker
    before it lets go of it, and a collection in between, on any thread, ended the process
    with exit code 1 ("The core worker has already been shutdown. This happens when the
    language frontend accesses the Ray's worker after it is shutdown. The process will exit"):
    seen twice in CI, a submitted job's driver failing after its run had finished, from the
    thread drawing the run's report. Reproduced, and this checked, in
    tests/integration/test_shutdown.py. The run's garbage is collected first, while Ray takes its
    references back; what becomes garbage later is collected after Ray is gone."""
    import gc

    import ray

    from baton.workers import warm

    warm.forget()  # the workers kept warm go with this Ray
    gc.collect()
    gc.disable()
    try:
        ray.shutdown()
    finally:
        gc.enable()


AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def _auth_default_line(record: logging.LogRecord) -> bool:
    """False for Ray's line saying it turned token authentication on by default."""
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_local_ray() -> None:
    """The embedded Ray: this machine's CPUs, no dashboard, and every one of its services (GCS,
    raylet, agents, workers, metrics) listening on 127.0.0.1 only. On Linux, Ray replaces a
    loopback node address with the machine's routed one, and its servers then listen on every
    interface, several with no authentication (the metrics ports); on macOS and Windows it
    keeps loopback. That choice is `ray_constants.ENABLE_RAY_CLUSTER` (read when Ray resolves
    the node's address; the process's children are handed the address): it is off while this
    Ray starts. $BATON_METRICS_PORT fixes the metrics port for a Prometheus on this machine."""
    import ray
    from ray._private import ray_constants

    # Ray 2.60 turns token authentication on for a new local cluster where RAY_AUTH_MODE is
    # unset (a token in ~/.ray/auth_token, made at the first start), and says so in a WARNING
    # on the console at every start: a line of Ray's, about a default baton keeps. Setting
    # the mode here instead does not work: Ray read it when imported (the GCS then never
    # started, measured), so that one line is filtered out of Ray's log, nothing else.
    logging.getLogger(AUTH_LOGGER).addFilter(_auth_default_line)
    options = {"num_cpus": os.cpu_count(), "_system_config": dict(ray_settings.SYSTEM_CONFIG)}
    if os.environ.get("BATON_METRICS_PORT"):
        options["_metrics_export_port"] = int(os.environ["BATON_METRICS_PORT"])
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
                 configure_logging=True, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode


PROBE_S = 10.0  # how long a cluster's address may take to answer (a head still starting)


def probe_cluster(address: str, wait_s: Optional[float] = None) -> None:
    """Refuse an address where nothing answers, in seconds: Ray's own connect tries a wrong
    one 20 times for about 41 s each, printing warnings, before it gives up (measured: still
    trying after 5.5 minutes). "auto" and other forms without a port are left to Ray."""
    wait_s = PROBE_S if wait_s is None else wait_s
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return
    deadline = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"cannot reach the Ray cluster at {address}: nothing answered there in "
                    f"{wait_s:g} s ({reason(e)}); is its head running (`ray start --head` "
                    "prints its address), and its port open to this machine?") from None
            time.sleep(0.5)


def join_cluster(address: str) -> None:
    """Connect this process to the running Ray cluster at `address` (`probe_cluster` it
    first: Ray waits minutes on an address where nothing answers). The job's relative local
    paths (checkpoint.path, model.init_from) are this process's (`storage.local_root`): its
    workers, whose working folder is the one their node's `ray start` ran in, are handed it
    as $BATON_STORAGE (they wrote checkpoints to a folder of their own before, which the
    driver never read). A submitted job's entrypoint keeps the job's: its package folder on
    every node, or `baton submit --storage`."""
    import ray

    submitted = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ  # Ray's, for a job's entrypoint
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True, **({} if submitted else {"runtime_env": {
                 "env_vars": {storage.STORAGE_ENV: storage.local_root()}}}))


def cluster_address_from_env() -> Optional[str]:
    """$RAY_ADDRESS, as `ray.init()` reads it: Ray sets it for a job's entrypoint, so `baton
    run` inside a submitted job trains on that cluster. An http(s):// value is a dashboard
    address for job submission (`baton submit`), not one to join, and is left alone."""
    value = os.environ.get("RAY_ADDRESS", "").strip()
    return value if value and not value.startswith(("http://", "https://")) else None


def _quiet_library_logs() -> None:
    """Keep the console to baton's progress line: not MLflow's schema-migration notes. The
    level is set on the named child logger, which MLflow's own logging set-up on import leaves
    alone. (Ray Data's loggers: where the feed imports it, `baton.data.feed._ray_data`.)"""
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)


def _local_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


__all__ = ["run", "validate", "plan_resume"]
