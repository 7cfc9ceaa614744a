"""baton: elastic training for PyTorch on Ray.

From Python (a notebook, a script), without the CLI:

    import baton

    spec = baton.load("jobs/digits.yaml", ["train.steps=100"])  # a path, or a dict
    result = baton.run(spec)              # an embedded local Ray, as `baton run` starts
    result.loss, result.eval              # the last step's loss, the last evaluation
    result.history("eval_accuracy")       # [(step, value), ...] from the run's MLflow record
    baton.evaluate(spec, step="best").eval  # a checkpoint on the held-out data, no training
    baton.sweep(spec, {"train.lr": [1e-3, 3e-3]})  # a trial per value, ranked
    baton.fork("decay.yaml", spec)        # a new job starting at spec's newest checkpoint
    baton.scale(spec, 1)                  # a running elastic job: at most 1 replica
    baton.quota("team", cpus=8)           # jobs naming quota team hold at most 8 CPUs together
    baton.export(spec, "model-out")       # its newest verified checkpoint, as safetensors
    model = baton.load_model("model-out") # the trained nn.Module, on the CPU

`baton.api.run` takes the rest of `baton run`'s options (address, resume, on_step, ...).
"""

__version__ = "0.7.0"


def load(job, overrides=()):
    """A job spec from a YAML file's path or a dict, checked as `baton validate` checks it;
    `overrides` are "key.path=value" strings, as `--set` takes."""
    from baton.spec import load_spec, spec_from_dict

    if isinstance(job, dict):
        import copy

        from baton.spec import _apply_override

        raw = copy.deepcopy(job)
        for item in overrides:
            _apply_override(raw, item, "<dict>")
        return spec_from_dict(raw)
    return load_spec(job, list(overrides))


def run(job, overrides=(), **options):
    """Train a job (a JobSpec, a path or a dict) to its last step; returns its RunResult.
    `options` are `baton.api.run`'s (address, resume, show_progress, on_step, ...)."""
    from baton import api

    return api.run(_spec(job, overrides), **options)


def sweep(job, grid, overrides=(), **options):
    """Train a job (a path, a dict or a JobSpec) for every combination of `grid` ({key:
    [values]}), a trial after another on one Ray, as `baton sweep`; returns the trials
    (`baton.sweeps.Trial`: name, values, state, step, loss, metric, run_id), best first.
    `options`: `baton.api.sweep`'s (trials=N and seed for a random search, whose ranges are
    strings: {"train.lr": "loguniform(1e-4, 1e-2)"}; address, show_progress)."""
    from baton import api

    return api.sweep(job, grid, list(overrides), **options)


def evaluate(job, step=None, overrides=(), **options):
    """A job's checkpoint (`step`, default the newest that verifies, "best" the one
    checkpoint.best kept) evaluated on its held-out data without training, as `baton eval`;
    returns a RunResult whose `eval` holds the metrics. `options`: `baton.api.evaluate`'s."""
    from baton import api

    return api.evaluate(_spec(job, overrides), step=step, **options)


def export(job, out, step=None, overrides=(), max_shard_bytes=None, hf=False, ema=False,
           adapters=False):
    """Write a job's trained model (checkpoint `step`, default the newest that verifies,
    "best" the one checkpoint.best kept) to the folder `out` as safetensors, in Hugging
    Face's layout (`baton.checkpoint.export`); returns what its baton.json says. `hf`: the
    built-in gpt as GPT-2, for transformers; `ema`: the average of the weights that
    train.ema kept, in their place; `adapters`: model.lora's adapters alone, as PEFT's adapter
    folder."""
    from baton.checkpoint import export as exporting

    return exporting.export(_spec(job, overrides), out, step,
                            max_shard_bytes or exporting.MAX_SHARD_BYTES, hf=hf, ema=ema,
                            adapters=adapters)


def fork(job, source, step=None, overrides=()):
    """Make checkpoint `step` of job `source` (default: its newest that verifies; "best") the
    first checkpoint of job `job`, which then runs (`baton.run`) as its resume, with its own
    training settings (`baton.checkpoint.fork`); returns that checkpoint's metadata."""
    from baton.checkpoint.fork import fork as forking

    return forking(_spec(job, overrides), _spec(source, ()), step)


def scale(job, max_dp, overrides=()):
    """`baton scale`: the running elastic job `job` keeps to at most `max_dp` replicas from
    its next check (None: its own elastic.max_dp again; 0: any job is suspended until then)."""
    from baton.coordinator.ceiling import ask

    ask(_spec(job, overrides), max_dp)


def quota(name=None, cpus=None, gpus=None, clear=False, address="auto"):
    """`baton quota`: on a running cluster, set quota `name` (the `cpus` and `gpus` the jobs
    naming it, resources.quota, may hold together; None: no bound on that one) or `clear` it;
    returns every quota with its use."""
    from baton.api import quotas

    return quotas(address, set_to=(name, cpus, gpus) if name and not clear else None,
                  clear=name if clear else None)


def load_model(folder):
    """The model a `baton export` folder holds: built again and given its parameters (CPU,
    eval mode)."""
    from baton.checkpoint.export import load_model as loading

    return loading(folder)


def _spec(job, overrides):
    """A JobSpec, a path or a dict as a JobSpec, with `overrides` applied."""
    from baton.spec import JobSpec

    if isinstance(job, JobSpec) and not overrides:
        return job
    return load(job.to_dict() if isinstance(job, JobSpec) else job, overrides)
