"""The coordinator owns a run: a state machine that makes one transition per `tick()`.

    pending --(data in the object store, MLflow run open)--> scheduling
    scheduling --(workers placed, group formed, checkpoint loaded)--> running
    running --(one optimizer step; a checkpoint when due)--> running | finished
    any --(an error)--> failed

It decides (which samples, which learning rate, when to checkpoint); the workers execute. It is
the only writer to MLflow. Recovering and rescaling states arrive with the elastic work.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import ray

from baton import __version__
from baton.checkpoint import CheckpointStore
from baton.data import Cursor, EpochOrder
from baton.data.source import load_table
from baton.errors import WorkerError
from baton.parallel import ParallelDims
from baton.progress import Progress
from baton.spec import JobSpec
from baton.training import lr_at
from baton.workers import WorkerGroup


class State(enum.Enum):
    PENDING = "pending"
    SCHEDULING = "scheduling"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


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


class Coordinator:
    def __init__(self, spec: JobSpec, tracker, *, resume_meta: Optional[dict] = None,
                 record_samples: bool = False, show_progress: bool = True):
        self.spec = spec
        self.tracker = tracker
        self.dims = ParallelDims(spec.parallel.dp, spec.parallel.pp)
        self.store = CheckpointStore(spec.checkpoint_dir)
        self.resume_meta = resume_meta
        self.record_samples = record_samples
        self.show_progress = show_progress
        self.state = State.PENDING
        self.step = 0
        self.cursor = Cursor()
        self.group: Optional[WorkerGroup] = None
        self.last_loss = float("nan")
        self.last_checkpoint: Optional[str] = None
        self.tokens_per_s: list[float] = []
        self.step_times_s: list[float] = []
        self.workers: list[dict] = []
        self.ledger: list = []

    def run(self) -> RunResult:
        try:
            while self.state not in (State.FINISHED, State.FAILED):
                self.tick()
        except BaseException as e:
            self.state = State.FAILED
            self.tracker.set_tags({"error": f"{type(e).__name__}: {e}"[:5000], "failed_at_step": self.step})
            self.tracker.finish("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            if self.group is not None:
                self.group.shutdown()
        return self._result()

    def tick(self) -> None:
        handler = {State.PENDING: self._prepare, State.SCHEDULING: self._schedule,
                   State.RUNNING: self._run_step}[self.state]
        self.state = handler()

    # -- transitions --------------------------------------------------------------------------

    def _prepare(self) -> State:
        table = load_table(self.spec)
        self.table_ref = ray.put({"ids": table.ids, "tokens": table.tokens})
        self.order = EpochOrder(len(table), self.spec.train.seed)
        self.num_samples = len(table)
        meta = self.resume_meta
        if meta:
            self.step = meta["step"]
            self.cursor.load_state_dict(meta["cursor"])
        run_id = self.tracker.start(self.spec.name, self.spec.flat(),
                                    run_id=meta.get("mlflow_run_id") if meta else None)
        self.tracker.set_tags({"baton.version": __version__, "spec.fingerprint": self.spec.fingerprint(),
                               "data.samples": self.num_samples, "checkpoint.dir": self.spec.checkpoint_dir,
                               **({"resumed_from_step": self.step} if meta else {})})
        self.run_id = run_id
        return State.SCHEDULING

    def _schedule(self) -> State:
        self.group = WorkerGroup(self.spec, self.dims)
        self.workers = self.group.start(self.table_ref, self.record_samples)
        if self.resume_meta:
            same_layout = self.resume_meta["layout"] == self._layout()
            self.group.call("load", self.store.root, self.step, same_layout, what="loading the checkpoint")
        self.progress = Progress(self.spec.train.steps, start=self.step, enabled=self.show_progress)
        return State.RUNNING

    def _run_step(self) -> State:
        t = self.spec.train
        if self.step >= t.steps:
            if self.last_checkpoint is None or not self.last_checkpoint.endswith(f"{self.step:08d}"):
                self._checkpoint()
            self.tracker.finish("FINISHED")
            return State.FINISHED
        batch = self.order.next_batch(self.cursor, t.global_batch)
        lr = lr_at(self.step, t)
        t0 = time.perf_counter()
        results = self.group.call("train_step", self.step, batch, lr, what=f"training step {self.step}")
        step_time_s = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in results)
        self.last_loss = sum(r["loss_sum"] for r in results) / tokens
        self.step += 1
        tps = tokens / step_time_s
        self.tokens_per_s.append(tps)
        self.step_times_s.append(step_time_s)
        self.tracker.log_metrics(self.step, {
            "loss": self.last_loss, "lr": lr, "grad_norm": results[0]["grad_norm"],
            "tokens_per_s": tps, "samples_per_s": len(batch) / step_time_s,
            "step_time_s": step_time_s, "epoch": self.cursor.epoch, "world_size": self.dims.world_size})
        self.progress.update(self.step, self.last_loss, tps)
        if self.record_samples:
            self._collect_ledger()
        if self.step % self.spec.checkpoint.every_steps == 0 and self.step < t.steps:
            self._checkpoint()
        return State.RUNNING

    # -- helpers ------------------------------------------------------------------------------

    def _layout(self) -> dict:
        return {"dp": self.dims.dp, "pp": self.dims.pp}

    def _checkpoint(self) -> None:
        self.store.begin(self.step)
        self.group.call("save", self.store.root, self.step, what=f"saving checkpoint {self.step}")
        digests = self.group.call("digest")
        if len(set(digests)) != 1:  # an invariant of data parallelism: worth the milliseconds
            raise WorkerError(f"replicas diverged at step {self.step}: parameter digests {digests}")
        self.replica_digests = digests
        meta = {"job": self.spec.name, "step": self.step, "cursor": self.cursor.state_dict(),
                "fingerprint": self.spec.fingerprint(), "layout": self._layout(),
                "mlflow_run_id": self.run_id, "tracking_uri": self.tracker.uri,
                "schedule": {"step": self.step, "next_lr": lr_at(self.step, self.spec.train)},
                "rng": [f"rng-rank{r:04d}.pt" for r in range(self.dims.world_size)],
                "loss": self.last_loss, "baton_version": __version__, "time": time.time()}
        self.last_checkpoint = self.store.commit(self.step, meta, self.spec.checkpoint.keep)
        self.tracker.set_tags({"checkpoint.latest": self.last_checkpoint})
        self.tracker.flush()

    def _collect_ledger(self) -> None:
        for rank, entries in enumerate(self.group.call("take_ledger")):
            self.ledger += [(step, rank, ids) for step, ids in entries]

    def _result(self) -> RunResult:
        recent = self.tokens_per_s[len(self.tokens_per_s) // 2:]  # past the warm-up steps
        return RunResult(job=self.spec.name, state=self.state.value, step=self.step,
                         loss=self.last_loss, run_id=self.run_id, checkpoint=self.last_checkpoint,
                         resumed_from=self.resume_meta["step"] if self.resume_meta else None,
                         tokens_per_s=float(np.median(recent)) if recent else 0.0,
                         step_times_s=self.step_times_s, workers=self.workers,
                         replica_digests=getattr(self, "replica_digests", []), ledger=self.ledger)
