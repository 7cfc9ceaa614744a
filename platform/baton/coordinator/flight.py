"""The steps in flight: handed to the workers and not yet completed, oldest first, each with
the checkpoint and the evaluation queued behind it. The coordinator keeps PIPELINE_DEPTH of
them queued so that no worker idles waiting for it between steps (measured: 3.5 ms a step on
CPU, a larger share of a short GPU step); workers run calls in order (actor.py), so a
checkpoint queued behind step k sees exactly the state after step k."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional

from baton.coordinator.commits import Save
from baton.coordinator.evaluation import Pass

PIPELINE_DEPTH = 2  # steps queued on the workers at once


@dataclass
class Pending:
    """A step handed to the workers, and what was queued behind it."""

    step: int
    samples: int
    lr: float
    submitted_at: float
    refs: list
    cursor: dict  # the data cursor after this step
    ledger_refs: Optional[list] = None
    save: Optional[Save] = None  # a checkpoint of this step, queued behind it
    evaluation: Optional[Pass] = None  # an evaluation pass after it
    traced: bool = False

    def all_refs(self) -> list:
        saving = [*self.save.save_refs, *self.save.digest_refs] if self.save else []
        evaluating = self.evaluation.all_refs() if self.evaluation else []
        return [*self.refs, *(self.ledger_refs or []), *saving, *evaluating]


class Flight:
    def __init__(self):
        self.queue: collections.deque[Pending] = collections.deque()
        self.submitted = 0  # steps handed to the workers (the next one's index)
        self.last_done_at = 0.0  # when the last step completed (perf_counter; 0: none yet)

    def __len__(self) -> int:
        return len(self.queue)

    def room(self, end: int, hold_behind_evaluation: bool) -> bool:
        """Whether another step is to be handed out now: one is left before `end` and fewer
        than PIPELINE_DEPTH are queued. `hold_behind_evaluation` (eval.patience): nothing is
        queued behind an evaluation until it is judged, since a step taken after the one the
        run stops at would change the state it ends with."""
        return (self.submitted < end and len(self.queue) < PIPELINE_DEPTH
                and not (hold_behind_evaluation and self.queue and self.queue[-1].evaluation))

    def add(self, pending: Pending) -> None:
        self.queue.append(pending)
        self.submitted += 1

    def oldest(self) -> Pending:
        return self.queue[0]

    def timed(self, p: Pending) -> float:
        """Step `p`'s results are in: its time, from when the step before it ended (a queued
        step starts then) or from its submission."""
        now = time.perf_counter()
        step_time_s = now - max(p.submitted_at, self.last_done_at)
        self.last_done_at = now
        return step_time_s

    def pop(self) -> None:
        """The oldest step is done: it leaves the queue (one that failed stays queued, for a
        recovery to drop)."""
        self.queue.popleft()

    def drop(self) -> list:
        """Throw every queued step away (a failure, a rewind): the references of every call
        queued for them, for the group to abandon."""
        stale = [ref for p in self.queue for ref in p.all_refs()]
        self.queue.clear()
        return stale

    def since_last_step_s(self) -> Optional[float]:
        return round(time.perf_counter() - self.last_done_at, 3) if self.last_done_at else None
