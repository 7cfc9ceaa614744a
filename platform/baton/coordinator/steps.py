"""What the completed steps measured: the coordinator's collaborator that turns the workers'
results of a step into its metrics (for MLflow, the live metrics and the progress line) and
keeps what the run's result reports: throughput, step times, pipeline bubbles and activation
peaks, the traced step's timeline, the workers' state bytes and memory."""

from __future__ import annotations

import math
import tempfile
from typing import Optional

import numpy as np

from baton.errors import WorkerError
from baton.models.flops import job_peak_flops, model_flops_per_token
from baton.tasks import metric_values
from baton.tracking import timeline
from baton.tracking.metrics import MEMORY_MIB
from baton.tracking.profile import comm_overlap


class StepStats:
    def __init__(self, spec):
        self.last_loss = float("nan")
        self.tokens_per_s: list[float] = []
        self.step_times_s: list[float] = []
        self.bubbles: list[float] = []  # measured idle fraction of each pipeline step
        self.pipeline_peaks: list[dict] = []  # per rank: activation_bytes, live
        self.trace: Optional[dict] = None  # the traced step's timeline: {"step", "lanes"}
        self.state_bytes: list[dict] = []  # per worker, at the first step of the last world
        # the largest worker's memory at the last step, bytes: "host" (resident) and, on GPUs,
        # "device" (the step's peak allocated)
        self.memory: dict[str, int] = {}
        self.flops_per_token = model_flops_per_token(spec.model)
        self.skip_limit = spec.train.skip_nonfinite  # steps in a row whose update may be skipped
        self.skipped_in_a_row = 0
        self.skipped: list[int] = []  # the steps whose update was skipped (this run)
        # a loss that is not a number is a spike to rewind from (coordinator/spikes.py)
        self.rewinds = spec.train.rewind_on_spike is not None
        self.peak_flops: Optional[float] = None  # of the current world's devices
        # seconds the current world's slowest worker compiled (train.compile): [in its setup
        # (a pipeline's shape probe), in its steps]
        self.compile_s = [0.0, 0.0]

    def world(self, workers: list[dict], spec) -> None:
        """A world was formed on these workers: their devices' summed peak, for MFU."""
        self.peak_flops = job_peak_flops([w.get("device_name", "cpu") for w in workers],
                                         spec.train.precision, spec.tracking.cpu_peak_tflops)
        self.compile_s = [max(w.get("compile_s", 0.0) for w in workers), 0.0]

    def measure(self, step: int, results: list[dict], step_time_s: float, samples: int,
                lr: float, epoch: int, dims) -> dict:
        """Step `step`'s metrics (1-based) from every worker's result; a loss that is not a
        number stops the run, unless the workers skipped the step's update (its gradient was
        not finite: train.skip_nonfinite), up to that many steps in a row, or the run rewinds
        from it (train.rewind_on_spike)."""
        tokens = sum(r["tokens"] for r in results)
        # (a loss mask's targets, where it has one: a step of none logs 0)
        targets = sum(r.get("targets", r["tokens"]) for r in results)
        loss = sum(r["loss_sum"] for r in results) / max(targets, 1)
        skipped = any(r.get("skipped") for r in results)
        if skipped:
            self.skipped.append(step)
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row > self.skip_limit:
                raise WorkerError(
                    f"the gradient is {results[0]['grad_norm']} at step {step}, "
                    f"{self.skipped_in_a_row} steps in a row, more than train.skip_nonfinite "
                    f"({self.skip_limit}) skips; lower train.lr, or look for bad rows in the "
                    "batches of those steps (the model is that of the step before them; the "
                    "last checkpoint is kept)")
        else:
            self.skipped_in_a_row = 0
            if not math.isfinite(loss) and not self.rewinds:
                raise WorkerError(f"the loss is {loss} at step {step}; lower train.lr or set "
                                  "train.grad_clip, or skip such steps (train.skip_nonfinite) "
                                  "or rewind past them (train.rewind_on_spike) (the last "
                                  "checkpoint is kept)")
            if math.isfinite(loss):
                self.last_loss = loss
        tps = tokens / step_time_s
        self.tokens_per_s.append(tps)
        self.step_times_s.append(step_time_s)
        metrics = {
            **({"skipped": 1} if skipped else {}),
            "loss": loss, "lr": lr, "grad_norm": results[0]["grad_norm"],
            "tokens_per_s": tps, "samples_per_s": samples / step_time_s,
            "step_time_s": step_time_s, "epoch": epoch, "world_size": dims.world_size, "dp": dims.dp}
        # the task's (from the last stages)
        metrics.update({f"train_{k}": v for k, v in metric_values(results, tokens).items()})
        if "state_bytes" in results[0]:  # the first step of each world
            self.state_bytes = [r["state_bytes"] for r in results]
            metrics["state_mib_per_worker"] = max(sum(b.values()) for b in self.state_bytes) / 2**20
        compiled = max(r.get("compile_s", 0.0) for r in results)
        if compiled:  # a new world's first step, or a recompile (a new shape)
            self.compile_s[1] += compiled
            metrics["compile_s"] = compiled
        stalled = max(r.get("save_stall_s", 0.0) for r in results)
        if stalled:  # the step waited this long for the checkpoint before it
            metrics["checkpoint_stall_s"] = stalled
        for kind, name in MEMORY_MIB.items():
            held = [r["memory"][kind] for r in results if kind in r.get("memory", {})]
            if held:  # the largest worker's: the one that runs out first
                self.memory[kind] = max(held)
                metrics[name] = self.memory[kind] / 2**20
        data_s = [r["data_s"] for r in results if "data_s" in r]
        if data_s:
            metrics["data_wait_fraction"] = min(1.0, sum(data_s) / len(data_s) / step_time_s)
        if self.peak_flops and self.flops_per_token:
            metrics["mfu"] = tps * self.flops_per_token / self.peak_flops
        if dims.pp > 1:
            metrics.update(self._pipeline(results, dims))
        if results[0].get("profile"):  # a data-parallel traced step: rank 0's profile
            overlap = comm_overlap(results[0]["profile"])
            if overlap is not None:  # a world of one communicates nothing
                metrics["comm_overlap"] = overlap
        return metrics

    def _pipeline(self, results: list[dict], dims) -> dict:
        pipes = [[results[r]["pipe"] for r in dims.pp_group(d)] for d in range(dims.dp)]
        self.bubbles.append(timeline.bubble(pipes))
        if not self.pipeline_peaks:
            self.pipeline_peaks = [{"activation_bytes": 0, "live": 0} for _ in results]
        for peak, r in zip(self.pipeline_peaks, results):
            for key in peak:
                peak[key] = max(peak[key], r["pipe"][key])
        most = max(r["pipe"]["activation_bytes"] for r in results)
        return {"pipeline_bubble": self.bubbles[-1], "activation_peak_mb": most / 2**20}

    def save_trace(self, step: int, results: list[dict], spec, dims, tracker) -> None:
        """The traced step's timeline, as an MLflow artifact: a Chrome trace. Its swimlane
        is drawn from it when the run ends (`report.log_to_run`): drawn here, importing
        matplotlib and rendering held the coordinator for 0.3-0.7 s, a step of every worker
        (measured on 2 CPU cores, pp 2)."""
        if dims.pp == 1:  # one replica's profile: open it in https://ui.perfetto.dev
            with tempfile.TemporaryDirectory() as tmp:
                timeline.write_json(results[0]["profile"], f"{tmp}/trace.json")
                tracker.log_artifacts(tmp, f"profile/step_{step:06d}")
            return
        lanes = [(*dims.coords(rank), r["events"]) for rank, r in enumerate(results)]
        self.trace = {"step": step, "lanes": lanes}
        p = spec.parallel
        title = (f"{spec.name} step {step}: {p.schedule}, pp={dims.pp}, dp={dims.dp}, "
                 f"{spec.microbatches} micro-batches, bubble {self.bubbles[-1]:.1%}")
        with tempfile.TemporaryDirectory() as tmp:
            timeline.write_json(timeline.chrome_trace(lanes, step, title), f"{tmp}/trace.json")
            tracker.log_artifacts(tmp, f"pipeline/step_{step:06d}")

    def median_tokens_per_s(self) -> float:
        recent = self.tokens_per_s[len(self.tokens_per_s) // 2:]  # past the warm-up steps
        return float(np.median(recent)) if recent else 0.0

    def status(self) -> dict:
        """What `baton status` shows of the steps: the last loss, throughput and memory, and
        the steps whose update was skipped."""
        return {"loss": None if math.isnan(self.last_loss) else round(self.last_loss, 6),
                "tokens_per_s": round(self.tokens_per_s[-1], 1) if self.tokens_per_s else None,
                "memory_mib": {kind: round(held / 2**20) for kind, held in self.memory.items()},
                **({"skipped_steps": self.skipped} if self.skipped else {})}

    def result_fields(self) -> dict:
        return {"loss": self.last_loss, "tokens_per_s": self.median_tokens_per_s(),
                "step_times_s": self.step_times_s, "bubbles": self.bubbles, "trace": self.trace,
                "pipeline_peaks": self.pipeline_peaks, "state_bytes": self.state_bytes}
