"""MLflow: one run per job, written only by the coordinator.

Metrics are buffered and sent in batches (one batch call instead of one call per value:
MLflow's own advice, and 35x faster on sqlite). The buffer is flushed before every checkpoint
commit, at the end, and at most every `tracking.flush_every_s` seconds. A resumed run replays
the steps after its checkpoint; those already logged are skipped, so every step is logged once.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

from baton import interrupts, storage
from baton.spec import TrackingSpec
from baton.storage import redact

MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch call
STEP_METRIC = "loss"  # logged at every step: its last step says how far a run's record goes


def default_uri() -> str:
    """$MLFLOW_TRACKING_URI, else a sqlite store in the working directory, or in $BATON_STORAGE
    when set (MLflow 3's default backend; an absolute sqlite path takes four slashes)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{storage.local_path('mlflow.db')}"


def _artifact_root(uri: str, experiment: str) -> Optional[str]:
    """Beside a sqlite store, artifacts go to mlartifacts/ next to the database file (not to
    whatever the working directory is); other stores keep their server's default."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):]).resolve()
    return (db.parent / "mlartifacts" / experiment).as_uri()


def _shielded(method):
    """A write to the store that Ctrl-C or SIGTERM does not cut in half (interrupts.py)."""
    @functools.wraps(method)
    def write(*args, **kwargs):
        with interrupts.shielded():
            return method(*args, **kwargs)
    return write


class MLflowTracker:
    """Nothing touches the store before `start`; after a failure earlier than that, every
    other method is a no-op, so the error that stopped the run is the one the user sees.
    Every write is shielded from interrupts."""

    def __init__(self, spec: TrackingSpec):
        self.uri = spec.uri or default_uri()
        self.client = None
        self.experiment = spec.experiment
        self.flush_every_s = spec.flush_every_s
        self.run_id: Optional[str] = None
        self._buffer: list = []
        self._last_flush = time.monotonic()
        self._logged_through = 0  # steps up to this one are already in the run

    @_shielded
    def start(self, run_name: str, params: dict[str, Any], run_id: Optional[str] = None) -> str:
        """Open a new run, or continue `run_id` (a resumed job keeps its run)."""
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            run = self.client.get_run(run_id)
            self.client.update_run(run_id, status="RUNNING")
            known = run.data.params
            logged = self.client.get_metric_history(run_id, STEP_METRIC)
            self._logged_through = max((m.step for m in logged), default=0)
        else:
            exp = self.client.get_experiment_by_name(self.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                self.experiment, artifact_location=_artifact_root(self.uri, self.experiment))
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            known = {}
        self.run_id = run_id
        self._log_params(params, known)
        return run_id

    def _log_params(self, params: dict[str, Any], known: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        new, changed = [], []
        for k, v in params.items():
            text = redact(str(v))[:6000]  # a URI's credentials are never recorded
            if k not in known:
                new.append(Param(k, text))
            elif known[k] != text:  # params are immutable in MLflow: record the change as a tag
                changed.append(RunTag(f"resumed_with.{k}", text))
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def log_metrics(self, step: int, metrics: dict[str, float], *, replayed_ok: bool = False) -> None:
        """Per-step metrics, once per step: a step replayed after a resume or a recovery keeps
        the values of its first run. `replayed_ok` logs anyway (events at a replayed step)."""
        from mlflow.entities import Metric

        if step <= self._logged_through and not replayed_ok:
            return
        self._logged_through = max(self._logged_through, step)
        now = int(time.time() * 1000)
        self._buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    @_shielded
    def flush(self) -> None:
        if not self.run_id:
            return
        for i in range(0, len(self._buffer), MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=self._buffer[i:i + MAX_BATCH])
        self._buffer = []
        self._last_flush = time.monotonic()

    @_shielded
    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        if not self.run_id:
            return
        self.client.log_batch(self.run_id, tags=[RunTag(k, redact(str(v))) for k, v in tags.items()])

    @_shielded
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        if self.run_id:
            self.client.log_artifacts(self.run_id, local_dir, artifact_path)

    @_shielded
    def log_dict(self, obj: Any, artifact_file: str) -> None:
        if self.run_id:
            self.client.log_dict(self.run_id, redact(obj), artifact_file)

    @_shielded
    def finish(self, status: str) -> None:
        """status: FINISHED, FAILED or KILLED. The run's pictures (`baton report`) go in first
        as report/ artifacts; a report that cannot be drawn is a warning, never the error."""
        if self.run_id:
            self.flush()
            from baton.tracking import report

            try:
                report.log_to_run(self.client, self.run_id)
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more
                print(f"baton: warning: no report for MLflow run {self.run_id}: "
                      f"{type(e).__name__}: {e}", file=sys.stderr)
            self.client.set_terminated(self.run_id, status=status)


class NullTracker:
    """Stands in when tracking is off, so the training loop has no `if tracker:` branches."""

    uri = None
    run_id = None

    def start(self, run_name: str, params: dict, run_id: Optional[str] = None) -> Optional[str]:
        return None

    def log_metrics(self, step: int, metrics: dict, *, replayed_ok: bool = False) -> None: ...
    def flush(self) -> None: ...
    def set_tags(self, tags: dict) -> None: ...
    def log_artifacts(self, local_dir: str, artifact_path: str) -> None: ...
    def log_dict(self, obj, artifact_file: str) -> None: ...
    def finish(self, status: str) -> None: ...


def make_tracker(spec: TrackingSpec):
    return MLflowTracker(spec) if spec.enabled else NullTracker()
