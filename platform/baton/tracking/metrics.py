"""Live metrics: every name and label set baton exports, in one place.

They go out through `ray.util.metrics`, which Ray serves as Prometheus text on each node's
metrics port with a `ray_` prefix (a counter also gains `_total`, a histogram `_bucket`, `_sum`
and `_count`). The dashboards in `dashboards/` query exactly `exported()` names; a test scrapes
a real run and finds each of them. The `train_` prefix is Ray Train's, so ours is `baton_`.

Every series carries `job_name` (the job's name; Prometheus keeps `job` for its scrape job).
Only the coordinator emits them, from the driver process of the run. The `baton_rank_*`
series are a worker's each, labelled by its `rank` and `node` (its IP); they are removed when
the world they belong to is re-formed (`LiveMetrics.world`), so a shrunk world shows only
the ranks it has.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Optional

JOB = ("job_name",)
RANK = JOB + ("rank", "node")
# the MLflow metric of each kind of baton_worker_memory_bytes, in MiB, and how it is shown
MEMORY_MIB = {"host": "host_memory_mib", "device": "device_memory_peak_mib"}
MEMORY_LABEL = {"host": "host", "device": "device peak"}
SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Every gauge is set again this often. Ray 2.60 drops a gauge's series that was not set for a
# while (measured: gone from the scrape 20-30 s after it was set once, at Ray's default of an
# export every 10 s; 20 s at one a second), so a step, a checkpoint's load or a wait longer
# than that left the dashboards without the job until the next step.
REFRESH_S = 5.0


@dataclass(frozen=True)
class Metric:
    name: str  # as registered with Ray; exported as ray_<name>
    kind: str  # gauge, counter or histogram
    help: str
    labels: tuple[str, ...] = JOB
    buckets: tuple[float, ...] = ()

    def exported(self) -> list[str]:
        base = f"ray_{self.name}"
        if self.kind == "counter":
            return [f"{base}_total"]
        if self.kind == "histogram":
            return [f"{base}_bucket", f"{base}_sum", f"{base}_count"]
        return [base]


METRICS = {m.name: m for m in [
    Metric("baton_step", "gauge", "Optimizer steps completed"),
    Metric("baton_tokens_per_second", "gauge", "Training tokens per second, whole job"),
    Metric("baton_samples_per_second", "gauge", "Training samples (sequences) per second"),
    Metric("baton_step_seconds", "histogram", "Wall time of an optimizer step", buckets=SECONDS),
    Metric("baton_loss", "gauge", "Mean training loss of the last step"),
    Metric("baton_learning_rate", "gauge", "Learning rate of the last step"),
    Metric("baton_mfu", "gauge", "Model FLOPs utilisation: model FLOPs per second over the "
                                 "workers' peak (absent on CPU unless tracking.cpu_peak_tflops is set)"),
    Metric("baton_data_wait_fraction", "gauge", "Share of the step the workers spent getting "
                                                "their batch (mean over workers)"),
    Metric("baton_pipeline_bubble", "gauge", "Idle share of a pipeline step (pp > 1)"),
    Metric("baton_worker_memory_bytes", "gauge", "The largest worker's memory at the last "
                                                 "step: resident host memory (kind=host) and, on "
                                                 "GPUs, the step's peak of device memory "
                                                 "allocated (kind=device)", JOB + ("kind",)),
    Metric("baton_rank_compute_seconds", "gauge", "One worker's computation in the last step, "
           "without its waits for peers, where its engine times it apart (data parallel, ZeRO-1, "
           "pipelines on CPU): every step waits for the slowest", RANK),
    Metric("baton_rank_data_wait_seconds", "gauge", "Seconds one worker spent getting its batch "
           "in the last step", RANK),
    Metric("baton_rank_memory_bytes", "gauge", "One worker's memory at the last step: resident "
           "host memory (kind=host) and, on GPUs, the step's peak of device memory allocated "
           "(kind=device)", RANK + ("kind",)),
    Metric("baton_workers_alive", "gauge", "Workers running in the job's world"),
    Metric("baton_world_size", "gauge", "Workers the current world was formed with"),
    Metric("baton_dp", "gauge", "Data-parallel replicas in the current world"),
    Metric("baton_waiting_seconds", "gauge", "Seconds the job has waited in line for room other "
                                             "jobs hold (queued, or suspended); 0 with a world"),
    Metric("baton_failures", "counter", "Worker failures seen, by cause", JOB + ("cause",)),
    Metric("baton_recoveries", "counter", "Failures recovered from, by cause", JOB + ("cause",)),
    Metric("baton_recovery_seconds", "histogram", "From a failure to the first step after it",
           JOB + ("cause",), SECONDS),
    Metric("baton_checkpoint_save_seconds", "histogram", "Writing and committing a checkpoint",
           buckets=SECONDS),
    Metric("baton_checkpoint_load_seconds", "histogram", "Loading a checkpoint into the world",
           buckets=SECONDS),
    Metric("baton_rescales", "counter", "World re-formed at another size: up (room appeared) "
                                        "or down (after a failure)", JOB + ("direction",)),
]}


def exported_names() -> dict[str, Metric]:
    """Every series name Prometheus sees, and the metric it belongs to."""
    return {series: m for m in METRICS.values() for series in m.exported()}


class LiveMetrics:
    """The coordinator's handle: one call per thing that happened. Without a connected Ray
    (the unit tests' fake group) every call does nothing. The gauges' last values are set
    again every REFRESH_S, on a thread of their own, until `close`."""

    def __init__(self, job: str):
        import ray

        self.job = job
        self._m: dict = {}
        self._last: dict[tuple[str, tuple], float] = {}  # (gauge, its labels) -> last value
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if not ray.is_initialized():
            return
        from ray.util import metrics as rm

        for m in METRICS.values():
            if m.kind == "gauge":
                self._m[m.name] = rm.Gauge(m.name, m.help, tag_keys=m.labels)
            elif m.kind == "counter":
                self._m[m.name] = rm.Counter(m.name, m.help, tag_keys=m.labels)
            else:
                self._m[m.name] = rm.Histogram(m.name, m.help, boundaries=list(m.buckets),
                                               tag_keys=m.labels)
        threading.Thread(target=self._refresh, name="baton-metrics", daemon=True).start()

    def _refresh(self) -> None:
        import ray

        while not self._closed.wait(REFRESH_S) and ray.is_initialized():  # (never starts a Ray)
            with self._lock:  # (a series `world` removes is not set again after it)
                for (name, labels), value in self._last.items():
                    self._m[name].set(value, tags=dict(labels))

    def close(self) -> None:
        """No more refreshes: the run has ended (before Ray shuts down)."""
        self._closed.set()

    def _tags(self, **extra: str) -> dict:
        return {"job_name": self.job, **extra}

    def _set(self, name: str, value: Optional[float], **extra: str) -> None:
        if name in self._m and value is not None:
            tags = self._tags(**extra)
            with self._lock:
                self._m[name].set(float(value), tags=tags)
                self._last[(name, tuple(sorted(tags.items())))] = float(value)

    def _inc(self, name: str, **extra: str) -> None:
        if name in self._m:
            self._m[name].inc(1.0, tags=self._tags(**extra))

    def _observe(self, name: str, value: float, **extra: str) -> None:
        if name in self._m:
            self._m[name].observe(float(value), tags=self._tags(**extra))

    def step(self, *, step: int, loss: float, lr: float, tokens_per_s: float,
             samples_per_s: float, step_s: float, data_wait: Optional[float],
             mfu: Optional[float], bubble: Optional[float], memory: dict) -> None:
        self._set("baton_step", step)
        self._set("baton_loss", loss)
        self._set("baton_learning_rate", lr)
        self._set("baton_tokens_per_second", tokens_per_s)
        self._set("baton_samples_per_second", samples_per_s)
        self._observe("baton_step_seconds", step_s)
        self._set("baton_data_wait_fraction", data_wait)
        self._set("baton_mfu", mfu)
        self._set("baton_pipeline_bubble", bubble)
        for kind, held in memory.items():
            self._set("baton_worker_memory_bytes", held, kind=kind)

    def ranks(self, results: list[dict], workers: list[dict]) -> None:
        """Each worker's series of the last step, by its rank and node."""
        for rank, (r, w) in enumerate(zip(results, workers)):
            where = {"rank": str(rank), "node": str(w.get("ip") or w.get("node", ""))}
            self._set("baton_rank_compute_seconds", r.get("compute_s"), **where)
            self._set("baton_rank_data_wait_seconds", r.get("data_s"), **where)
            for kind, held in r.get("memory", {}).items():
                self._set("baton_rank_memory_bytes", held, **where, kind=kind)

    def world(self, *, alive: int, world_size: int, dp: int) -> None:
        """A world formed (or none: suspended). The ranks of the one before stop showing: Ray's
        exporter leaves out a gauge's series once it is set to NaN (Ray 2.60: measured), and a
        rank of this world shows again from its first step."""
        with self._lock:
            for name, labels in [key for key in self._last if key[0].startswith("baton_rank_")]:
                self._m[name].set(float("nan"), tags=dict(labels))
                del self._last[(name, labels)]
        self._set("baton_workers_alive", alive)
        self._set("baton_world_size", world_size)
        self._set("baton_dp", dp)

    def waiting(self, seconds: float) -> None:
        self._set("baton_waiting_seconds", seconds)

    def failure(self, cause: str, alive: int) -> None:
        self._inc("baton_failures", cause=cause)
        self._set("baton_workers_alive", alive)

    def recovered(self, cause: str, seconds: float) -> None:
        self._inc("baton_recoveries", cause=cause)
        self._observe("baton_recovery_seconds", seconds, cause=cause)

    def rescaled(self, from_dp: int, to_dp: int) -> None:
        if to_dp != from_dp:
            self._inc("baton_rescales", direction="up" if to_dp > from_dp else "down")

    def checkpoint_saved(self, seconds: float) -> None:
        self._observe("baton_checkpoint_save_seconds", seconds)

    def checkpoint_loaded(self, seconds: float) -> None:
        self._observe("baton_checkpoint_load_seconds", seconds)
