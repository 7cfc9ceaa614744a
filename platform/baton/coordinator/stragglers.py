"""Stragglers, for the coordinator: the worker that every step waits for.

Every worker of a synchronous world ends its step together (the last collective waits for the
slowest), so the step's time does not say who is slow. What does is the part of the step a
worker computes without waiting for a peer (`compute_s` in its step result: a data-parallel
replica's forwards, a pipeline rank's forwards and backwards on the CPU; engines whose every
part may wait for a peer report none, and are not compared). Each worker is compared with the
others doing the same work (the replicas of its pipeline stage), by its median over the last
WINDOW steps: one whose median is RATIO times the others', and longer by at least SHARE of
the step and LEAST_S, is named, once, until it keeps up again or the world changes."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Optional

WINDOW = 20  # steps each worker's median is taken over
RATIO = 1.25  # slower than the median of its peers' medians by this factor...
SHARE = 0.05  # ...and by at least this fraction of the step's median time...
# ...and this many seconds: on a shared host, workers' computations of a few milliseconds
# differ by more than RATIO with no worker at fault (measured on the 2-core CI machine, the
# even run of tests/integration/test_data_parallel.py: a tiny GPT's forwards of 1-3 ms, their
# medians up to 2.3x apart but 1.4 ms at most, over 4 runs); a straggler worth naming costs
# more than that
LEAST_S = 0.01


class Stragglers:
    def __init__(self):
        self.world([], None)

    def world(self, workers: list[dict], dims) -> None:
        """A new world: its workers (rank order) and layout; what was seen of the last is
        dropped (its ranks are other workers now)."""
        self.workers, self.dims = workers, dims
        self.seen: deque = deque(maxlen=WINDOW)  # per step: each rank's compute_s
        self.step_s: deque = deque(maxlen=WINDOW)
        self.named: Optional[dict] = None  # the straggler named, while it lags

    def step(self, results: list[dict], step_time_s: float) -> tuple[dict, Optional[dict]]:
        """A completed step: the spread to log (`compute_spread`: the slowest worker's median
        over its peers'), and an event when a straggler is found or keeps up again."""
        times = [r.get("compute_s") for r in results]
        if self.dims is None or None in times or len(times) != len(self.workers):
            return {}, None
        self.seen.append(times)
        self.step_s.append(step_time_s)
        if len(self.seen) < WINDOW // 2:
            return {}, None
        medians = [statistics.median(step[r] for step in self.seen) for r in range(len(times))]
        worst = None  # (ratio, rank, its median, its peers' median)
        for peers in self._peer_groups(len(times)):
            for rank in peers:
                others = statistics.median(medians[p] for p in peers if p != rank)
                ratio = medians[rank] / others if others > 0 else 1.0
                if worst is None or ratio > worst[0]:
                    worst = (ratio, rank, medians[rank], others)
        if worst is None:  # no worker has a peer doing its work
            return {}, None
        ratio, rank, mine, others = worst
        lags = ratio >= RATIO and mine - others >= max(LEAST_S, SHARE * statistics.median(self.step_s))
        event = None
        if lags and (self.named is None or self.named["rank"] != rank):
            w = self.workers[rank]
            self.named = {"rank": rank, "node": w.get("node"), "pid": w.get("pid"),
                          "ratio": round(ratio, 2), "compute_s": round(mine, 4),
                          "peers_s": round(others, 4)}
            event = {"kind": "straggler", **self.named, "window": len(self.seen)}
        elif not lags and self.named is not None:
            event = {"kind": "straggler_cleared", "rank": self.named["rank"]}
            self.named = None
        elif lags:
            self.named.update(ratio=round(ratio, 2), compute_s=round(mine, 4), peers_s=round(others, 4))
        return {"compute_spread": ratio}, event

    def _peer_groups(self, ranks: int) -> list[list[int]]:
        """Ranks doing the same work: a pipeline stage's replicas (all ranks at pp 1)."""
        groups: dict[int, list[int]] = {}
        for rank in range(ranks):
            groups.setdefault(self.dims.coords(rank)[1], []).append(rank)
        return [g for g in groups.values() if len(g) > 1]


def describe(event: dict) -> str:
    """The console's line for a straggler event."""
    if event["kind"] == "straggler_cleared":
        return f"straggler: rank {event['rank']} keeps up again"
    return (f"straggler: rank {event['rank']} (node {str(event['node'])[:12]}, pid {event['pid']}) "
            f"computes {event['ratio']:.1f}x as long as the workers doing its work "
            f"({event['compute_s']:.3f} s a step against {event['peers_s']:.3f} s, median of "
            f"{event['window']} steps); every step waits for it")
