"""What a run ends with: `Coordinator.run()`'s result, which `baton.run` and the CLI return."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RunResult:
    job: str
    state: str
    step: int
    loss: float
    run_id: Optional[str]
    checkpoint: Optional[str]
    resumed_from: Optional[int]
    tokens_per_s: float  # median over the second half of the steps (past warm-up)
    step_times_s: list[float] = field(default_factory=list)  # this process's steps only
    workers: list[dict] = field(default_factory=list)  # rank, device, pid, node of each worker
    replica_digests: list[str] = field(default_factory=list)
    ledger: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (step, rank, ids)
    stage_layers: Optional[list[int]] = None  # layers per pipeline stage
    bubbles: list[float] = field(default_factory=list)  # measured idle fraction per step
    trace: Optional[dict] = None  # the traced step's timeline: {"step", "lanes"}
    pipeline_peaks: list[dict] = field(default_factory=list)  # per rank: activation_bytes, live
    events: list[dict] = field(default_factory=list)  # failures, recoveries, rescales
    dp_history: list[tuple[int, int]] = field(default_factory=list)  # (from step, dp)
    # per worker, at the first step of the last world: bytes of parameters, gradients and
    # optimizer state it holds
    state_bytes: list[dict] = field(default_factory=list)
    # the start: seconds from the run's start to its first step, by phase (data: the manifest
    # and the first batch's rows; tracking: the MLflow run; workers: waiting for their
    # processes; form: the process group and the models; load: a checkpoint; first_step)
    start: dict = field(default_factory=dict)
    eval: dict = field(default_factory=dict)  # the last evaluation's metrics (eval_loss, ...)
    best: Optional[tuple[int, float]] = None  # checkpoint.best's checkpoint: (step, its value)
    # eval.patience ended the run before train.steps: the step, the metric's best value and
    # step, the evaluations waited, and why in words
    stopped_early: Optional[dict] = None
    tracking_uri: Optional[str] = None  # the MLflow store the run is in

    def history(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of a metric the run logged to MLflow ("loss", "eval_accuracy", ...)."""
        from mlflow.tracking import MlflowClient

        if self.run_id is None:
            return []
        client = MlflowClient(self.tracking_uri)
        return sorted((m.step, m.value) for m in client.get_metric_history(self.run_id, key))
