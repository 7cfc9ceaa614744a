"""Where a world's workers come from, for the coordinator: how many to start with, topping a
world up after a failure, when there is room to grow into, and the one-line reason when the
cluster cannot hold enough."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, NoReturn, Optional

from baton.coordinator.policy import ScalePolicy
from baton.errors import NoRoom, WorkerError
from baton.spec import JobSpec
from baton.workers.group import START_WAIT_S

TOP_UP_GRACE_S = 5.0  # how long to wait for workers beyond those (room being freed)
# How often the coordinator asks Ray which nodes it is draining: a node drained on SIGTERM has
# 30 s by default (Ray's RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S), and the question costs 0.5 ms
DRAIN_CHECK_S = 1.0
# A move off a draining node waits for its replacements to start (training goes on meanwhile)
# until the node's deadline is this near; then it goes with what is ready. The move itself
# stopped training 0.29-1.32 s on the simulated cluster (tests/faults, benchmarks/chaos.py: a
# checkpoint, a new group, a load).
DRAIN_MARGIN_S = 10.0


class NoQuota:
    """A job no quota bounds (resources.quota unset, or no cluster list: `baton eval`)."""

    def allowance(self) -> Optional[int]:
        return None

    def claiming(self):
        return contextlib.nullcontext()

    def reserve(self, workers: int) -> None:
        pass


def together(members: list, tp: int) -> list:
    """`members` (actor, info) in rank order such that each replica's tp x cp workers (tp
    neighbouring ranks: parallel/mesh.py), whose collectives run in every layer, are on one
    node wherever the nodes allow: each node's workers in whole runs of tp first, then the
    rest, which a world that cannot use every worker leaves out first. Ray places workers
    one at a time, wherever there is room; this only ranks them."""
    if tp == 1:
        return members
    by_node: dict = {}
    for member in members:
        by_node.setdefault(member[1].get("node"), []).append(member)
    runs, rest = [], []
    for on_node in by_node.values():
        whole = len(on_node) // tp * tp
        runs += on_node[:whole]
        rest += on_node[whole:]
    return runs + rest


class Placement:
    def __init__(self, group, base: JobSpec, scale: ScalePolicy,
                 ask: Callable[[int, int], int] = lambda short, need: 0,
                 owed: Callable[[], int] = lambda: 0, quota=None):
        self.group, self.base, self.scale = group, base, scale
        # room for `short` more workers from jobs of lower priority, `need` of them for the
        # smallest world (suspending whole jobs if it must): how many of them it will fit
        self.ask = ask
        # workers' worth of the free room spoken for by jobs waiting in line ahead of this one
        # (all of them, once it runs: a job starts before another grows) and jobs starting
        self.owed = owed
        # resources.quota's bound (`Priorities`: allowance(), claiming(), reserve(n)), or none
        self.quota = quota or NoQuota()
        self.most = base.dp_range[1] * base.per_replica  # workers at max_dp
        self.next_check = 0.0  # when `growth_due` looks for room again (monotonic)
        self.joining = 0  # workers started for a growth, which it waits for (`growth_due`)
        self.joining_until = 0.0  # ...up to then (monotonic); the growth's `start` then decides
        self.next_drain_check = 0.0  # when `leaving` asks Ray again (monotonic)
        self.drains: dict[str, float] = {}  # what `leaving` found, until the move is made
        self.move_by = 0.0  # ...which waits for its replacements up to then (monotonic)
        self.replacing = 0  # the spares started for it

    def free(self) -> int:
        """Workers the cluster has room for now that no one else has spoken for."""
        return max(0, self.group.free_workers() - self.owed())

    def most_now(self) -> int:
        """The most workers the job may have now: max_dp replicas' worth, within what its
        quota leaves it (resources.quota)."""
        allowed = self.quota.allowance()
        return self.most if allowed is None else min(self.most, allowed)

    def room(self) -> int:
        """Workers the job could start with now, up to max_dp replicas (within its quota):
        free room, and room jobs of lower priority give (claimed here)."""
        free, most = self.free(), self.most_now()
        return min(most, free + self.ask(most - free, self.scale.min_workers - free))

    def first_workers(self, room: Optional[int] = None) -> int:
        """As many workers as the cluster has room for (`room`, counted already), up to max_dp
        replicas, with the room jobs of lower priority give; at least min_dp (start waits up to
        parallel.timeout_s for room, as an autoscaler would make, or those jobs free)."""
        n = max(self.scale.min_workers, self.room() if room is None else room)
        if self.base.dp_range[0] < self.base.dp_range[1]:
            # after counting: the job starts on the room there is now, and an autoscaler adds
            # nodes for the rest, which the coordinator grows onto
            self.group.request_capacity(self.most_now())
        return n

    def start(self, n: int) -> list:
        """The first world's workers: `n` wanted, at least min_dp replicas' worth."""
        members = self.group.start(n, self.base.parallel.timeout_s, need=self.scale.min_workers,
                                   grace_s=TOP_UP_GRACE_S)
        if self.scale.target(len(members)) is None:
            self.no_room(len(members), members, n)
        return members

    def top_up(self, have: int) -> list:
        """New workers to join `have` survivors, up to max_dp replicas: as many as the cluster
        has room for now, a short grace for room being freed, and a wait of up to
        parallel.timeout_s while fewer than min_dp replicas fit."""
        deadline = time.monotonic() + self.base.parallel.timeout_s
        new: list = []
        # (at least min_dp replicas' worth: a quota lowered meanwhile does not end the run)
        free, most = self.group.free_workers(), max(self.most_now(), self.scale.min_workers)
        self.ask(most - have - free, self.scale.min_workers - have - free)
        while True:
            want = most - have - len(new)
            new += self.group.start(want, START_WAIT_S, need=self.group.free_workers(),
                                    grace_s=TOP_UP_GRACE_S)
            if self.scale.target(have + len(new)) is not None:
                return new
            if time.monotonic() > deadline:
                self.no_room(have + len(new), new, self.most)
            time.sleep(1.0)

    def refill(self, have: int) -> tuple[list, bool]:
        """New workers for `have` survivors after a failure, and whether the world goes on
        without waiting for more. Under elastic.recovery continue, where the survivors and the
        spares that have started make at least min_dp replicas: those spares only, and the
        replacements start at the next step as a growth's do, while training goes on (a
        survivor beyond whole replicas waits as a spare for that growth). Otherwise `top_up`."""
        if self.base.elastic.recovery == "continue":
            ready = min(self.group.ready_spares(), self.most_now() - have)
            if self.scale.target(have + ready) is not None:
                self.check_soon()
                return self.group.start(ready, START_WAIT_S), True
        return self.top_up(have), False

    def growth_due(self, dp: int) -> bool:
        """Whether the world of `dp` replicas should grow now. Room is looked for every
        elastic.rescale_check_s. Room the job can grow into gets its new workers at once, as
        spares, and the world grows once they have started: training goes on meanwhile
        instead of waiting out their processes' start in the growth (3.4-3.9 s on 2 cores, more
        where a worker initialises a GPU). Room the job cannot grow into keeps its warm spares
        (elastic.spares)."""
        spares, most = self.base.elastic.spares, self.most // self.base.per_replica
        if self.joining:  # asked at every step until they have started
            return self._joined()
        if dp >= most and not spares:
            return False
        now = time.monotonic()
        if now < self.next_check:
            return False
        self.next_check = now + self.base.elastic.rescale_check_s
        with self.quota.claiming():  # two jobs of one quota never grow into the same room
            allowed = self.most_now()
            if dp < allowed // self.base.per_replica:
                self.group.request_capacity(allowed)  # renewed while short
                free = min(self.free(), allowed - dp * self.base.per_replica)
                self.ask(allowed - dp * self.base.per_replica - free, 0)
                grow_to = self.scale.grow_to(dp, free)  # (room claimed comes at a later check)
                if grow_to is not None:
                    self.joining = (grow_to - dp) * self.base.per_replica
                    self.joining_until = now + START_WAIT_S
                    self.quota.reserve(self.joining)
                    self.group.keep_spares(self.joining)  # the spares there are first
                    return self._joined()
        if spares:
            self.group.keep_spares(spares)
        return False

    def leaving(self) -> dict[str, float]:
        """The nodes Ray is draining that hold workers of this world (node id -> seconds to
        its deadline) once the world should move off them; empty until then. Ray is asked
        every DRAIN_CHECK_S. The replacements start at once, as spares (on nodes not
        draining), and the world trains on while their processes start; the move is due once
        they are ready, or have had START_WAIT_S, or the first deadline is DRAIN_MARGIN_S
        away (a spare already kept, elastic.spares, is ready at once)."""
        now = time.monotonic()
        if not self.drains:
            if now < self.next_drain_check:
                return {}
            self.next_drain_check = now + DRAIN_CHECK_S
            self.drains = {node: left for node, left in self.group.draining_nodes().items()
                           if self.group.on_nodes({node})}
            if not self.drains:
                return {}
            self.replacing = self.group.keep_spares(len(self.group.on_nodes(set(self.drains))))
            self.move_by = now + max(0.0, min(START_WAIT_S, min(self.drains.values()) - DRAIN_MARGIN_S))
        if self.group.spares_ready(self.replacing) or now >= self.move_by:
            return self.drains
        return {}

    def moved(self, stay: bool = False) -> None:
        """The move is made, or (`stay`) found no room elsewhere: then Ray is asked again
        after elastic.rescale_check_s, not at every check (room may free meanwhile; the node
        may go first, as any node may)."""
        self.drains = {}
        if stay:
            self.next_drain_check = time.monotonic() + self.base.elastic.rescale_check_s

    def cap(self, scale: ScalePolicy) -> None:
        """Place and grow within `scale`'s replica counts from now on (`baton scale`)."""
        self.scale, self.most = scale, max(scale.valid_dps) * self.base.per_replica

    def check_soon(self) -> None:
        """Look for room (and keep the spares) at the next step instead of after
        elastic.rescale_check_s: a recovery took a spare, and the next fault should find one."""
        self.next_check = 0.0

    def _joined(self) -> bool:
        """Whether the workers started for a growth are ready, or failed, or have had
        START_WAIT_S (one still queued for room another job took first): the growth's `start`
        then grows by those that started, lets go of the rest and says why they did not."""
        if not self.group.spares_ready(self.joining) and time.monotonic() < self.joining_until:
            return False
        self.joining = 0
        return True

    def no_room(self, placed: int, started: list, wanted: int) -> NoReturn:
        """Too few workers: those that could not start and why, else a worker bigger than
        any node, else the room the cluster has."""
        self.group.release(started)
        r, need = self.base.resources, self.scale.min_workers
        each = f"{r.cpus_per_worker:g} CPU" + (f" and {r.gpus_per_worker:g} GPU" if r.gpus_per_worker else "")
        failures = self.group.start_failures
        if failures:
            others = len(set(failures)) - 1
            raise WorkerError(
                f"{len(failures)} of the {wanted} workers could not start: {failures[0]}"
                + (f" (and {others} other cause{'s' * (others > 1)})" if others else ""))
        big = self.group.largest_node()
        if big["CPU"] + 1e-9 < r.cpus_per_worker or big["GPU"] + 1e-9 < r.gpus_per_worker:
            raise WorkerError(
                f"no node can hold one worker: each needs {each} (resources.cpus_per_worker, "
                f"gpus_per_worker) and the largest node has {big['CPU']:g} CPU"
                + (f" and {big['GPU']:g} GPU" if r.gpus_per_worker else ""))
        raise NoRoom(
            f"could place only {placed} of the {need} workers needed "
            f"(elastic.min_dp x parallel.pp x tp; wanted up to {wanted}) of {each} each within "
            f"{self.base.parallel.timeout_s:g} s (parallel.timeout_s); the cluster "
            f"has {self.group.describe_free()} free")
