"""Held-out evaluation: the coordinator's collaborator that runs the task's metrics over the
evaluation set between two steps and returns them as eval_* metrics.

A pass is queued on the workers right behind the step it follows (actors run calls in order,
so it sees exactly the state after that step while the next step waits behind it), each batch
split over the replicas as training batches are; the workers compute sums without gradients
and the pass divides them by the count of terms. Pass n reads epoch n of the evaluation order:
the order does not shuffle, so every pass sees the same samples, and the feed's read-ahead of
the next epoch is the next pass's data. A mix of corpora held out by eval.fraction has a set
(and a feed) per source, read one after another in each pass: the metrics over all of them,
and each source's apart (eval_loss/NAME). With train.ema each pass evaluates the average of the
weights too, on the same batches (eval_ema_loss, eval_ema_*). Held-out row groups whose rows are bad are left out
as training's are (data.skip_bad_row_groups, counted apart for each held-out set), and the
metrics are those of the rows left."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from baton.data.feed import DataFeed
from baton.data.order import Cursor
from baton.data.source import JobData
from baton.spec import JobSpec
from baton.tasks import metric_values


@dataclass
class Pass:
    """One pass queued on the workers: per batch, each worker's reference, how many batches
    each held-out set took (in order), and the row groups it left out first (bad rows:
    data.skip_bad_row_groups), as events."""

    refs: list[list]
    batches: list[int]
    left_out: list[dict] = field(default_factory=list)

    def all_refs(self) -> list:
        return [ref for batch_refs in self.refs for ref in batch_refs]


class Evaluation:
    def __init__(self, spec: JobSpec, data: JobData, last: Optional[int] = None):
        # every `every` steps, and after the run's last step (train.steps, or --until's)
        self.every, self.steps = spec.eval.every_steps, last or spec.train.steps
        self.sets = [(s.name, DataFeed(s.manifest, s.order(spec.data.shuffle_block), data.columns,
                                       spec.data.read == "spread", spec.data.skip_bad_row_groups))
                     for s in data.eval_sets]
        self.samples = data.eval_samples
        self.passes = 0
        self.last: dict = {}  # the metrics of the last pass
        self.step = 0  # the step it followed

    def due(self, done: int) -> bool:
        return done == self.steps or bool(self.every and done % self.every == 0)

    def submit(self, group, global_batch: int) -> Pass:
        """Queue one pass on every worker: per batch, the workers' references."""
        refs, batches = [], []
        for _, feed in self.sets:
            cursor = Cursor(epoch=self.passes)
            before = len(refs)
            while cursor.epoch == self.passes:
                batch = feed.next_batch(cursor, global_batch, one_epoch=True)
                if len(batch):  # (none: the pass's last rows were left out, bad)
                    refs.append(group.submit("evaluate", batch))
            batches.append(len(refs) - before)
        self.passes += 1
        return Pass(refs, batches, [event for _, feed in self.sets for event in feed.take_skipped()])

    def collect(self, group, queued: Pass, step: int) -> dict:
        """The pass's metrics over every held-out set; with several (a mix's sources, under
        eval.fraction), each set's too, as eval_loss/NAME."""
        at, by_set = 0, []
        for (name, _), n in zip(self.sets, queued.batches):
            by_set.append((name, [r for batch_refs in queued.refs[at:at + n]
                                  for r in group.wait(batch_refs, f"evaluating after step {step}")]))
            at += n
        skipped = sum(feed.manifest.units[uid].rows for _, feed in self.sets for uid in feed.skipped)
        self.last = {**_metrics([r for _, results in by_set for r in results]),
                     "eval_samples": self.samples - skipped}
        for name, results in by_set:
            if name is not None:
                self.last.update({f"{k}/{name}": v for k, v in _metrics(results).items()})
        self.step = step
        return self.last

    def close(self) -> None:
        for _, feed in self.sets:
            feed.close()


def _metrics(results: list[dict]) -> dict:
    """The metrics of the workers' sums: eval_loss and the task's, and with train.ema those of
    the average of the weights as eval_ema_loss and eval_ema_*."""
    count = sum(r["tokens"] for r in results)
    targets = sum(r.get("targets", r["tokens"]) for r in results)  # (a loss mask's)
    out = {"eval_loss": sum(r["loss_sum"] for r in results) / max(targets, 1),
           **{f"eval_{k}": v for k, v in metric_values(results, count).items()}}
    if results and "ema" in results[0]:
        out.update({f"eval_ema_{k[len('eval_'):]}": v
                    for k, v in _metrics([r["ema"] for r in results]).items()})
    return out


def evaluation(spec: JobSpec, data: JobData, last: Optional[int] = None) -> Optional[Evaluation]:
    return Evaluation(spec, data, last) if data.eval_sets else None
