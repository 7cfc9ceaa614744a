"""Held-out evaluation: the coordinator's collaborator that runs the task's metrics over the
evaluation set between two steps and returns them as eval_* metrics.

A pass is queued on the workers right behind the step it follows (actors run calls in order,
so it sees exactly the state after that step while the next step waits behind it), each batch
split over the replicas as training batches are; the workers compute sums without gradients
and the pass divides them by the count of terms. Pass n reads epoch n of the evaluation order:
the order does not shuffle, so every pass sees the same samples, and the feed's read-ahead of
the next epoch is the next pass's data."""

from __future__ import annotations

from typing import Optional

from baton.data.feed import DataFeed
from baton.data.order import Cursor
from baton.data.source import JobData
from baton.spec import JobSpec
from baton.tasks import metric_values


class Evaluation:
    def __init__(self, spec: JobSpec, data: JobData):
        self.every, self.steps = spec.eval.every_steps, spec.train.steps
        self.feed = DataFeed(data.eval_manifest, data.eval_order(spec), data.columns,
                             spec.data.read == "spread")
        self.samples = data.eval_samples
        self.passes = 0
        self.last: dict = {}  # the metrics of the last pass
        self.step = 0  # the step it followed

    def due(self, done: int) -> bool:
        return done == self.steps or bool(self.every and done % self.every == 0)

    def submit(self, group, global_batch: int) -> list[list]:
        """Queue one pass on every worker: per batch, the workers' references."""
        cursor, refs = Cursor(epoch=self.passes), []
        self.passes += 1
        while cursor.epoch < self.passes:
            refs.append(group.submit("evaluate", self.feed.next_batch(cursor, global_batch)))
        return refs

    def collect(self, group, refs: list[list], step: int) -> dict:
        results = [r for batch_refs in refs
                   for r in group.wait(batch_refs, f"evaluating after step {step}")]
        count = sum(r["tokens"] for r in results)
        self.last = {"eval_loss": sum(r["loss_sum"] for r in results) / count,
                     **{f"eval_{k}": v for k, v in metric_values(results, count).items()},
                     "eval_samples": self.samples}
        self.step = step
        return self.last

    def close(self) -> None:
        self.feed.close()


def evaluation(spec: JobSpec, data: JobData) -> Optional[Evaluation]:
    return Evaluation(spec, data) if data.eval_manifest is not None else None
