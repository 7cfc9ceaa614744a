"""Early stopping (`eval.patience`), for the coordinator: after each held-out evaluation, has
checkpoint.best's metric improved by more than `eval.min_delta` on the best value so far? After
`patience` evaluations in a row that have not, the run ends at that step.

Its state after a step is part of that step's checkpoint (`meta.json`'s `early_stop`): a run
sent back to a checkpoint counts again from there, so a recovered run stops where an
uninterrupted one does, and a job that stopped early is not trained on by running it again
unless its patience is raised (`api.finished_why`)."""

from __future__ import annotations

import math
from typing import Optional

from baton.spec import JobSpec


class EarlyStop:
    def __init__(self, metric: str, lowest: bool, patience: int, min_delta: float):
        self.metric, self.lowest, self.patience, self.min_delta = metric, lowest, patience, min_delta
        self.best: Optional[float] = None  # the value the last improvement reached
        self.best_step = 0
        self.waited = 0  # evaluations since then that did not improve on it by min_delta
        self.warned = False

    def observe(self, step: int, evaluated: dict) -> bool:
        """Count one evaluation; True when the run stops at `step`. A pass that did not report
        the metric (a task of your own that lacks it) or reported NaN is said once and not
        counted: nothing is judged from it."""
        value = evaluated.get(self.metric)
        if value is None or math.isnan(value):
            if not self.warned:
                self.warned = True
                print(f"warning: eval.patience watches {self.metric}, which the evaluation after "
                      f"step {step} did not report (or reported NaN): the run does not stop early "
                      "on it", flush=True)
            return False
        gain = (self.best - value if self.lowest else value - self.best) if self.best is not None else math.inf
        if gain > self.min_delta:
            self.best, self.best_step, self.waited = value, step, 0
        else:
            self.waited += 1
        return self.stopped

    @property
    def stopped(self) -> bool:
        return self.waited >= self.patience

    def ended(self, step: int) -> Optional[dict]:
        """The record of a run that stops at `step` (RunResult.stopped_early), or None."""
        return {"step": step, **self.state_dict(), "why": self.why()} if self.stopped else None

    def why(self) -> str:
        return (f"{self.metric} has not improved on {self.best:.6g} (step {self.best_step}) by more "
                f"than {self.min_delta:g} in {self.waited} evaluation{'s' * (self.waited != 1)} "
                f"(eval.patience {self.patience})")

    def state_dict(self) -> dict:
        """What a checkpoint of this step records."""
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step,
                "waited": self.waited}

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Back to a checkpoint's count (none recorded, or another metric's: from the start)."""
        if not state or state.get("metric") != self.metric:
            state = {}
        self.best, self.best_step = state.get("best"), state.get("best_step", 0)
        self.waited = state.get("waited", 0)


def early_stop(spec: JobSpec) -> Optional[EarlyStop]:
    c, e = spec.checkpoint, spec.eval
    return EarlyStop(c.best, c.best_lowest, e.patience, e.min_delta) if e.patience else None


def stopped_before(spec: JobSpec, meta: dict) -> Optional[str]:
    """Why the job a checkpoint belongs to already stopped early under `spec`'s patience, or
    None (no patience, or not yet spent)."""
    stop = early_stop(spec)
    if stop is None:
        return None
    stop.load_state_dict(meta.get("early_stop"))
    return stop.why() if stop.best is not None and stop.stopped else None
