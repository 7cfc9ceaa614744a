"""Stragglers (coordinator/stragglers.py) from step results, without Ray: a worker is compared
with those doing its work (its pipeline stage's replicas) over a window of steps, named once
while it lags, and cleared when it keeps up."""

from __future__ import annotations

from baton.coordinator.stragglers import WINDOW, Stragglers, describe
from baton.parallel import ParallelDims

WORKERS = [{"rank": r, "node": f"node{r}", "pid": 100 + r} for r in range(4)]


def _steps(watch: Stragglers, times: list[float], n: int, step_s: float = 1.0) -> list:
    return [watch.step([{"compute_s": t} for t in times], step_s) for _ in range(n)]


def test_a_worker_that_lags_its_peers_is_named_once_and_cleared_when_it_keeps_up():
    watch = Stragglers()
    watch.world(WORKERS, ParallelDims(dp=4, pp=1))
    out = _steps(watch, [0.2, 0.2, 0.5, 0.21], WINDOW // 2)
    assert all(o == ({}, None) for o in out[:-1])  # half a window first
    spread, event = out[-1]
    assert spread["compute_spread"] == 0.5 / 0.2
    assert event == {"kind": "straggler", "rank": 2, "node": "node2", "pid": 102, "ratio": 2.5,
                     "compute_s": 0.5, "peers_s": 0.2, "window": WINDOW // 2}
    assert describe(event).startswith("straggler: rank 2 (node node2, pid 102) computes 2.5x as "
                                      "long as the workers doing its work (0.500 s a step against 0.200 s")
    assert all(e is None for _, e in _steps(watch, [0.2, 0.2, 0.5, 0.21], 5))  # named once
    events = [e for _, e in _steps(watch, [0.2, 0.2, 0.2, 0.2], WINDOW) if e]
    assert events == [{"kind": "straggler_cleared", "rank": 2}]
    assert watch.named is None


def test_small_or_cheap_differences_and_workers_without_peers_name_no_one():
    watch = Stragglers()
    watch.world(WORKERS, ParallelDims(dp=4, pp=1))
    # 1.2x apart; then 2x apart but 4 ms (under LEAST_S), then 2x of a 10-s step (under SHARE)
    assert not any(e for _, e in _steps(watch, [0.5, 0.5, 0.6, 0.5], WINDOW))
    watch.world(WORKERS, ParallelDims(dp=4, pp=1))
    assert not any(e for _, e in _steps(watch, [0.004, 0.004, 0.008, 0.004], WINDOW, step_s=0.02))
    watch.world(WORKERS, ParallelDims(dp=4, pp=1))
    assert not any(e for _, e in _steps(watch, [0.2, 0.2, 0.4, 0.2], WINDOW, step_s=10.0))
    # pp 4, dp 1: every stage does other work, no one to compare with
    watch.world(WORKERS, ParallelDims(dp=1, pp=4))
    assert _steps(watch, [0.1, 0.1, 0.9, 0.1], WINDOW)[-1] == ({}, None)
    # an engine that measures nothing (sharded, tp) reports no compute_s
    watch.world(WORKERS, ParallelDims(dp=4, pp=1))
    assert watch.step([{}] * 4, 1.0) == ({}, None)


def test_pipeline_ranks_are_compared_within_their_stage():
    """dp 2 x pp 2: ranks 0 and 1 are stage 0's replicas, 2 and 3 stage 1's; stage 1 doing
    twice the work of stage 0 is not a straggler, one of its replicas doing four times is."""
    watch = Stragglers()
    dims = ParallelDims(dp=2, pp=2)
    assert [dims.coords(r)[1] for r in range(4)] == [0, 0, 1, 1]
    watch.world(WORKERS, dims)
    assert not any(e for _, e in _steps(watch, [0.1, 0.1, 0.2, 0.2], WINDOW))
    watch.world(WORKERS, dims)
    events = [e for _, e in _steps(watch, [0.1, 0.1, 0.2, 0.8], WINDOW) if e]
    assert [(e["kind"], e["rank"], e["ratio"]) for e in events] == [("straggler", 3, 4.0)]
