"""What a run tells the outside as it goes, for the coordinator: the MLflow run (each step's
metrics, the events in events.json, tags, through the tracker), Ray's live metrics
(`ray_baton_*`), the console's progress line, and the status file `baton status` reads. The
coordinator decides and measures; this says so, each thing once."""

from __future__ import annotations

import time
from typing import Optional

from baton.coordinator.stragglers import describe
from baton.progress import Progress
from baton.status import StatusBoard
from baton.storage import redact
from baton.tracking.metrics import MEMORY_MIB, LiveMetrics


class Report:
    def __init__(self, name: str, tracker, board: StatusBoard, show_progress: bool):
        self.tracker, self.board, self.show_progress = tracker, board, show_progress
        self.live = LiveMetrics(name)
        self.events: list[dict] = []
        self.progress: Optional[Progress] = None  # from `opened`, with the MLflow run
        self._early: list[str] = []  # notes from before it

    def opened(self, steps: int, start: int, unit: str) -> None:
        """The MLflow run is open: the progress line starts, at step `start` of `steps`."""
        self.progress = Progress(steps, start=start, enabled=self.show_progress, unit=unit)
        for text in self._early:
            self.progress.note(text)

    def waited(self, seconds: float) -> None:
        """The run waited `seconds` for room (in line, suspended): the progress line's
        elapsed time and its estimate leave them out."""
        if self.progress is not None:
            self.progress.t0 += seconds

    def note(self, text: str) -> None:
        """A line on the console between progress lines (held until the run is open)."""
        if self.progress is None:
            self._early.append(text)
        else:
            self.progress.note(text)

    def record(self, event: dict, tags: dict) -> None:
        """An event for the run record (RunResult.events and MLflow's events.json)."""
        self.events.append({"wall_time": round(time.time(), 3), **event})
        self.tracker.log_dict(self.events, "events.json")
        self.tracker.set_tags(tags)

    def step(self, step: int, metrics: dict, lr: float, step_time_s: float) -> None:
        """A completed step's metrics: logged once, shown live and on the progress line."""
        self.tracker.log_metrics(step, metrics)
        tps = metrics["tokens_per_s"]
        self.live.step(step=step, loss=metrics["loss"], lr=lr, tokens_per_s=tps,
                       samples_per_s=metrics["samples_per_s"], step_s=step_time_s,
                       data_wait=metrics.get("data_wait_fraction"), mfu=metrics.get("mfu"),
                       bubble=metrics.get("pipeline_bubble"),
                       memory={kind: metrics[name] * 2**20 for kind, name in MEMORY_MIB.items()
                               if name in metrics})
        self.progress.update(step, metrics["loss"], tps)

    def straggler(self, event: dict, tags: dict) -> None:
        """A worker every step waits for, or one that keeps up again (coordinator/stragglers.py):
        in the run record, on the console, and in the status file from there on."""
        self.record(event, tags)
        self.progress.note(describe(event))

    def mix_phase(self, event: dict, tags: dict) -> None:
        """A mix's weights change (data.mix_phases), from the step `event` names: in the run
        record and on the console (as the phase's first batch is drawn)."""
        self.record({"kind": "mix_phase", **event}, tags)
        phase = event["phase"]
        self.note(f"step {event['step']}: the mix's weights now " + ", ".join(
            f"{name} {w:.1%}" for name, w in event["weights"].items())
            + (f" (data.mix_phases[{phase - 1}])" if phase else " (data.mix)"))

    def skipped(self, step: int, grad_norm: float, in_a_row: int, limit: int, tags: dict) -> None:
        """A step whose gradient was not finite, its update skipped (train.skip_nonfinite):
        in the run record and on the console."""
        self.record({"kind": "skipped", "step": step, "grad_norm": str(grad_norm)}, tags)
        self.note(f"step {step}: the gradient is {grad_norm}: its update skipped "
                  f"({in_a_row} in a row; train.skip_nonfinite: {limit})")

    def spike(self, event: dict, said: str, most: int, tags: dict) -> None:
        """A rewind from a loss spike (train.rewind_on_spike; `said`: the spike in words): in
        the run record and on the console."""
        self.record({"kind": "spike", **event}, tags)
        s, back = event["step"], event["rewound_to"]
        skipped = f"step {s}'s batch" if s == back + 1 else f"the batches of steps {back + 1} to {s}"
        self.note(f"step {s}: {said}: back to {f'checkpoint {back}' if back else 'the start'}, "
                  f"{skipped} skipped (rewind {event['rewind']} of at most {most})")

    def bad_rows(self, event: dict, tags: dict) -> None:
        """A unit whose rows are bad, left out of the batch of `event["step"]`
        (data.skip_bad_row_groups): in the run record and on the console."""
        self.record({"kind": "bad_rows", **event}, tags)
        held_out = "held-out " if event.get("held_out") else ""
        self.note(f"step {event['step']}: {event['why']}: its {event['rows']:,} {held_out}rows "
                  f"skipped (data.skip_bad_row_groups: {event['skipped']} of {event['limit']})")

    def evaluated(self, step: int, evaluated: dict) -> None:
        self.progress.note(f"step {step}: " + ", ".join(
            f"{k} {v:.4g}" for k, v in evaluated.items() if k != "eval_samples")
            + f" over {evaluated['eval_samples']:,} held-out samples")

    def stopped_early(self, stop: dict, tags: dict) -> None:
        """eval.patience ends the run at `stop["step"]`: in the run record, on the console and
        in MLflow's tags (early_stop.step)."""
        self.record({"kind": "early_stop", **stop}, tags | {"early_stop.step": stop["step"]})
        self.progress.note(f"step {stop['step']}: stopping early: {stop['why']}")

    def phases(self, event: dict, step: int, dp: int, failures: int, tags: dict) -> None:
        """The first step of the run, or after a recovery or a rescale, is done: how long each
        part took (a start's phases go to the result and MLflow, not to the events)."""
        kind, phases = event["kind"], event["phases_s"]
        if kind != "start":
            self.record(event, tags)
        if kind == "recovery":
            self.live.recovered(event["cause"], event["total_s"])
        self.tracker.log_metrics(step, {f"{kind}_{k}_s": v for k, v in phases.items()}
                                 | {f"{kind}_total_s": event["total_s"], "failures": failures},
                                 replayed_ok=True)
        self.progress.note(f"{kind}: {'training again' if kind != 'start' else 'first step done'} "
                           f"at step {step} with dp={dp} after {event['total_s']:.1f} s "
                           f"({', '.join(f'{k} {v:.1f} s' for k, v in phases.items())})")

    def failed(self, error: BaseException, step: int, killed: bool) -> None:
        """The run stops on `error`: the MLflow run says why and where, keeps its events, and
        ends KILLED (an interrupt) or FAILED."""
        self.tracker.set_tags({"error": f"{type(error).__name__}: {error}"[:5000],
                               "failed_at_step": step + 1})
        if self.events:
            self.tracker.log_dict(self.events, "events.json")
        self.tracker.finish("KILLED" if killed else "FAILED")

    def status(self, status: dict, changed: bool, error: Optional[str] = None) -> None:
        """Publish the status file (`baton status`), with the error that stopped the run."""
        self.board.publish(redact(status | ({"error": error[:2000]} if error else {})), changed)
