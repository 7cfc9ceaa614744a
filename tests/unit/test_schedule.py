"""Pipeline schedules and partitions, without Ray: every schedule finishes (no deadlock), its
idle time matches the papers' formulas, and 1F1B keeps fewer activations alive than GPipe."""

from __future__ import annotations

import pytest

from baton.parallel.partition import balanced, bounds
from baton.parallel.schedule import (SCHEDULES, Action, build, order_problem, simulate,
                                     textbook_bubble)
from baton.tracking.timeline import bubble


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_each_micro_batch_once_without_deadlock(schedule):
    chunks = (1, 2, 3, 4) if schedule == "interleaved-1f1b" else (1,)
    for p in range(1, 9):
        for m in range(1, 33):
            for v in chunks:
                actions = build(schedule, p, m, v)
                for rank_actions in actions:
                    want = sorted((k, mb, c) for k in "FB" for mb in range(m) for c in range(v))
                    assert sorted((a.kind, a.mb, a.chunk) for a in rank_actions) == want
                simulate(actions, p, v)  # raises on a deadlock


@pytest.mark.parametrize("schedule,p,m,v", [
    ("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 4, 16, 1), ("1f1b", 2, 8, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 4, 16, 3)])
def test_idle_time_matches_the_papers(schedule, p, m, v):
    sim = simulate(build(schedule, p, m, v), p, v, fwd_s=1.0, bwd_s=2.0)
    assert sim.bubble == pytest.approx(textbook_bubble(schedule, p, m, v), abs=1e-9)


def test_1f1b_holds_at_most_p_micro_batches_gpipe_holds_m():
    p, m = 4, 16
    assert simulate(build("gpipe", p, m), p).peak_live == [m] * p
    assert simulate(build("1f1b", p, m), p).peak_live == [4, 3, 2, 1]


def test_a_hand_checked_1f1b():
    assert build("1f1b", 2, 4) == [
        [Action("F", 0), Action("F", 1), Action("B", 0), Action("F", 2), Action("B", 1),
         Action("F", 3), Action("B", 2), Action("B", 3)],
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1), Action("F", 2),
         Action("B", 2), Action("F", 3), Action("B", 3)]]


def test_message_order_is_kept_where_nccl_needs_it():
    for p in (2, 3, 4):
        for m in range(p, 4 * p + 1):
            assert order_problem(build("1f1b", p, m), p, 1) is None
            assert order_problem(build("gpipe", p, m), p, 1) is None
            if m % p == 0:
                assert order_problem(build("interleaved-1f1b", p, m, 2), p, 2) is None
    assert order_problem(build("interleaved-1f1b", 2, 5, 2), 2, 2) is not None


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        build("zigzag", 2, 4)
    with pytest.raises(ValueError, match="one chunk per rank"):
        build("1f1b", 2, 4, v=2)


def test_balanced_partition():
    assert balanced([1] * 7, 3) == [2, 2, 3]  # uneven: 7 layers on 3 stages
    assert balanced([5, 1, 1, 1, 1, 5], 3) == [1, 4, 1]  # heavy embedding and head alone
    assert balanced([1, 2, 3], 3) == [1, 1, 1]
    assert bounds([2, 2, 3]) == [(0, 2), (2, 4), (4, 7)]
    with pytest.raises(ValueError):
        balanced([1, 1], 3)


def test_measured_bubble_of_a_made_up_step():
    # two ranks, window 0..10 s; rank 0 busy 6 s, rank 1 busy 8 s: idle 6 of 20
    pipes = [[{"start": 0.0, "end": 6.0, "busy_s": 6.0}, {"start": 2.0, "end": 10.0, "busy_s": 8.0}]]
    assert bubble(pipes) == pytest.approx(0.3)
