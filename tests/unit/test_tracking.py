"""The MLflow tracker: a resumed run logs every step once, however late the crash came."""

from __future__ import annotations

import dataclasses

import pytest
from mlflow.tracking import MlflowClient

from baton import api
from baton.errors import SpecError, TrackingError
from baton.spec import TrackingSpec
from baton.tracking import MLflowTracker, NullTracker, store_template
from conftest import REPO
from helpers import free_ports


def test_resume_logs_each_step_once_even_after_a_late_flush(tmp_path):
    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t", flush_every_s=3600)
    first = MLflowTracker(spec)
    run_id = first.start("job", {"train.lr": 0.1})
    for step in range(1, 8):  # flushed through step 7, but the crash came before commit 5's marker
        first.log_metrics(step, {"loss": 10.0 - step})
    first.flush()

    resumed = MLflowTracker(spec)  # resumes from the checkpoint at step 4
    assert resumed.start("job", {"train.lr": 0.1, "train.steps": 10}, run_id=run_id) == run_id
    for step in range(5, 11):
        resumed.log_metrics(step, {"loss": 10.0 - step})
    resumed.finish("FINISHED")

    client = MlflowClient(spec.uri)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert steps == list(range(1, 11))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "10"


def test_a_run_finished_in_the_background_is_whole_once_waited_for(tmp_path):
    """finish(background=True), as a finished run's coordinator calls it: the report is drawn
    and the run marked FINISHED on a thread while the workers and Ray shut down; after
    wait_finished (api.run, before it returns) both are there."""
    from baton.tracking import report

    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    tracker = MLflowTracker(spec)
    run_id = tracker.start("job", {"train.lr": 0.1})
    for step in range(1, 4):
        tracker.log_metrics(step, {"loss": 3.0 - step, "tokens_per_s": 100.0, "dp": 1})
    tracker.finish("FINISHED", background=True)
    tracker.wait_finished()
    tracker.wait_finished()  # once more: nothing left to wait for
    client = MlflowClient(spec.uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    listed = sorted(a.path for a in client.list_artifacts(run_id, report.ARTIFACT_DIR))
    assert listed == ["report/report.html", "report/report.png"]


def test_the_report_draws_the_held_out_losses_beside_the_training_loss(tmp_path):
    """eval_loss and a mix's per-source eval_loss/NAME are drawn on the loss panel, each at
    the steps it was evaluated; other eval metrics (accuracy) are not."""
    from baton.tracking import report

    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    tracker = MLflowTracker(spec)
    run_id = tracker.start("job", {})
    for step in range(1, 7):
        evaluated = {"eval_loss": 2.0, "eval_loss/web": 1.5, "eval_loss/code": 2.5,
                     "eval_accuracy": 0.5} if step % 3 == 0 else {}
        tracker.log_metrics(step, {"loss": 3.0 - step / 3, "tokens_per_s": 100.0,
                                   "world_size": 2, **evaluated})
    tracker.finish("FINISHED")
    client = MlflowClient(spec.uri)
    rep = report.build(client, client.get_run(run_id), str(tmp_path / "r"))
    assert rep.points == {"loss": 6, "tokens_per_s": 6, "world_size": 6, "eval_loss": 2,
                          "eval_loss/code": 2, "eval_loss/web": 2}


def test_the_periodic_delivery_runs_beside_the_steps_and_logs_each_once(tmp_path):
    """Metrics due by `flush_every_s` go to the store on the tracker's own thread: the
    coordinator's thread, which logs them, goes on handing out steps while a slow store takes
    them (55-94 ms a flush on sqlite for 10 s of quick-start steps, measured in a run; the
    workers have two steps queued). A commit's flush waits for it and delivers the rest."""
    import threading

    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t", flush_every_s=0.0)
    tracker = MLflowTracker(spec)
    run_id = tracker.start("job", {"train.lr": 0.1})
    real, entered, release, senders = tracker.client, threading.Event(), threading.Event(), []

    class SlowStore:
        def __getattr__(self, name):
            return getattr(real, name)

        def log_batch(self, run_id, metrics=(), **kwargs):
            if metrics:
                senders.append(threading.current_thread().name)
                entered.set()
                assert release.wait(30), "never released"
            return real.log_batch(run_id, metrics=metrics, **kwargs)

    tracker.client = SlowStore()
    tracker.log_metrics(1, {"loss": 9.0})  # due at once: handed to the sender
    assert entered.wait(30)
    for step in range(2, 6):  # the store is still taking step 1
        tracker.log_metrics(step, {"loss": 10.0 - step})
    release.set()
    tracker.flush()  # as a commit does: after the sender's delivery, the rest
    assert senders and "baton-mlflow-send" in senders[0]
    steps = sorted(m.step for m in MlflowClient(spec.uri).get_metric_history(run_id, "loss"))
    assert steps == [1, 2, 3, 4, 5]
    tracker.finish("FINISHED")
    tracker._sender.join(30)
    assert not tracker._sender.is_alive()  # finish ends the sender's loop


def test_nothing_is_written_before_start(tmp_path):
    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = MLflowTracker(spec)
    tracker.set_tags({"error": "boom"})  # a failure before the run existed
    tracker.finish("FAILED")
    assert not (tmp_path / "mlflow.db").exists()
    NullTracker().finish("FINISHED")


def test_a_store_that_cannot_be_opened_is_one_line_before_anything_trains(tmp_path, monkeypatch):
    """A folder (MLflow's file store, which MLflow 3 refuses) is refused by `baton validate`;
    a server that does not answer stops the run at its start in one line. Both were MLflow's
    traceback, after Ray had started."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    job = str(REPO / "jobs" / "quickstart.yaml")
    with pytest.raises(SpecError, match=r"tracking.uri: '\./mlruns' is invalid; a folder is MLflow's file store"):
        api.validate(job, ["tracking.uri=./mlruns"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    api.validate(job, ["tracking.uri=./mlruns"])  # the user's choice, as MLflow allows it

    [port] = free_ports(1)  # nothing listens there
    tracker = MLflowTracker(TrackingSpec(uri=f"http://user:secret@127.0.0.1:{port}"))
    with pytest.raises(TrackingError) as e:
        tracker.start("job", {"train.lr": 0.1})
    line = str(e.value)
    assert line.startswith(f"the MLflow store http://***@127.0.0.1:{port} cannot be opened: ")
    assert "\n" not in line and "secret" not in line, line
    tracker.finish("FAILED")  # nothing more is tried: the user sees the first error
    assert tracker.run_id is None


def test_a_store_opened_ahead_gives_its_run_or_its_error_at_start(tmp_path):
    """`baton run` opens the store on a thread while Ray starts (`open_ahead`): `start` then
    makes the run in it, and a store that failed to open fails `start` in the same one line."""
    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t")
    tracker = MLflowTracker(spec)
    tracker.open_ahead()
    tracker._opening.result(timeout=120)  # the thread made the tables, under a hidden name
    prepared = tracker._fresh.stat().st_ino
    assert not (tmp_path / "mlflow.db").exists()
    run_id = tracker.start("job", {"train.lr": 0.1})
    assert (tmp_path / "mlflow.db").stat().st_ino == prepared  # that file took the name
    tracker.log_metrics(1, {"loss": 1.0})
    tracker.finish("FINISHED")
    run = MlflowClient(spec.uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.1"

    assert sorted(p.name for p in tmp_path.iterdir() if "mlflow.db" in p.name) == ["mlflow.db"]

    refused = MLflowTracker(TrackingSpec(uri=f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"))
    (tmp_path / "new").mkdir()
    refused.open_ahead()
    refused.drop_ahead()  # the run was refused before its MLflow run: no store is left
    refused.finish("FAILED")
    assert list((tmp_path / "new").iterdir()) == []

    nowhere = MLflowTracker(TrackingSpec(uri=f"sqlite:///{tmp_path / 'missing' / 'mlflow.db'}"))
    with pytest.raises(TrackingError, match=r"cannot be opened: its folder .*missing does not exist"):
        nowhere.open_ahead()  # before Ray starts, naming the folder (not the hidden new store)
    assert not (tmp_path / "missing").exists()

    bad = MLflowTracker(TrackingSpec(uri="nosuchscheme://store"))
    bad.open_ahead()
    with pytest.raises(TrackingError, match=r"^the MLflow store nosuchscheme://store cannot be opened: "):
        bad.start("job", {})
    assert bad.run_id is None and bad.client is None


def test_a_new_store_from_the_cached_template_is_the_store_mlflow_makes(tmp_path, monkeypatch):
    """A new sqlite store starts as a copy of MLflow's migrated, empty tables, cached once per
    MLflow version: the result has the schema, revision and rows of a store MLflow made itself,
    and a template MLflow refuses is dropped and the store made its own way."""
    import sqlite3

    monkeypatch.chdir(tmp_path)  # the Default experiment's artifact folder: the same for both
    template = store_template.cached(tmp_path / "cache")
    assert template is not None and store_template.cached(tmp_path / "cache") == template
    store_template.open_new(tmp_path / "copied.db", template)
    MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'migrated.db'}").get_experiment("0")

    def contents(db):  # (a table's constraints come in a different order in every process
        # that makes it, MLflow's own stores too: each statement is compared as a set of lines)
        with sqlite3.connect(db) as c:
            schema = sorted((kind, name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))
                            for kind, name, sql in c.execute("SELECT type, name, sql FROM sqlite_master"))
            tables = [name for kind, name, _ in schema if kind == "table"]
            rows = {t: sorted(map(repr, c.execute(f'SELECT * FROM "{t}"'))) for t in tables}
        experiments = [e[:4] for e in map(eval, rows.pop("experiments"))]  # not the times
        return schema, rows, experiments

    copied, migrated = contents(tmp_path / "copied.db"), contents(tmp_path / "migrated.db")
    assert copied == migrated
    assert copied[2] == [(0, "Default", str(tmp_path / "mlruns" / "0"), "active")]

    template.write_bytes(b"not a database")  # damaged: MLflow's own way, and not used again
    store_template.open_new(tmp_path / "again.db", template)
    assert contents(tmp_path / "again.db") == migrated and not template.exists()


# -- live metrics, FLOPs, status -----------------------------------------------------------------

def test_metric_names_are_baton_s_and_exported_as_ray_names():
    from baton.tracking.metrics import METRICS, exported_names

    for name, m in METRICS.items():
        assert name.startswith("baton_") and not name.startswith("train_"), name
        assert m.labels[0] == "job_name" and m.kind in ("gauge", "counter", "histogram")
        assert (m.kind == "histogram") == bool(m.buckets)
    series = exported_names()
    assert series["ray_baton_failures_total"].labels == ("job_name", "cause")
    assert {"ray_baton_step_seconds_bucket", "ray_baton_step_seconds_sum",
            "ray_baton_step_seconds_count"} <= set(series)


def test_live_metrics_do_nothing_without_ray():
    import ray

    from baton.tracking.metrics import LiveMetrics

    assert not ray.is_initialized()
    live = LiveMetrics("job")
    live.step(step=1, loss=1.0, lr=0.1, tokens_per_s=1.0, samples_per_s=1.0, step_s=1.0,
              data_wait=None, mfu=None, bubble=None, memory={"host": 1 << 30})
    live.failure("actor_died", alive=1)
    assert live._m == {}


def test_flops_per_token_of_each_shipped_model_and_a_user_s():
    import torch

    from baton.models.flops import gpt_flops_per_token, job_peak_flops, model_flops_per_token
    from baton.spec import ModelSpec

    gpt = ModelSpec(name="gpt", layers=2, width=32, heads=2, seq_len=16, vocab_size=256)
    assert model_flops_per_token(gpt) == gpt_flops_per_token(2, 32, 16, 256)
    # the Llama-style model: 6 x its linear weights (q, k, v, o, gate, up, down, the head)
    # and the GPT's attention term, grouped key-value heads and all
    llama = ModelSpec(name="llama", layers=2, width=32, heads=4, seq_len=16, vocab_size=256,
                      options={"kv_heads": 2})
    model = __import__("baton.models", fromlist=["build_model"]).build_model(llama, 0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_token(llama) == 6 * linear + 12 * 2 * 32 * 16
    # heads wider than width / heads (Qwen3's): their width, 4 x 16, in the attention term
    wide = dataclasses.replace(llama, options={"kv_heads": 2, "head_dim": 16, "qk_norm": True})
    model = __import__("baton.models", fromlist=["build_model"]).build_model(wide, 0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_token(wide) == 6 * linear + 12 * 2 * 64 * 16
    # a mixture of 4 experts, 2 a token: the router's weights and 2 of the 4 experts' count
    moe = dataclasses.replace(llama, options={"kv_heads": 2, "experts": 4, "experts_per_token": 2})
    model = __import__("baton.models", fromlist=["build_model"]).build_model(moe, 0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert model_flops_per_token(moe) == 6 * (linear - experts / 2) + 12 * 2 * 32 * 16
    mlp = ModelSpec(name="mlp", layers=3, width=64, context=8, vocab_size=256)
    model = __import__("baton.models", fromlist=["build_model"]).build_model(mlp, 0)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model_flops_per_token(mlp) == 6 * linear
    user = ModelSpec(name="helpers:failing_gpt", layers=1, width=16, heads=2, seq_len=16,
                     options={"fail_on_sum": 1})  # a GPT in a user's builder: no attention term
    assert model_flops_per_token(user) == gpt_flops_per_token(1, 16, 16, 256) - 12 * 16 * 16
    assert job_peak_flops(["cpu", "cpu"], "fp32", None) is None
    assert job_peak_flops(["cpu", "cpu"], "fp32", 0.5) == 1e12
    assert job_peak_flops(["NVIDIA H100 80GB HBM3"], "bf16", None) == 989.4e12
    assert job_peak_flops(["NVIDIA H100 80GB HBM3", "Tesla T4"], "bf16", None) is None


def test_status_lines_say_when_the_process_is_gone(tmp_path):
    import os
    import socket
    import subprocess
    import time

    from baton import status
    from baton.checkpoint import CheckpointStore

    gone = subprocess.Popen(["true"])
    gone.wait()
    s = {"job": "j", "state": "running", "step": 3, "steps": 10, "dp": 2, "pp": 1,
         "world_size": 2, "workers_alive": 1, "loss": 2.5, "tokens_per_s": 1234.0,
         "last_checkpoint": None, "failures": 1, "failures_by_cause": {"hang": 1},
         "rescales": 0, "mlflow_run_id": "abc", "pid": gone.pid, "host": socket.gethostname(),
         "started_at": time.time() - 60, "updated_at": time.time() - 3}
    lines = status.describe(s)
    assert lines[0].startswith(f"j: running when last seen: its process (pid {gone.pid} on ")
    assert lines[1:5] == ["  step 3/10, loss 2.5000, 1,234 tokens/s",
                          "  world: dp 2 x pp 1 = 2 workers, 1 alive",
                          "  last checkpoint: none yet", "  failures: 1 (hang 1); rescales: 0"]
    assert status.describe({**s, "pid": os.getpid()})[0].startswith("j: running (updated 3 s ago")
    # elastic.recovery continue, after a loss: the survivor trains on while its replacement starts
    assert status.describe({**s, "dp": 1, "world_size": 1, "workers_starting": 1})[2] == (
        "  world: dp 1 x pp 1 = 1 worker, 1 alive; 1 more starting, to grow into")
    assert status.describe({**s, "spares": 2})[2] == "  world: dp 2 x pp 1 = 2 workers, 1 alive; 2 spares"
    queued = {**s, "state": "queued", "pid": os.getpid(), "in_line": {
        "since": time.time() - 150, "ahead": [f"j{i}" for i in range(11)], "room_held_by": ["big"]}}
    assert status.describe(queued)[4] == "  in line for room for 2 min: 12th, behind " + ", ".join(
        f"j{i}" for i in range(11)) + "; held by big"
    assert status.place_in_line(["a", "b"], []) == "3rd, behind a, b"
    assert status.place_in_line([], ["x", "y"]) == "first; held by x, y"
    assert status.brief(queued) == "queued, 12th in line"
    waiting = {**s, "state": "queued", "quota_wait": {"quota": "team", "room": {"CPU": 4.0, "GPU": 1.0},
                                                     "held_by": ["a", "b"]}}
    assert status.brief(waiting) == "queued, waiting for quota team"
    assert "  waiting for room within quota team (4 CPU, 1 GPU): held by a, b" in status.describe(waiting)
    assert status.quota_held("team", {"CPU": None, "GPU": 2.0}, []) == "quota team (2 GPU)"
    assert status.brief(s) == "running, step 3/10, dp 2"
    assert status.brief({**s, "state": "suspended"}) == "suspended at step 3"
    assert status.brief({**s, "state": "finished", "step": 10}) == "finished, step 10/10"
    # room lent out of turn, claimed back (resources.priority's lines are the integration tests')
    said = status.describe({**s, "lent_by": ["big"]})
    assert status.brief({**s, "lent_by": ["big"]}) == "running, step 3/10, dp 2, out of turn"
    assert "  out of turn: on room lent by big (ahead of it in line), given back when it can start" in said
    assert "  out of turn: on room lent by a, b (ahead of it in line), given back when one of them " \
        "can start" in status.describe({**s, "lent_by": ["a", "b"]})
    suspended = {**s, "state": "suspended", "max_dp": 0, "max_dp_by": "line: big"}
    assert "  suspended at step 3: its workers given back to job big, ahead of it in line; it goes " \
        "on from there when its turn comes" in status.describe(suspended)
    assert "  at most 1 replica (room given back to job big, ahead of it in line, until it has " \
        "started)" in status.describe({**suspended, "state": "running", "max_dp": 1})
    # held no more (the claim lapsed, or its job ended): in line, not by baton scale
    assert "  suspended at step 3: it goes on from there when its turn in line comes" in \
        status.describe({**s, "state": "suspended"})
    lag = {"rank": 1, "node": "9c4dce4247f6ddada74a", "pid": 3573, "ratio": 2.5,
           "compute_s": 0.25, "peers_s": 0.1}
    assert status.describe({**s, "best_checkpoint": {"step": 350, "eval_loss": 0.14031}})[4] == (
        "  best checkpoint: step 350, eval_loss 0.1403")
    assert status.describe({**s, "straggler": lag})[3] == (
        "  straggler: rank 1 (node 9c4dce4247f6, pid 3573) computes 2.5x as long as its peers "
        "(0.250 s a step against 0.100 s)")
    store = CheckpointStore(str(tmp_path / "ckpt" / "j"))
    store.write_status(s)
    assert status.local("j", str(tmp_path / "ckpt")) == s and store.committed_steps() == []
    assert status.local("other", str(tmp_path / "ckpt")) is None


def test_baton_status_of_a_job_file_that_never_ran_is_one_line(tmp_path, monkeypatch, capsys):
    """`baton status job.yaml` before the job has run looked for a cluster job named
    "job.yaml" and then named the default checkpoints/ folder, not the file's own."""
    from baton import cli
    from helpers import tiny_spec, write_spec

    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, tmp_path / "data", name="never"))
    assert cli.main(["status", str(job)]) == 2
    assert capsys.readouterr().err.strip() == (f"baton: error: {job}: no status in "
                                               f"{tmp_path / 'ckpt' / 'never'}: the job has not "
                                               "started there yet")


def test_baton_status_says_when_tracking_is_degraded():
    from baton import status

    s = {"job": "j", "state": "running", "updated_at": __import__("time").time(), "pid": 1,
         "host": "elsewhere", "step": 3, "steps": 9, "dp": 2, "pp": 1, "world_size": 2,
         "workers_alive": 2, "last_checkpoint": None, "failures": 0, "failures_by_cause": {},
         "rescales": 0, "mlflow_run_id": "abc", "tracking": "ok"}
    assert status.describe(s)[-1] == "  MLflow run: abc"
    s["tracking"] = "degraded since 10:01:02, 12 metric values waiting"
    assert status.describe(s)[-1] == "  MLflow run: abc (tracking degraded since 10:01:02, 12 metric values waiting)"


def test_each_step_reports_its_largest_workers_memory(tmp_path):
    """Every worker's step reports what it holds; the step's metrics carry the largest (the
    worker that runs out first), and `baton status` shows it."""
    import os

    import psutil

    from baton import status
    from baton.coordinator.steps import StepStats
    from baton.spec import spec_from_dict
    from baton.workers.host import resident_bytes
    from helpers import tiny_spec

    # the reader against psutil's, a few allocations apart in this process: equal on Linux
    # (both read /proc/self/statm's resident pages; measured: 347,611,136 bytes each); 64 MiB
    # apart would be a wrong unit or field
    assert abs(resident_bytes() - psutil.Process(os.getpid()).memory_info().rss) < 64 << 20
    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path))
    stats = StepStats(spec)

    def result(**memory):
        return {"tokens": 100, "loss_sum": 250.0, "grad_norm": 1.0, "memory": memory}

    cpu = stats.measure(1, [result(host=300 << 20), result(host=500 << 20)], 0.5, 8, 1e-3, 0,
                        spec.dims())
    assert cpu["host_memory_mib"] == 500 and "device_memory_peak_mib" not in cpu
    gpu = stats.measure(2, [result(host=900 << 20, device=7 << 30), result(host=800 << 20, device=6 << 30)],
                        0.5, 8, 1e-3, 0, spec.dims())
    assert (gpu["host_memory_mib"], gpu["device_memory_peak_mib"]) == (900, 7 << 10)
    assert stats.memory == {"host": 900 << 20, "device": 7 << 30}
    s = {"job": "j", "state": "running", "updated_at": __import__("time").time(), "pid": 1,
         "host": "elsewhere", "step": 3, "steps": 9, "dp": 2, "pp": 1, "world_size": 2,
         "workers_alive": 2, "last_checkpoint": None, "failures": 0, "failures_by_cause": {},
         "rescales": 0, "memory_mib": {"host": 900, "device": 7168}}
    assert status.describe(s)[3] == "  memory of the largest worker: host 900 MiB, device peak 7,168 MiB"
    assert "memory" not in "".join(status.describe({**s, "memory_mib": {}}))  # before the first step


def test_steps_whose_gradient_is_not_finite_are_skipped_up_to_the_limit_in_a_row(tmp_path):
    """train.skip_nonfinite: 2: a step the workers skipped is measured with a `skipped` metric
    and its NaN loss kept from the run's last loss; a finite step between resets the count;
    the third skipped step in a row fails the run in one line; `baton status` lists them.
    Without it a NaN loss fails at once, saying what to set."""
    import math

    from baton import status
    from baton.coordinator.steps import StepStats
    from baton.errors import WorkerError
    from baton.spec import spec_from_dict
    from helpers import tiny_spec

    def result(loss, skipped=False):
        return {"tokens": 10, "loss_sum": loss * 10, "grad_norm": 1.0 if math.isfinite(loss) else float("nan"),
                **({"skipped": True} if skipped else {})}

    base = tiny_spec(tmp_path, tmp_path)
    spec = spec_from_dict({**base, "train": {**base["train"], "skip_nonfinite": 2}})
    stats, dims = StepStats(spec), spec.dims()
    steps = [result(2.0), result(math.nan, True), result(math.nan, True), result(1.5),
             result(math.nan, True), result(math.nan, True)]
    measured = [stats.measure(k, [r], 0.1, 4, 1e-3, 0, dims) for k, r in enumerate(steps, 1)]
    assert [m.get("skipped") for m in measured] == [None, 1, 1, None, 1, 1]
    assert stats.last_loss == 1.5 and stats.skipped == [2, 3, 5, 6]
    with pytest.raises(WorkerError, match=r"^the gradient is nan at step 7, 3 steps in a row, more than "
                                          r"train.skip_nonfinite \(2\) skips; lower train.lr"):
        stats.measure(7, [result(math.nan, True)], 0.1, 4, 1e-3, 0, dims)
    s = {"job": "j", "state": "running", "updated_at": __import__("time").time(), "pid": 1,
         "host": "elsewhere", "step": 6, "steps": 9, "dp": 2, "pp": 1, "world_size": 2,
         "workers_alive": 2, "last_checkpoint": None, "failures": 0, "failures_by_cause": {},
         "rescales": 0, "skipped_steps": [2, 3, 5, 6, 8, 9]}
    assert "  updates skipped (gradient not finite): 6, at steps ..., 3, 5, 6, 8, 9" in status.describe(s)
    with pytest.raises(WorkerError, match=r"the loss is nan at step 1; .* or skip such steps \(train.skip_nonfinite\)"):
        StepStats(spec_from_dict(base)).measure(1, [result(math.nan)], 0.1, 4, 1e-3, 0, dims)


def test_a_loss_spike_is_judged_against_the_median_of_the_steps_before_it(tmp_path):
    """train.rewind_on_spike {factor: 3, window: 3, most: 2}: no finite loss is judged before
    the window is full (100 at step 2 is not a spike); then one above 3x the median of the
    last 3 steps is, and a loss that is not a number is at once; a spike's loss stays out of
    the window, a rewind keeps the window's losses up to the step gone back to, and the third
    spike fails the run in one line. With the rule, a NaN loss is measured (the coordinator
    rewinds from it) instead of failing the run; `baton status` lists the spikes. A
    checkpoint keeps the window, so a run resumed from it judges its first step."""
    import math

    from baton import status
    from baton.coordinator.spikes import Spikes, describe
    from baton.coordinator.steps import StepStats
    from baton.errors import WorkerError
    from baton.spec import SpikeRewind, spec_from_dict
    from helpers import tiny_spec

    rule = SpikeRewind(factor=3.0, window=3, most=2)
    spikes = Spikes(rule)
    assert spikes.judge(1, math.inf) == {"step": 1, "loss": "inf", "median": None, "window": 0}
    assert [spikes.judge(k, x) for k, x in [(1, 4.0), (2, 100.0), (3, 2.0)]] == [None] * 3
    spike = spikes.judge(4, 12.5)  # the window [4, 100, 2]: its median 4
    assert spike == {"step": 4, "loss": 12.5, "median": 4.0, "window": 3}
    assert describe(spike, rule) == ("the loss 12.5, 3.1x the median 4 of the 3 steps before "
                                     "(train.rewind_on_spike.factor: 3)")
    assert spikes.judge(4, 11.9) is None  # (the spike stayed out): now [100, 2, 11.9]
    assert spikes.judge(5, 30.0) is None and spikes.judge(6, 36.0)["median"] == 11.9
    spikes.rewinding(spike)
    saved = spikes.state_dict()  # a checkpoint of step 5
    spikes.load_state_dict(None, 3)  # back to checkpoint 3 (written without the window): of
    assert spikes.losses == [(3, 2.0)] and spikes.rewinds == [4]  # steps 3 to 5, step 3 stays
    resumed = Spikes(rule)
    resumed.load_state_dict(saved, 5)  # a run resumed from checkpoint 5 judges at once
    assert resumed.judge(6, 36.0)["median"] == 11.9
    assert spikes.judge(4, math.nan)["loss"] == "nan"
    spikes.rewinding({"step": 4, "loss": "nan", "median": None, "window": 2})
    with pytest.raises(WorkerError, match=(
            r"^the loss spiked at step 9: the loss 50, 4.2x the median 12 of the 3 steps before "
            r"\(train.rewind_on_spike.factor: 3\); 3 spikes in this run \(at steps 4, 4, 9\), more "
            r"than train.rewind_on_spike.most \(2\) rewinds; lower train.lr")):
        spikes.rewinding({"step": 9, "loss": 50.0, "median": 12.0, "window": 3})
    base = tiny_spec(tmp_path, tmp_path)
    spec = spec_from_dict({**base, "train": {**base["train"], "rewind_on_spike": {}}})
    nan = {"tokens": 10, "loss_sum": math.nan, "grad_norm": math.nan}
    assert math.isnan(StepStats(spec).measure(1, [nan], 0.1, 4, 1e-3, 0, spec.dims())["loss"])
    s = {"job": "j", "state": "running", "updated_at": __import__("time").time(), "pid": 1,
         "host": "elsewhere", "step": 6, "steps": 9, "dp": 2, "pp": 1, "world_size": 2,
         "workers_alive": 2, "last_checkpoint": None, "failures": 0, "failures_by_cause": {},
         "rescales": 0, "spikes": [4, 7]}
    assert "  loss spikes rewound from: 2, at steps 4, 7" in status.describe(s)
