"""The MLflow tracker: a resumed run logs every step once, however late the crash came."""

from __future__ import annotations

from mlflow.tracking import MlflowClient

from baton.spec import TrackingSpec
from baton.tracking import MLflowTracker, NullTracker


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


def test_nothing_is_written_before_start(tmp_path):
    spec = TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    tracker = MLflowTracker(spec)
    tracker.set_tags({"error": "boom"})  # a failure before the run existed
    tracker.finish("FAILED")
    assert not (tmp_path / "mlflow.db").exists()
    NullTracker().finish("FINISHED")
