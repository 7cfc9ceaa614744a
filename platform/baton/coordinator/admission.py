"""How a job gets its room, for the coordinator: its turn in line for room other baton jobs
hold (decided under the cluster list's lock: `priorities.py`), room it starts on out of turn,
room it claims from jobs of lower priority, a wait in line after an autoscaler at its maximum
added nothing, and what the console, the run record and `baton status` say of each."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Optional

from baton.errors import WorkerError
from baton.status import place_in_line, quota_held

if TYPE_CHECKING:
    from baton.coordinator.placement import Placement
    from baton.coordinator.priorities import Priorities
    from baton.coordinator.report import Report


def workers(n: int) -> str:
    return f"{n} worker{'s' * (n != 1)}"


class Admission:
    """A coordinator's part in the line: `priorities` is its entry in the cluster's list (None
    for `baton eval`, which takes the room there is); `record` puts an event in the run
    record, `publish` writes the status file."""

    def __init__(self, priorities: Optional["Priorities"], report: "Report",
                 record: Callable[[dict], None], publish: Callable[[], None]):
        self.p, self.report, self.record, self.publish = priorities, report, record, publish

    def turn(self, placement: "Placement", step: int, told: bool, suspended: bool = False) -> int:
        """The workers the job starts with now: its smallest world fits the room no job ahead
        of it in line has spoken for, with what jobs of lower priority give, or room those
        ahead cannot use yet (out of turn). 0: it waits in line, priority first, then arrival
        (a suspended job keeps the place it had). `told`: the console has the run's notes
        (the line's moves are said there from then on)."""
        p = self.p
        if p is None:
            return placement.first_workers()
        seen = (p.ahead, p.holders, p.over_quota, p.quota_held_by)
        n = p.turn(placement, suspended)
        if not n and (p.ahead, p.holders, p.over_quota, p.quota_held_by) != seen:  # the line moved
            self.publish()  # `baton status` says so now
            if p.over_quota and (not seen[2] or p.quota_held_by != seen[3]):
                if told:
                    self.report.note(f"waiting for room within {self.quota()}")
            elif p.ahead != seen[0] and told:
                self.report.note(f"in line: {self.line()}")
        if n and p.lenders:
            names = ", ".join(p.lenders)
            self.record({"kind": "backfill", "step": step, "workers": n, "lent_by": list(p.lenders)})
            self.report.note(f"starting out of turn: room for {workers(n)} that {names} (ahead in "
                             f"line) cannot use yet, given back when "
                             f"{'it' if len(p.lenders) == 1 else 'one of them'} can start")
        return n

    def line(self) -> str:
        """Its place: `first; held by a` or `3rd, behind c, b; held by a`."""
        return place_in_line(self.p.ahead, self.p.holders)

    def quota(self) -> str:
        """What it waits for outside the line: `quota team (1 CPU): held by a`."""
        return quota_held(self.p.quota, self.p.quota_room, self.p.quota_held_by)

    def queued(self, need: int) -> None:
        self.report.note(f"waiting for room for {workers(need)} (elastic.min_dp x pp x tp) "
                         f"within {self.quota()}" if self.p.over_quota else
                         f"waiting in line for room for {workers(need)} (elastic.min_dp x pp x tp): "
                         f"{self.line()}")

    def waited(self, need: int, limit_s: Optional[float]) -> float:
        """Seconds in line so far; WorkerError past `limit_s` (resources.queue_timeout_s)."""
        waited_s = time.time() - self.p.waiting_since
        if limit_s is not None and waited_s > limit_s:
            raise WorkerError(f"waited {waited_s:.0f} s in line for room for {workers(need)} "
                              f"(resources.queue_timeout_s: {limit_s:g}): "
                              + (f"within {self.quota()}" if self.p.over_quota else self.line()))
        return waited_s

    def after_nodes(self, placement: "Placement", timeout_s: float) -> bool:
        """The workers found no room in `timeout_s` (parallel.timeout_s) on a cluster whose
        autoscaler could have added nodes: at its maximum, it will not. Where other baton jobs
        hold the room the smallest world lacks, the job waits in line for it (as on a cluster
        that cannot grow) rather than failing; its place from now."""
        p, need = self.p, placement.scale.min_workers
        if p is None or not p.autoscaled or placement.group.free_workers() + p.held_by_others() < need:
            return False
        p.waited_for_nodes = True
        p.waits()
        p.spoken_for()  # who is ahead, who holds the room
        self.report.note(f"its autoscaler added no room for {workers(need)} in {timeout_s:g} s "
                         f"(parallel.timeout_s): waiting in line for the room other jobs hold: "
                         f"{self.line()}")
        return True

    def ask(self, short: int, need: int, step: int) -> int:
        """Room for `short` more workers from running jobs of lower priority (and room lent
        while in line), `need` of them for the smallest world: how many of them the room
        claimed fits (`Priorities.ask`); the console says whom it asked."""
        p = self.p
        if p is None:
            return 0
        coming, taken = p.ask(short, need)
        lent = {p.names[key] for key in p.lent}
        for name, at in taken.items():
            keeps = f"keeps at most {at} replica{'s' * (at > 1)}" if at else "is suspended"
            self.report.note(f"step {step}: room lent to job {name} taken back: it {keeps} "
                             "until this one has started" if name in lent else
                             f"step {step}: priority {p.priority}: job {name} {keeps} while this one runs")
        return coming
