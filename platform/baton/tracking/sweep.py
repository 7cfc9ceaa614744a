"""A sweep's own MLflow run: its trials' runs nested under it (MLflow's `mlflow.parentRunId`
tag, as Ray Tune's and Optuna's MLflow integrations nest theirs), its settings as params, and
at its end the ranking (`sweep.json`: each trial's values, bracket, state, step, metric and
run) and the best trial's name, run and metric. Run again, a sweep finds its run by its
settings' digest (`baton.sweep`) and goes on in it. Written from the sweep's thread only,
through an `MLflowTracker` of the job's `tracking` section: a store that goes away degrades
it as it does a run, and never stops the trials."""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Callable, Optional

from baton import __version__
from baton.spec import JobSpec
from baton.sweeps import rank, ranked_by
from baton.tracking.mlflow_tracker import make_tracker

TAG = "baton.sweep"  # the settings' digest, on the sweep's run
PARENT = "mlflow.parentRunId"  # on each trial's run: the UI nests it under the sweep's


class SweepRun:
    """`open()` before the first trial (its run id, or None where tracking is off), `tags()`
    for each trial's run, `close(trials, status)` at the end."""

    def __init__(self, base: JobSpec, settings: dict):
        self.base, self.settings = base, settings
        self.tracker = make_tracker(base.tracking)
        text = json.dumps({"job": base.name, **settings}, sort_keys=True, default=str)
        self.digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        self.run_id: Optional[str] = None

    def open(self) -> Optional[str]:
        if not self.base.tracking.enabled:
            return None
        self.tracker.open_ahead()  # (a new sqlite store's tables from the cached copy)
        try:
            found = self.tracker.find(TAG, self.digest)
            self.run_id = self.tracker.start(f"{self.base.name}-sweep", _params(self.settings), run_id=found)
        finally:
            self.tracker.drop_ahead()
        self.tracker.set_tags({TAG: self.digest, "metric": ranked_by(self.base)[0],
                               "baton.version": __version__})
        return self.run_id

    def tags(self) -> dict:
        return {PARENT: self.run_id} if self.run_id else {}

    @contextlib.contextmanager
    def recording(self, trials: Callable[[], list]):
        """The sweep, its run closed at its end with `trials()` (those handed out so far):
        FINISHED, or KILLED (Ctrl-C, SIGTERM) or FAILED."""
        status = "FAILED"
        try:
            yield
            status = "FINISHED"
        except KeyboardInterrupt:
            status = "KILLED"
            raise
        finally:
            self.close(trials(), status)

    def close(self, trials: list, status: str = "FINISHED") -> None:
        if not self.run_id:
            return
        metric, lowest = ranked_by(self.base)
        ranked = rank(trials, metric, lowest)
        self.tracker.log_dict({"metric": metric, "trials": [
            {"name": t.name, "values": t.values, **({"bracket": t.bracket} if t.bracket else {}),
             "state": t.state, "step": t.step, metric: t.metric, "run_id": t.run_id}
            for t in ranked]}, "sweep.json")
        best = next((t for t in ranked if t.metric is not None), None)
        if best is not None:
            self.tracker.set_tags({"best_trial": best.name, "best_run_id": best.run_id or ""})
            self.tracker.log_metrics(0, {f"best_{metric}": best.metric}, replayed_ok=True)
        self.tracker.finish(status)  # (its picture: report.build_sweep)


def _params(settings: dict) -> dict:
    """The sweep's settings as MLflow params: each axis as given (a list, a range), the rest
    as set (unset ones left out)."""
    axes = {f"axis.{key}": values for key, values in settings["axes"].items()}
    return {**axes, **{k: v for k, v in settings.items() if k != "axes" and v not in (None, [], ())}}
