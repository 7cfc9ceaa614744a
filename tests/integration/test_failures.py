"""Failures a user meets without any infrastructure fault: their own code raising, a loss that
blows up. The run stops with one line naming where, the MLflow run says FAILED, and the last
checkpoint stays loadable. Runs the `baton` command with the user's module in the cwd."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from mlflow.tracking import MlflowClient

from baton.checkpoint import CheckpointStore
from helpers import start_baton, tiny_spec, write_dataset, write_spec

USER_MODEL = '''
import torch
from baton.models.gpt import build_gpt

class Trap(torch.nn.Module):
    """Raises, or poisons the activations, on the n-th forward pass of this process."""
    calls = 0
    def __init__(self, at, mode):
        super().__init__()
        self.at, self.mode = at, mode
    def forward(self, x):
        Trap.calls += 1
        if Trap.calls == self.at and self.mode == "raise":
            raise ValueError("bad batch in user code")
        return x

class NanAfter(torch.nn.Module):
    calls = 0
    def __init__(self, at):
        super().__init__()
        self.at = at
    def forward(self, h):
        NanAfter.calls += 1
        return h * float("nan") if NanAfter.calls >= self.at else h

def raising(spec):
    gpt = build_gpt(layers=1, width=16, heads=2, seq_len=spec.seq_len, vocab_size=256)
    return torch.nn.Sequential(Trap(4, "raise"), *gpt)

def on_workers_only(spec):
    """Imports a module the driver's machine has and the workers' nodes do not."""
    import ray
    if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
        raise ModuleNotFoundError("No module named 'lab_private'")
    return build_gpt(layers=1, width=16, heads=2, seq_len=spec.seq_len, vocab_size=256)

def exploding(spec):
    gpt = build_gpt(layers=1, width=16, heads=2, seq_len=spec.seq_len, vocab_size=256)
    return torch.nn.Sequential(gpt[0], NanAfter(4), *gpt[1:])
'''


@pytest.mark.parametrize("builder,message", [
    ("raising", "baton: error: worker rank 0 failed while training step 4: "
                "ValueError: bad batch in user code"),
    ("exploding", "baton: error: the loss is nan at step 4; lower train.lr or set train.grad_clip"),
])
def test_run_stops_with_one_line_and_keeps_its_checkpoint(tmp_path, builder, message):
    (tmp_path / "usermodel.py").write_text(USER_MODEL)
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = tiny_spec(tmp_path, data, name=builder, model={"name": f"usermodel:{builder}"},
                     parallel={"dp": 1}, train={"steps": 6, "global_batch": 4, "micro_batch": 4},
                     checkpoint={"every_steps": 2})
    job = write_spec(tmp_path / "job.yaml", spec)

    proc = start_baton(["run", str(job), "--quiet"], tmp_path)
    out, _ = proc.communicate(timeout=300)

    assert proc.returncode == 2, out
    last = out.strip().splitlines()[-1]
    assert last.startswith(message), last
    store = CheckpointStore(str(tmp_path / "ckpt" / builder))
    assert store.latest() == 2 and store.read_model(2)  # loadable
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED" and run.data.tags["failed_at_step"] == "4"


def test_a_builder_that_cannot_import_on_the_workers_is_one_line(tmp_path):
    """The builder's module imports on the driver (validate passes) and not where the workers
    run (a cluster without the user's package): named by its error, once, and not retried
    (it fails the same way at the same step)."""
    (tmp_path / "usermodel.py").write_text(USER_MODEL)
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = tiny_spec(tmp_path, data, name="workers-only", model={"name": "usermodel:on_workers_only"},
                     parallel={"dp": 1}, elastic={"max_failures": 3})
    proc = start_baton(["run", str(write_spec(tmp_path / "job.yaml", spec)), "--quiet"], tmp_path)
    out, _ = proc.communicate(timeout=300)

    assert proc.returncode == 2, out
    assert "Traceback" not in out, out
    lines = out.strip().splitlines()
    assert lines[-1] == ("baton: error: giving up: the same error came back at step 1 after a "
                         "recovery: worker rank 0 failed while joining the group: "
                         "ModuleNotFoundError: No module named 'lab_private'"), out
    assert len(lines) == 1, out  # --quiet: no progress, no event lines


def test_data_that_does_not_fit_the_model_is_refused_before_ray_mlflow_or_checkpoints(tmp_path):
    # found by reading the code: a failure before the MLflow run existed used to raise a
    # second, unrelated MLflow error from the failure handler and hide the first. The footers
    # are checked before Ray starts (data/footers.py): 3 s here where it was 11.5 s
    data = write_dataset(tmp_path / "data", 64, 32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="vocab",
                                                      model={"vocab_size": 100}))
    (tmp_path / "ray").mkdir()
    proc = start_baton(["run", str(job)], tmp_path, env=dict(os.environ, RAY_TMPDIR=str(tmp_path / "ray")))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    last = out.strip().splitlines()[-1]
    # every file's footer is checked before anything is written or started: its statistics
    # hold each column chunk's greatest token id
    assert re.fullmatch(rf"baton: error: {re.escape(str(job))}: data.token_column: token ids in "
                        rf"{re.escape(str(data))}/part-\d.parquet lie in \[\d+, \d+\]( \(and up to "
                        r"\d+ in another file\))? but model.vocab_size is 100; set model.vocab_size: "
                        r"\d+ or more", last), last
    fix = int(re.search(r"set model.vocab_size: (\d+) or more", last).group(1))
    import pyarrow.dataset as pads

    assert fix - 1 == max(max(row) for row in pads.dataset(data).to_table().column("tokens").to_pylist())
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "ckpt").exists()
    assert not any((tmp_path / "ray").iterdir()), "Ray started"  # its temp dir stays empty


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_run_is_marked_killed_and_keeps_its_checkpoint(tmp_path, signum):
    data = write_dataset(tmp_path / "data", 256, 32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(
        tmp_path, data, name="stopped", train={"steps": 100_000}, checkpoint={"every_steps": 5}))
    proc = start_baton(["run", str(job), "--quiet"], tmp_path)
    marker = tmp_path / "ckpt" / "stopped" / "step_00000005" / "COMMITTED"
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    # a second run of the job while this one trains: refused before Ray starts, naming it
    second = start_baton(["run", str(job), "--quiet"], tmp_path)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 2, out
    assert re.fullmatch(rf"baton: error: {re.escape(str(tmp_path / 'ckpt' / 'stopped'))} is in use "
                        rf"by another run of this job \(host [^,]+, pid {proc.pid}, since [-0-9 :]+ "
                        r"UTC\): one run writes a job's checkpoints at a time; wait for it to end, "
                        r"or stop it", out.strip().splitlines()[-1]), out
    os.kill(proc.pid, signum)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, out
    assert out.strip().splitlines()[-1] == f"baton: interrupted by {signal.Signals(signum).name}"
    assert CheckpointStore(str(tmp_path / "ckpt" / "stopped")).latest() >= 5
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "KILLED"
