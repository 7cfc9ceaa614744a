"""The coordinator's decisions, as pure functions of plain values: no Ray, no clock, no I/O.

- `FailurePolicy`: after a failure, recover or give up.
- `ScalePolicy`: how many data-parallel replicas to run on the workers that can be had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# what a failure was, as the coordinator saw it
CAUSES = ("actor_died", "node_died", "hang", "exception", "timeout")
REPEATABLE = ("exception", "timeout")  # raised by the job's own processes: may be its own bug


@dataclass(frozen=True)
class Failure:
    step: int  # the step that was running (steps count from 1)
    cause: str  # one of CAUSES
    message: str  # one line
    ranks: tuple[int, ...] = ()  # the ranks found dead or silent, where known

    def __post_init__(self) -> None:
        if self.cause not in CAUSES:
            raise ValueError(f"unknown failure cause {self.cause!r}")


@dataclass(frozen=True)
class Decision:
    recover: bool
    reason: str


@dataclass
class FailurePolicy:
    """Recover up to `max_failures` times. An exception (or a collective's timeout) that
    repeats at the same step with the same message is the job's own bug, not bad luck: the
    second time, give up at once."""

    max_failures: int
    seen: list[Failure] = field(default_factory=list)

    def decide(self, failure: Failure) -> Decision:
        repeats = [f for f in self.seen if f.cause in REPEATABLE and f.step == failure.step
                   and f.message == failure.message]
        self.seen.append(failure)
        if failure.cause in REPEATABLE and repeats:
            return Decision(False, f"giving up: the same error came back at step {failure.step} "
                                   f"after a recovery: {failure.message}")
        if self.max_failures == 0:  # no recovery asked for: the failure is the whole story
            return Decision(False, failure.message)
        if len(self.seen) > self.max_failures:
            return Decision(False, f"giving up after {len(self.seen)} failures, more than elastic.max_failures = "
                                   f"{self.max_failures}; the last at step {failure.step}: "
                                   f"{failure.message}")
        return Decision(True, f"failure {len(self.seen)} of at most {self.max_failures}: "
                              f"{failure.cause} at step {failure.step}")


@dataclass(frozen=True)
class ScalePolicy:
    """`valid_dps`: the replica counts in [min_dp, max_dp] the batch can be split into."""

    valid_dps: tuple[int, ...]
    per_replica: int = 1  # workers a replica takes: pp x tp

    def target(self, workers: int) -> Optional[int]:
        """The most replicas `workers` workers can hold, or None if fewer than min_dp fit."""
        fitting = [dp for dp in self.valid_dps if dp * self.per_replica <= workers]
        return max(fitting) if fitting else None

    def grow_to(self, dp: int, workers_free: int) -> Optional[int]:
        """The larger world to move to when `workers_free` more workers could start now, or None
        if no valid dp above `dp` fits."""
        best = self.target(dp * self.per_replica + workers_free)
        return best if best is not None and best > dp else None

    @property
    def min_workers(self) -> int:
        return min(self.valid_dps) * self.per_replica
