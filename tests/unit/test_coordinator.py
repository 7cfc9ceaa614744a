"""The coordinator's policies and its state machine, without Ray: the policies take plain
values; the state machine runs one transition at a time against a fake worker group whose
workers die, and whose cluster shrinks and grows, on a script."""

from __future__ import annotations

import itertools
import os
import re

import pytest

from baton.checkpoint import CheckpointStore
from baton.checkpoint.store import sizes_only
from baton.coordinator import Coordinator, State
from baton.coordinator.commits import Commits
from baton.coordinator.evaluation import Pass
from baton.coordinator.policy import Failure, FailurePolicy, ScalePolicy
from baton.coordinator.samples import Samples
from baton.data import EpochOrder
from baton.data.feed import Batch, DataFeed
from baton.data.manifest import FileEntry, Manifest
from baton.data.source import JobData, columns
from baton.errors import CheckpointError, DataError, SpecError, WorkerError, WorkerLost, raised_cause
from baton.parallel import ParallelDims
from baton.spec import spec_from_dict
from baton.tracking.mlflow_tracker import NullTracker


# -- policies -----------------------------------------------------------------------------------

def test_failures_are_recovered_up_to_the_budget():
    policy = FailurePolicy(max_failures=2)
    assert policy.decide(Failure(4, "actor_died", "rank 1 died")).recover
    assert policy.decide(Failure(9, "node_died", "rank 0 died")).recover
    decision = policy.decide(Failure(12, "hang", "rank 1 silent"))
    assert not decision.recover
    assert decision.reason == ("giving up after 3 failures, more than elastic.max_failures = 2; "
                               "the last at step 12: rank 1 silent")


def test_an_exception_repeating_at_the_same_step_gives_up_at_once():
    policy = FailurePolicy(max_failures=10)
    assert policy.decide(Failure(3, "exception", "ValueError: bad batch")).recover
    assert policy.decide(Failure(5, "exception", "ValueError: bad batch")).recover  # other step
    assert policy.decide(Failure(3, "actor_died", "ValueError: bad batch")).recover  # not user code
    decision = policy.decide(Failure(3, "exception", "ValueError: bad batch"))
    assert not decision.recover and "came back at step 3" in decision.reason


def test_a_worker_error_is_a_timeout_only_when_a_collective_timed_out():
    """Classified by what raised it, not by a word in the text: v0.5 took any message holding
    "timeout" for a collective's timeout, which the repeat rule did not cover, so a user's
    deterministic bug was retried max_failures times. The gloo message is the one torch 2.13
    raised for a 2-second all_reduce timeout, measured."""
    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 2000ms for recv operation to complete")
    assert raised_cause(gloo) == "timeout"
    assert raised_cause(RuntimeError("[Rank 1] Watchdog caught collective operation timeout: "
                                     "WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600000 ms")) == "timeout"
    for mine in (TimeoutError("timed out reading my table"), RuntimeError("request timeout in my loader"),
                 ValueError("[gloo] timed out"), RuntimeError("my step timed out")):
        assert raised_cause(mine) == "exception", mine
    policy = FailurePolicy(max_failures=10)
    assert policy.decide(Failure(5, "timeout", "rank 0 timed out: X")).recover
    assert not policy.decide(Failure(5, "timeout", "rank 0 timed out: X")).recover  # repeats: give up


def test_without_a_budget_the_failure_is_the_message():
    decision = FailurePolicy(max_failures=0).decide(Failure(4, "exception", "rank 0 failed: X"))
    assert (decision.recover, decision.reason) == (False, "rank 0 failed: X")


def test_unknown_cause_is_refused():
    with pytest.raises(ValueError):
        Failure(1, "cosmic ray", "?")


def test_scale_policy_picks_the_largest_valid_world_that_fits():
    policy = ScalePolicy(valid_dps=(1, 2, 4), per_replica=2)  # dp 3 does not divide the batch
    assert policy.min_workers == 2
    assert policy.target(1) is None  # not even one pipeline
    assert [policy.target(n) for n in (2, 3, 4, 5, 7, 8, 20)] == [1, 1, 2, 2, 2, 4, 4]
    assert policy.grow_to(1, workers_free=1) is None  # 3 workers still hold one pipeline
    assert policy.grow_to(1, workers_free=2) == 2
    assert policy.grow_to(2, workers_free=2) is None  # dp 3 is not valid
    assert policy.grow_to(2, workers_free=4) == 4


HYBRID, TP, TP_2D = ParallelDims(dp=4, dp_shard=2), ParallelDims(dp=2, tp=2), ParallelDims(dp=4, dp_shard=2, tp=2)
TP_PP = ParallelDims(dp=2, pp=2, tp=2)  # rank = (pp_rank * 2 + dp_rank) * 2 + tp_rank
CP = ParallelDims(dp=2, cp=2)  # rank = dp_rank * 2 + cp_rank: every rank holds the whole state
CP_Z = ParallelDims(dp=2, cp=2, sharded_cp=True)  # ZeRO over each replica's cp workers: 2 parts


@pytest.mark.parametrize("dims,left,writers", [
    (HYBRID, {0: 5, 2: 5, 3: 5}, [0, 3]),  # rank 1 lost: rank 3 holds shard 1 (replica group 1)
    (HYBRID, {0: 5, 2: 5}, None),  # shard 1 lost with both its holders
    (HYBRID, {0: 5, 1: 6, 2: 5}, None),  # rank 1 finished a step the coordinator never saw: not used
    (HYBRID, {1: 5, 2: 5}, [1, 2]),  # one shard from each group
    # tp 2, ranks (dp_rank, tp_rank): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1)
    (TP, {0: 5, 2: 5, 3: 5}, [0, 3]),  # rank 1 lost: rank 3 holds tp share 1
    (TP, {0: 5, 2: 5}, None),  # tp share 1 lost with both its holders
    (TP, {1: 5, 2: 5}, [1, 2]),  # one share from each replica
    # 2D: ZeRO-3 over dp_shard 2 of each tp share, two replica groups: 4 parts, 8 ranks
    (TP_2D, {r: 5 for r in range(8) if r != 2}, [0, 1, 3, 6]),  # rank 2 (shard 1, share 0) lost
    (TP_2D, {r: 5 for r in range(8) if r not in (2, 6)}, None),  # both holders of that part
    # pp 2 x tp 2: 4 parts (stage, share); rank 5 (stage 1, replica 0, share 1) lost
    (TP_PP, {r: 5 for r in range(8) if r != 5}, [0, 1, 4, 7]),
    (TP_PP, {r: 5 for r in range(8) if r not in (5, 7)}, None),  # stage 1's share 1 lost twice
    (CP, {0: 5, 2: 5, 3: 5}, [0]),  # cp 2: rank 1 lost, any survivor holds the whole state
    (CP, {3: 5}, [3]),
    (CP_Z, {0: 5, 2: 5, 3: 5}, [0, 3]),  # rank 1 (cp part 1 of replica 0) lost: rank 3 holds it
    (CP_Z, {0: 5, 2: 5}, None),  # cp part 1 lost with both its holders
])
def test_survivors_are_committed_when_every_part_has_one(tmp_path, dims, left, writers):
    """Hybrid sharding (dp 4 in replica groups of 2), tensor parallelism (dp 2 x tp 2), both,
    and context parallelism (dp 2 x cp 2, whose workers hold whole copies, or under ZeRO
    halves): the survivors' state of the last completed step (5) is committed when each part of
    a replica (each shard of each tp share) has a survivor holding it."""

    class Writes:
        written: list = []

        def write_kept(self, ranks, root, step):
            self.written = [ranks, step]
            return written_parts(CheckpointStore(root), step, ["shards/.metadata"] + [
                f"shards/__{r}_0.distcp" for r in ranks])
    store, group = CheckpointStore(str(tmp_path / "ckpt")), Writes()
    committed = Commits(store, NullTracker(), None, keep=2).commit_survivors(
        group, dims, 5, left, {"step": 5})
    assert committed == (writers is not None)
    assert group.written == ([writers, 5] if writers else [])
    assert store.latest() == (5 if writers else None)


def test_elastic_spec_checks_its_range_against_the_batch():
    base = {"name": "e", "train": {"global_batch": 24}, "parallel": {"dp": 2}}
    assert spec_from_dict({**base, "elastic": {"min_dp": 1, "max_dp": 4}}).valid_dps() == [1, 2, 3, 4]
    with pytest.raises(SpecError, match=r"elastic.max_dp: 5 is invalid; train.global_batch 24 "
                                        r"cannot be split over 5 replicas under batch_policy "
                                        r"keep_global; dp values that work: \[1, 2, 3, 4\]"):
        spec_from_dict({**base, "elastic": {"min_dp": 1, "max_dp": 5}})
    with pytest.raises(SpecError, match="elastic.min_dp: 3 is invalid; must be <= parallel.dp = 2"):
        spec_from_dict({**base, "elastic": {"min_dp": 3}})
    with pytest.raises(SpecError, match="elastic.recovery: 'continue' is invalid; continue goes on "
                                        "with fewer replicas after a loss: it needs elastic.min_dp "
                                        "below elastic.max_dp"):
        spec_from_dict({**base, "elastic": {"recovery": "continue"}})
    assert spec_from_dict({**base, "elastic": {"recovery": "continue", "max_dp": 4}}).valid_dps() == [2, 3, 4]
    scaled = spec_from_dict({**base, "batch_policy": "scale_lr", "train": {"global_batch": 24, "lr": 1e-3},
                             "elastic": {"max_dp": 5}})
    assert scaled.at_dp(5).train.global_batch == 60 and scaled.at_dp(5).train.lr == pytest.approx(2.5e-3)
    assert scaled.at_dp(5).fingerprint() != scaled.fingerprint()  # the coordinator keeps the base's


def _job(key, priority, dp, min_dp=1, per_replica=1, cpus=1.0, gpus=0.0, started_at=0.0):
    from baton.coordinator.priorities import Entry

    return Entry(key, f"job-{key}", priority, dp, min_dp, per_replica, cpus, gpus, started_at, "d")


def test_room_is_taken_from_the_lowest_priority_first_and_the_newest_among_equals():
    """A job of priority 5 short of 3 one-CPU workers: the priority-0 jobs give first, the one
    that started last before the older one, each down to its min_dp; a job of equal priority
    and one of higher give nothing."""
    from baton.coordinator.priorities import plan

    me = _job("me", 5, 0)
    others = [_job("old", 0, 3, started_at=1.0), _job("new", 0, 2, started_at=2.0),
              _job("mid", 3, 4), _job("peer", 5, 4), _job("boss", 9, 4)]
    assert plan(me, 3, others, {}) == ({"new": 1, "old": 1}, 3)
    assert plan(me, 1, others, {}) == ({"new": 1}, 1)
    # more than the priority-0 jobs can give: the priority-3 job next; then all there is
    assert plan(me, 5, others, {}) == ({"new": 1, "old": 1, "mid": 2}, 5)
    assert plan(me, 99, others, {}) == ({"new": 1, "old": 1, "mid": 1}, 6)


def test_a_claim_counts_its_room_coming_and_others_claims_hold_a_job_lower():
    """Asked again before the job it claimed from has shrunk, a job does not claim twice;
    after it has shrunk, the room is free (the caller counts it) and the claim stays; a job
    another claim already holds lower gives from there."""
    from baton.coordinator.priorities import plan

    me = _job("me", 5, 0)
    lo = _job("lo", 0, 4)
    assert plan(me, 2, [lo], {"lo": {"me": 2}}) == ({"lo": 2}, 2)  # not yet shrunk: coming
    assert plan(me, 3, [lo], {"lo": {"me": 2}}) == ({"lo": 1}, 3)  # one more
    shrunk = _job("lo", 0, 2)
    assert plan(me, 0, [shrunk], {"lo": {"me": 2}}) == ({"lo": 2}, 0)  # kept, nothing coming
    # another job of higher priority holds it to 3: two more from there, not from 4
    assert plan(me, 2, [lo], {"lo": {"other": 3}}) == ({"lo": 1}, 2)


def test_whole_jobs_are_suspended_only_where_shrinking_leaves_the_smallest_world_short():
    """Jobs shrink toward their min_dp for all the room asked; a job is suspended (a claim of
    0) only while the asking job's smallest world (`need`) still does not fit, lowest priority
    and newest first; a job that is not elastic can only be suspended."""
    from baton.coordinator.priorities import plan

    me = _job("me", 5, 0)
    fixed, elastic = _job("fixed", 0, 2, min_dp=2, started_at=1.0), _job("el", 0, 3)
    assert plan(me, 4, [fixed, elastic], {}, need=2) == ({"el": 1}, 2)  # shrinking serves need
    assert plan(me, 4, [fixed, elastic], {}, need=3) == ({"el": 1, "fixed": 0}, 4)
    assert plan(me, 5, [fixed, elastic], {}, need=5) == ({"el": 0, "fixed": 0}, 5)
    # a job already suspended for me gives nothing more, and its room counts as coming
    assert plan(me, 2, [fixed], {"fixed": {"me": 0}}, need=2) == ({"fixed": 0}, 2)


def test_the_line_goes_by_priority_then_arrival_and_holds_room_for_those_ahead():
    """Waiting jobs get room highest priority first, then longest waiting (a suspended job
    from its suspension); one a ceiling of 0 holds (baton scale's, or a live claim) is out of
    line meanwhile. What free room a job may take leaves the smallest worlds of those ahead of
    it (all of the line, for a running job that would grow) and the workers of jobs starting."""
    from dataclasses import replace

    from baton.coordinator.priorities import held_by_others, line, spoken_for

    def waiting(key, priority, since, **kw):
        return replace(_job(key, priority, 0, **kw), waiting_since=since)

    first, second = waiting("a", 0, 5.0, min_dp=2), waiting("b", 0, 7.0)
    boss, held = waiting("c", 3, 9.0, per_replica=2), replace(waiting("d", 9, 1.0), held=True)
    claimed, running = waiting("e", 9, 1.0), _job("r", 0, 2)
    starting = replace(_job("s", 0, 0, cpus=0.5), starting=3)
    every = [first, second, boss, held, claimed, running, starting]
    claims = {"e": {"hi": 0}, "r": {"hi": 1}}
    assert [e.key for e in line(every, claims)] == ["c", "a", "b"]
    assert [e.key for e in line(every, {})] == ["e", "c", "a", "b"]  # d: held by baton scale
    # b waits behind c (2 workers) and a (2); s's 3 half-CPU workers take 1.5 CPUs: 6 CPUs' worth
    assert spoken_for(second, every, claims) == 6
    assert spoken_for(boss, every, claims) == 2  # first in line: only what is starting
    assert spoken_for(running, every, claims) == 7  # the whole line, before it grows
    assert spoken_for(_job("g", 0, 1, cpus=2.0), every, claims) == 4  # 7 CPUs in 2-CPU workers
    # what the others hold, in b's workers: r's 2 and s's 1.5 CPUs starting
    assert held_by_others(second, every) == 3
    assert held_by_others(_job("gpu", 0, 0, gpus=1.0), every) == 0


def test_a_quota_bounds_what_its_jobs_hold_together_and_one_waiting_for_it_is_out_of_line():
    """resources.quota: a job may have what its quota leaves beside the other jobs counting
    against it (running, and the workers they start), in workers of its own size, each
    resource bounded only where the quota names it; a job waiting for its quota is out of the
    line (room is not held for it), its place kept."""
    from dataclasses import replace

    from baton.coordinator.priorities import line, spoken_for
    from baton.coordinator.quotas import quota_holders, quota_left

    quotas = {"team": {"CPU": 4.0, "GPU": None}, "gpus": {"CPU": None, "GPU": 2.0}}
    a = replace(_job("a", 0, 2, cpus=1.0), quota="team")  # holds 2 CPUs
    b = replace(_job("b", 0, 0, cpus=0.5), quota="team", starting=2)  # starting 1 CPU's worth
    me = replace(_job("me", 0, 0, cpus=0.5), quota="team")
    other = _job("o", 0, 4, cpus=1.0)  # no quota: not counted
    every = [a, b, me, other]
    assert quota_left(me, every, quotas) == 2  # 4 - 2 - 1 CPUs, in half-CPU workers
    assert quota_left(replace(me, cpus=2.0), every, quotas) == 0
    assert quota_left(other, every, quotas) is None  # no quota named
    assert quota_left(replace(me, quota="unset"), every, quotas) is None  # named, none set
    assert quota_holders(me, every) == ["job-a", "job-b"]
    g = replace(_job("g", 0, 0, cpus=4.0, gpus=1.0), quota="gpus")
    g2 = replace(_job("g2", 0, 1, cpus=8.0, gpus=1.0), quota="gpus")
    assert quota_left(g, [g, g2], quotas) == 1  # GPUs bounded, CPUs not
    assert quota_left(g, [g, replace(g2, dp=2)], quotas) == 0

    first = replace(_job("w1", 0, 0, min_dp=2), quota="team", waiting_since=1.0, over_quota=True)
    second = replace(_job("w2", 0, 0), waiting_since=2.0)
    assert [e.key for e in line([first, second], {})] == ["w2"]
    assert spoken_for(_job("r", 0, 1), [first, second], {}) == 1  # w1's 2 workers not held for it
    assert [e.key for e in line([replace(first, over_quota=False), second], {})] == ["w1", "w2"]


def test_a_job_waits_in_line_only_for_room_other_jobs_hold_on_a_cluster_that_cannot_grow():
    """Room for its smallest world (2 workers): it starts. Short, with the rest held by jobs of
    the list: it waits in line. Short with room no job holds (another application's, or
    nothing), or an autoscaler to add nodes: it starts and its workers wait for the room, as a
    lone job's do. A suspended job waits for room however it comes."""
    from baton.coordinator.priorities import waits_in_line

    assert not waits_in_line(2, 2, free=2, held=0, suspended=False, autoscaled=False)
    assert waits_in_line(1, 2, free=1, held=1, suspended=False, autoscaled=False)
    assert waits_in_line(0, 2, free=2, held=4, suspended=False, autoscaled=False)  # spoken for
    assert not waits_in_line(1, 2, free=1, held=0, suspended=False, autoscaled=False)
    assert not waits_in_line(0, 2, free=0, held=4, suspended=False, autoscaled=True)
    assert waits_in_line(0, 2, free=0, held=0, suspended=True, autoscaled=True)


def test_room_the_line_cannot_use_yet_is_lent_behind_it_and_claimed_back():
    """Two free CPUs, and `head` (priority 0, min_dp 4) first in line: it cannot start, so
    `small` (min_dp 2) behind it borrows them. Not where the head could start on them, nor
    with what it could claim from a job of lower priority, nor where the room is starting for
    another job. Once 2 more CPUs are free the head claims the lent room back (whole, as from
    a job of lower priority, though of its own priority); only the jobs it was lent by, and
    only while they have waited since."""
    from dataclasses import replace

    from baton.coordinator.priorities import backfills, could_start, lends, plan

    head = replace(_job("head", 0, 0, min_dp=4), waiting_since=5.0)
    small = replace(_job("small", 0, 0, min_dp=2), waiting_since=7.0)
    runs = _job("runs", 0, 2)  # holds 2 CPUs
    every = [head, small, runs]
    assert [e.key for e in backfills(small, 2, 2.0, 0.0, every, {})] == ["head"]
    assert backfills(small, 1, 1.0, 0.0, every, {}) == []  # too little for small's smallest world
    assert backfills(head, 4, 2.0, 0.0, every, {}) == []  # first in line: nobody lends it room
    assert backfills(small, 2, 4.0, 0.0, every, {}) == []  # the head could start: it goes first
    starting = replace(_job("new", 0, 0), starting=2)
    assert backfills(small, 2, 4.0, 0.0, [*every, starting], {}) != []  # 2 of the 4 are taken
    boss = replace(head, priority=1)  # could claim the 2 CPUs of a priority-0 job: it starts
    assert could_start(boss, 2.0, 0.0, [boss, small, runs], {})
    assert backfills(replace(small, priority=1), 2, 2.0, 0.0, [boss, replace(small, priority=1), runs], {}) == []
    # small started on the lent room: the head claims it back when that makes its world
    borrowed = replace(small, waiting_since=0.0, dp=2, borrows=("head",), borrowed_at=8.0)
    every = [head, borrowed, runs]
    assert lends(head, borrowed) and not lends(replace(head, key="other"), borrowed)
    assert plan(head, 4, every, {}, need=4) == ({"small": 0}, 2)  # too little: not claimed (ask)
    assert plan(head, 2, every, {}, need=2) == ({"small": 0}, 2)  # with 2 free CPUs: claimed
    assert could_start(head, 2.0, 0.0, every, {}) and not could_start(head, 1.0, 0.0, every, {})
    # a head that started after and came back to the line is owed nothing; nor a running one
    assert not lends(replace(head, waiting_since=9.0), borrowed)
    assert not lends(replace(head, waiting_since=0.0), borrowed)
    assert plan(replace(head, waiting_since=9.0), 2, every, {}, need=2) == ({}, 0)


def test_a_job_starting_from_the_line_leaves_room_for_those_behind_that_fit_beside_it():
    """`first` (min_dp 1) starts on 4 workers' room: of the jobs behind it, `two` (2 workers)
    and `one` (1) fit beside its smallest world, in line order; `big` (4) does not, and is
    left nothing. A job first in line alone takes it all."""
    from dataclasses import replace

    from baton.coordinator.priorities import left_behind

    def waiting(key, since, **kw):
        return replace(_job(key, 0, 0, **kw), waiting_since=since)

    first, big, two, one = waiting("first", 1.0), waiting("big", 2.0, min_dp=4), \
        waiting("two", 3.0, min_dp=2), waiting("one", 4.0)
    every = [first, big, two, one]
    assert left_behind(first, 4, every, {}) == 3  # two and one: first keeps 1
    assert left_behind(first, 3, every, {}) == 2  # two fits; then one does not
    assert left_behind(first, 1, every, {}) == 0
    assert left_behind(first, 4, [first], {}) == 0
    assert left_behind(one, 4, every, {}) == 0  # last in line
    # counted in a 2-CPU worker's size: big's four 1-CPU workers are two, and fit first
    assert left_behind(replace(first, cpus=2.0), 3, every, {}) == 2


def test_room_is_pooled_by_what_a_worker_takes():
    """A replica of pp 2 at 0.5 CPU a worker frees one CPU; a GPU job takes only from jobs
    with GPUs; a worker of 2 CPUs needs two of a 1-CPU job's replicas."""
    from baton.coordinator.priorities import plan

    halves = _job("pp", 0, 3, per_replica=2, cpus=0.5)
    assert plan(_job("me", 1, 0), 2, [halves], {}) == ({"pp": 1}, 2)
    gpu_me = _job("me", 1, 0, gpus=1.0)
    cpu_only, gpus = _job("cpu", 0, 4), _job("gpu", 0, 3, gpus=1.0, started_at=-1.0)
    assert plan(gpu_me, 1, [cpu_only, gpus], {}) == ({"gpu": 2}, 1)
    assert plan(_job("me", 1, 0, cpus=2.0), 1, [_job("lo", 0, 4)], {}) == ({"lo": 2}, 1)


# -- the state machine against a fake group ---------------------------------------------------

class FakeCluster:
    """Room for `free` more workers; scripted failures by step: (cause, rank, node lost)."""

    def __init__(self, free: int):
        self.free = free
        self.failures: dict[int, tuple[str, int, bool]] = {}
        self.ledger_failures: dict[int, int] = {}  # step -> the rank lost while its ledger is read
        self.pids = itertools.count(100)
        self.requested: list[int] = []  # what was asked of the autoscaler, in order
        self.slow_writes = False  # background writes still going at every step boundary
        self.start_checks = 0  # how often a new spare is found still starting before it is ready
        self.draining: dict[str, float] = {}  # node -> seconds to its deadline, as Ray says


class FakeGroup:
    """The WorkerGroup interface, in memory. A ref is (rank, method, args); results are
    computed when waited on, in submission order, as actors would."""

    def __init__(self, spec, dims, cluster: FakeCluster):
        self.cluster, self.actors, self.infos = cluster, [], []
        self.dead: set[int] = set()
        self.probes_skipped: list[frozenset] = []  # the ranks each probe left out
        self.done: dict[int, int] = {}  # rank -> last step completed (the state it holds)
        self.kept_written: list[tuple[list[int], int]] = []
        self.writing: dict[int, list] = {}  # rank -> a background save's parts
        self.calls: list[tuple[str, int]] = []
        self.ledgers: dict[int, list] = {}
        self.spares: list = []
        self.starting = 0  # checks left before the spares made last are ready

    spares_taken = 0
    start_failures: list = []  # no worker dies before it is ready here

    def launch(self, n):
        pass  # start creates them: in memory, nothing to overlap

    def start(self, n, timeout_s, need=None, grace_s=0.0):
        pool, self.spares = self.spares[:n], self.spares[n:]  # spares first, as WorkerGroup
        self.spares_taken += len(pool)
        k = min(n - len(pool), self.cluster.free)
        self.cluster.free -= k
        return pool + [(f"actor-{pid}", {"pid": pid, "node": f"node-{pid}"})
                       for pid in itertools.islice(self.cluster.pids, k)]

    def keep_spares(self, n):
        make = min(n - len(self.spares), self.cluster.free)
        if make > 0:
            self.cluster.free -= make
            self.spares += [(f"spare-{pid}", {"pid": pid})
                            for pid in itertools.islice(self.cluster.pids, make)]
            self.starting = self.cluster.start_checks  # new processes: not ready at once
        return len(self.spares)

    def ready_spares(self):
        return len(self.spares) if self.starting <= 0 else 0

    def keep_as_spares(self, members):
        self.spares += members

    def spares_ready(self, n):
        """Ready once asked `cluster.start_checks` times since the last were made."""
        self.starting -= 1
        return self.starting < 0

    def free_workers(self):
        return self.cluster.free + len(self.spares)

    def request_capacity(self, workers):
        self.cluster.requested.append(workers)

    def draining_nodes(self):
        return dict(self.cluster.draining)

    def on_nodes(self, nodes):
        return [r for r, info in enumerate(self.infos) if info.get("node") in nodes]

    def describe_free(self):
        return {"CPU": self.cluster.free}

    def largest_node(self):
        return {"CPU": 1.0, "GPU": 0.0}  # each worker fits a node

    def form(self, members, spec, dims):
        self.spec, self.dims = spec, dims
        self.actors, self.infos = [a for a, _ in members], [i for _, i in members]
        self.dead, self.ledgers, self.done = set(), {}, {}

    def members(self, ranks=None):
        ranks = range(len(self.actors)) if ranks is None else ranks
        return [(self.actors[r], self.infos[r]) for r in ranks]

    def setup(self, record_samples, stage_layers, columns=None, keep_state=False):
        return [{"rank": r, **info} for r, info in enumerate(self.infos)]

    def submit(self, method, *args):
        return [(rank, method, args) for rank in range(len(self.actors))]

    def submit_step(self, step, *args):
        return self.submit("train_step", step, *args)

    def call(self, method, *args, what="", checkpoint=False):
        return self.wait(self.submit(method, *args), what or method)

    def wait(self, refs, what, ranks=None, checkpoint=False):
        out = []
        for rank, method, args in refs:
            self.calls.append((method, rank))
            if method == "train_step" and args[0] + 1 in self.cluster.failures:
                cause, lost, node = self.cluster.failures.pop(args[0] + 1)
                self.dead.add(lost)
                if not node:
                    self.cluster.free += 1  # a killed process frees its slot; a lost node does not
            if method == "take_ledger" and self.done.get(rank) in self.cluster.ledger_failures:
                self.dead.add(self.cluster.ledger_failures.pop(self.done[rank]))
                self.cluster.free += 1
            if rank in self.dead or (method == "train_step" and self.dead):
                raise WorkerLost(f"worker rank {min(self.dead)} died while {what}", "actor_died",
                                 tuple(sorted(self.dead)))
            if method == "train_step":
                step, batch = args[0], args[1]
                part = self.dims.replica_part(batch.positions, rank)
                self.ledgers.setdefault(rank, []).append((step, part.tolist()))
                self.done[rank] = step + 1
                out.append({"tokens": 10, "loss_sum": 20.0, "grad_norm": 0.5,
                            "state_bytes": {"params": 8, "grads": 8, "optimizer": 16}})
            elif method == "take_ledger":
                out.append(self.ledgers.pop(rank, []))
            elif method == "load":
                self.done[rank] = args[1]
            elif method == "share_state":
                self.done[rank] = args[0]
            elif method == "digest":
                out.append("same")
            elif method == "save":  # what a worker writes (Worker.save)
                dp_rank, pp_rank = self.dims.coords(rank)
                parts = written_parts(CheckpointStore(args[0]), args[1], [f"rng-rank{rank:04d}.pt"] + (
                    [f"model-{pp_rank:04d}.pt", f"optim-{pp_rank:04d}.pt"] if dp_rank == 0 else []))
                if args[2]:  # in the background: the records come from `written`
                    self.writing[rank] = parts
                    parts = None
                out.append(parts)
            elif method == "written":
                out.append(self.writing.pop(rank))
            else:
                out.append(None)
        return out

    def finished(self, refs):
        return not self.cluster.slow_writes

    def probe(self, timeout_s, skip=frozenset()):
        self.probes_skipped.append(skip)
        return {r: "silent" if r in skip else "dead" if r in self.dead else "ok"
                for r in range(len(self.actors))}

    def leave(self, ranks, timeout_s):
        return {r: self.done.get(r, 0) for r in ranks}

    def write_kept(self, ranks, root, step):
        self.kept_written.append((ranks, step))
        return written_parts(CheckpointStore(root), step, [
            f"{kind}-{self.dims.coords(r)[1]:04d}.pt" for r in ranks for kind in ("model", "optim")])

    def check_sums(self, root, step, parts):  # read here, as the workers would
        self.calls.append(("check_sums", step))
        return CheckpointStore(root).check_sums(step, parts)

    def kill(self, ranks):
        pass

    def release(self, members):
        self.cluster.free += len(members)

    def abandon(self, refs):
        pass

    def discard(self, refs):
        pass

    def shutdown(self, finished=False):
        self.cluster.free += len(self.actors) - len(self.dead)
        self.actors = []


def written_parts(store, step, names):
    """Small real files under `names` in checkpoint `step`, and their records, as workers
    return them."""
    for name in names:
        os.makedirs(os.path.dirname(f"{store.step_dir(step)}/{name}"), exist_ok=True)
    return [store.write_tensors(step, name, {"name": name}) for name in names]


class OrderOnlyFeed:
    """The data feed without Ray Data: the order's positions, no units to read."""

    cursor, rebased, enter = (staticmethod(DataFeed.cursor), staticmethod(DataFeed.rebased),
                              staticmethod(DataFeed.enter))  # one corpus

    def __init__(self, order):
        self.order = order

    def next_batch(self, cursor, global_batch):
        return Batch(self.order.next_batch(cursor, global_batch), {})

    def take_skipped(self):
        return []  # (no unit is read, none is bad)

    def close(self):
        pass


def _coordinator(tmp_path, cluster, parallel=None, sections=None, until=None, **elastic):
    spec = spec_from_dict({
        "name": "fake", "data": {"source": "parquet", "path": str(tmp_path)},
        "train": {"steps": 8, "global_batch": 4, "warmup_steps": 0},
        "parallel": parallel or {"dp": 2}, "checkpoint": {"path": str(tmp_path / "ckpt"), "every_steps": 2},
        "tracking": {"enabled": False}, "elastic": {"max_failures": 3, **elastic}, **(sections or {})})
    c = Coordinator(spec, NullTracker(), record_samples=True, show_progress=False,
                    group_factory=lambda s, d: FakeGroup(s, d, cluster), until=until)
    # what _prepare does with Ray and the data, stood in for: 12 samples, 3 steps an epoch
    c.manifest = Manifest(str(tmp_path), [FileEntry("part-0.parquet", 100, (5, 7))])
    c.data = JobData(c.manifest, columns(spec))
    c.run_id = None
    c.samples = Samples(OrderOnlyFeed(EpochOrder(c.manifest.unit_rows, 0)), c.manifest)
    c.report.opened(spec.train.steps, 0, "tok")
    c._launch()
    c.state = State.SCHEDULING
    return c


def _tick_until(c, predicate, limit=50):
    states = []
    for _ in range(limit):
        c.tick()
        states.append(c.state)
        if predicate(c):
            return states
    raise AssertionError(f"never reached; states {states}")


class FeedWithBadRows(OrderOnlyFeed):
    """Raises as a feed does when the rows of its `bad`th batch (from 1) cannot be read."""

    def __init__(self, order, bad):
        super().__init__(order)
        self.drawn, self.bad = 0, bad

    def next_batch(self, cursor, global_batch):
        self.drawn += 1
        if self.drawn == self.bad:
            raise DataError("data.path: part-0.parquet row group 1: data.columns.inputs holds NaN")
        return super().next_batch(cursor, global_batch)


class BadHeldOut:
    """An evaluation due after step 3, whose held-out rows cannot be read."""

    step, last = 0, {}  # (none done)

    def due(self, done):
        return done == 3

    def submit(self, group, global_batch):
        raise DataError("data.path: part-0.parquet row group 0: data.columns.label has 1 null rows")

    def close(self):
        pass


def test_rows_found_bad_as_they_are_read_stop_on_a_committed_checkpoint_of_the_step_reached(tmp_path):
    """A batch whose rows cannot be read (the 5th), with checkpoints due only every 100
    steps: the steps queued train, checkpoint 4 is committed, and the run stops in one line
    saying so, no step trained lost. Held-out rows (the pass after step 3): that step, already
    queued, trains first. Before the run trained a step there is nothing to keep."""
    every_100 = {"checkpoint": {"path": str(tmp_path / "ckpt"), "every_steps": 100}}
    c = _coordinator(tmp_path, FakeCluster(free=2), sections=every_100)
    c.samples = Samples(FeedWithBadRows(EpochOrder(c.manifest.unit_rows, 0), 5), c.manifest)
    with pytest.raises(DataError) as e:
        _tick_until(c, lambda c: False)
    assert str(e.value) == ("data.path: part-0.parquet row group 1: data.columns.inputs holds NaN "
                            "(training stopped at step 4: checkpoint 4 committed; with the file "
                            "fixed in place, its row groups as they were, --rebase-data goes on "
                            "from there)")
    assert CheckpointStore(c.spec.checkpoint_dir).latest() == 4 and c.step == 4

    held = {"checkpoint": {"path": str(tmp_path / "held"), "every_steps": 100}}
    c = _coordinator(tmp_path, FakeCluster(free=2), sections=held)
    c.evaluation = BadHeldOut()
    with pytest.raises(DataError, match=r"has 1 null rows \(training stopped at step 3: checkpoint 3 committed;"):
        _tick_until(c, lambda c: False)
    assert CheckpointStore(c.spec.checkpoint_dir).latest() == 3

    first = {"checkpoint": {"path": str(tmp_path / "first"), "every_steps": 100}}
    c = _coordinator(tmp_path, FakeCluster(free=2), sections=first)
    c.samples = Samples(FeedWithBadRows(EpochOrder(c.manifest.unit_rows, 0), 1), c.manifest)
    with pytest.raises(DataError, match=r"holds NaN$"):
        _tick_until(c, lambda c: False)
    assert CheckpointStore(c.spec.checkpoint_dir).latest() is None


def test_a_warm_spare_replaces_a_lost_worker_and_never_blocks_a_growth(tmp_path):
    """elastic.spares: room the job cannot grow into holds a standby worker, which the next
    recovery takes before starting any; room it can grow into is grown into, not kept."""
    cluster = FakeCluster(free=3)
    cluster.failures[5] = ("actor_died", 1, False)
    c = _coordinator(tmp_path, cluster, spares=1, rescale_check_s=1e-9)  # dp 2, max_dp 2
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2 and cluster.free == 1
    c.tick()  # a step, and the rescale check before it keeps a spare in the free room
    assert len(c.group.spares) == 1 and cluster.free == 0
    spare_pid = c.group.spares[0][1]["pid"]
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2
    assert [w["pid"] for w in c.workers][1] == spare_pid and not c.group.spares
    c.tick()  # the first step after: the recovery is recorded
    recovery = [e for e in c.events if e["kind"] == "recovery"][0]
    assert recovery["workers_new"] == 1 and recovery["workers_from_spares"] == 1

    grow = FakeCluster(free=1)
    g = _coordinator(tmp_path / "grow", grow, spares=1, min_dp=1, rescale_check_s=1e-9)
    g.tick()
    g.tick()
    assert g.dims.dp == 1 and grow.free == 0 and not g.group.spares
    grow.free = 1  # a node joins: dp 2 fits, so the room is grown into, not kept as a spare
    g.tick()  # the growth's worker is started (a spare until the growth takes it)
    assert g.state is State.RESCALING
    g.tick()
    assert g.state is State.RUNNING and g.dims.dp == 2 and grow.free == 0 and not g.group.spares


def test_a_job_grows_only_within_what_its_quota_leaves_it(tmp_path):
    """resources.quota: with room for 4 replicas, an elastic job (min_dp 1, max_dp 4) whose
    quota leaves it 3 workers starts with 2 (dp 3 does not divide its batch) and does not
    grow past them; the quota raised to 4, it grows to dp 4 at its next check, its 2 new
    workers reserved in the quota while they start."""
    import contextlib
    from types import SimpleNamespace

    cluster = FakeCluster(free=4)
    c = _coordinator(tmp_path, cluster, sections={"train": {"steps": 30, "global_batch": 4, "warmup_steps": 0}},
                     min_dp=1, max_dp=4, rescale_check_s=1e-9)
    allowed, reserved = [3], []
    c.placement.quota = SimpleNamespace(allowance=lambda: allowed[0], reserve=reserved.append,
                                        claiming=contextlib.nullcontext)
    c.first_workers = c.placement.first_workers()
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2
    for _ in range(4):
        c.tick()
    assert c.dims.dp == 2 and cluster.free == 2
    allowed[0] = 4
    _tick_until(c, lambda c: c.dims.dp == 4)
    assert cluster.free == 0 and c.step < 30 and reserved == [2]  # the growth's 2 workers


def test_a_spare_taken_by_a_recovery_is_replaced_at_the_next_step(tmp_path):
    """The pool refills right after a recovery takes its spare, not at the next rescale check
    (every 10 s by default): a second fault soon after should find a spare too."""
    cluster = FakeCluster(free=3)
    cluster.failures[5] = ("actor_died", 1, False)
    c = _coordinator(tmp_path, cluster, spares=1, rescale_check_s=1000)
    c.tick()
    c.tick()  # the first step's check keeps a spare; the next check is 1000 s away
    assert len(c.group.spares) == 1
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.state is State.RUNNING and not c.group.spares
    cluster.free = 1  # the dead worker's room
    c.tick()  # the recovery's first step, then the next one's check
    c.tick()
    assert len(c.group.spares) == 1 and cluster.free == 0


def test_training_goes_on_while_a_growths_workers_start(tmp_path):
    """Room to grow into gets its workers at once, and the world grows once they are ready:
    the steps in between are trained at the old size, not spent waiting for the new
    processes to start (3.4-3.9 s of a growth on 2 cores)."""
    cluster = FakeCluster(free=1)
    cluster.start_checks = 3
    c = _coordinator(tmp_path, cluster, min_dp=1, rescale_check_s=1e-9)
    c.tick()
    c.tick()
    assert c.dims.dp == 1 and c.step == 1
    notes = []
    c.report.progress.note = notes.append
    cluster.free = 1  # a node joins
    for _ in range(3):  # its worker is starting: dp 1 trains on
        c.tick()
        assert c.state is State.RUNNING and c.dims.dp == 1 and len(c.group.spares) == 1
    assert c.step == 4
    assert notes == ["step 1: room to grow: 1 new worker starting, training goes on at dp=1"]
    c.tick()
    assert c.state is State.RESCALING and c.step == 4
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2 and not c.group.spares
    assert [e["kind"] for e in c.events] == []  # recorded at its first step
    c.tick()
    rescale = [e for e in c.events if e["kind"] == "rescale"][0]
    # the step queued behind step 4 is finished first, at dp 1
    assert rescale["workers_new"] == 1 and rescale["resumed_from_step"] == 5


def test_a_growth_waits_for_its_workers_at_most_the_start_wait(tmp_path, monkeypatch):
    """A worker started for a growth may wait in Ray's queue (another job took the room
    first): after START_WAIT_S the growth goes ahead, and its `start` decides."""
    from baton.coordinator import placement

    monkeypatch.setattr(placement, "START_WAIT_S", 0.0)
    cluster = FakeCluster(free=1)
    cluster.start_checks = 1000  # never ready
    c = _coordinator(tmp_path, cluster, min_dp=1, rescale_check_s=1e-9)
    c.tick()
    c.tick()
    cluster.free = 1
    c.tick()
    assert c.state is State.RESCALING


def test_node_loss_shrinks_then_a_join_grows_back(tmp_path):
    cluster = FakeCluster(free=2)
    cluster.failures[4] = ("node_died", 1, True)
    c = _coordinator(tmp_path, cluster, min_dp=1, rescale_check_s=1e-9)

    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2 and cluster.free == 0
    assert cluster.requested == [2]  # an autoscaler is asked for room for max_dp replicas
    states = _tick_until(c, lambda c: c.state is State.RECOVERING)
    assert c.step == 3 and states[-1] is State.RECOVERING
    assert set(cluster.requested) == {2}  # renewed only while short of max_dp: never here
    assert len(cluster.requested) == 1
    # one transition: the survivor kept, its state (step 3) committed as checkpoint 3, no room
    # for more workers: dp 1 from step 3
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 1 and c.step == 3
    assert c.group.kept_written == [([0], 3)] and CheckpointStore(c.store.root).latest() == 3
    assert c.samples.cursor.state_dict() == {"epoch": 1, "consumed": 0}
    assert {step for step, _, _ in c.samples.ledger} == {0, 1, 2}  # step 4 is not in the ledger
    recovery_at = len(c.events)
    assert [e["kind"] for e in c.events] == ["failure"]

    c.tick()  # step 4 again, at dp 1: the recovery is complete
    assert c.step == 4 and [e["kind"] for e in c.events] == ["failure", "recovery"]
    recovery = c.events[recovery_at]
    assert recovery["state_from"] == "survivors" and recovery["resumed_from_step"] == 3
    assert recovery["workers_reused"] == 1 and recovery["workers_new"] == 0

    asked = len(cluster.requested)
    cluster.free = 1  # a node joins
    c.tick()
    assert c.state is State.RESCALING
    assert len(cluster.requested) > asked and set(cluster.requested) == {2}  # renewed at dp 1
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2
    # every worker took the old rank 0's state of this step over the new group: no
    # checkpoint was written and read back for the growth
    assert [r for method, r in c.group.calls if method == "share_state"] == [0, 1]
    assert CheckpointStore(c.store.root).latest() < c.step
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert c.step == 8 and [dp for _, dp in c.dp_history] == [2, 1, 2]
    assert [e["kind"] for e in c.events] == ["failure", "recovery", "rescale"]
    assert set(c.events[2]["phases_s"]) == {"queued_steps", "checkpoint", "reschedule", "group_init",
                                            "state_copy", "first_step"}
    ids = [i for step, _, part in sorted(c.samples.ledger) for i in part]
    assert sorted(ids[:12]) == list(range(12)) and sorted(ids[12:24]) == list(range(12))


def test_baton_scale_gives_replicas_back_and_lets_the_job_grow_again(tmp_path):
    """`baton scale --max-dp 1` while dp 2 runs: at its next check (every step here) the job
    commits a checkpoint of the step, re-forms at dp 1 from it and lets the other worker go
    (its room is free); it does not grow back while the ceiling holds, though there is room;
    `--clear` lets it grow again. Every sample is trained once per epoch."""
    import baton
    from baton.status import describe

    cluster = FakeCluster(free=2)
    c = _coordinator(tmp_path, cluster, min_dp=1, rescale_check_s=1e-9)
    _tick_until(c, lambda c: c.step == 2)
    baton.scale(c.base, 1)  # what `baton scale JOB --max-dp 1` writes
    states = _tick_until(c, lambda c: c.state is State.RUNNING and c.dims.dp == 1)
    # step 3 was queued behind step 2: trained, then the checkpoint of step 3 re-formed from
    assert State.SHRINKING in states and c.step == 3 and cluster.free == 1
    assert CheckpointStore(c.store.root).latest() == 3
    _tick_until(c, lambda c: c.step == 5)
    assert c.dims.dp == 1 and cluster.free == 1  # room, and no growth into it
    lines = describe(c.status())
    assert "  at most 1 replica (baton scale; --clear lifts it)" in lines
    rescale = next(e for e in c.events if e["kind"] == "rescale")
    assert (rescale["from_dp"], rescale["dp"], rescale["asked"]) == (2, 1, "baton scale")
    baton.scale(c.base, None)  # --clear
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [dp for _, dp in c.dp_history] == [2, 1, 2] and c.step == 8
    ids = [i for step, _, part in sorted(c.samples.ledger) for i in part]
    assert sorted(ids[:12]) == list(range(12)) and sorted(ids[12:24]) == list(range(12))


def test_baton_scale_to_0_suspends_any_job_until_cleared(tmp_path):
    """`baton scale --max-dp 0` on a job that is not elastic: at its next check it commits a
    checkpoint of the step, lets every worker go (their room free) and waits, its status
    saying so; `--clear` and it starts its workers again and goes on from that checkpoint in
    the same run. Every sample is trained once per epoch."""
    import baton
    from baton.status import describe

    cluster = FakeCluster(free=2)
    c = _coordinator(tmp_path, cluster, rescale_check_s=1e-9)
    _tick_until(c, lambda c: c.step == 2)
    baton.scale(c.base, 0)
    _tick_until(c, lambda c: c.state is State.SUSPENDED)
    assert c.step == 3 and cluster.free == 2 and CheckpointStore(c.store.root).latest() == 3
    c.tick()  # a check: still suspended
    assert c.state is State.SUSPENDED
    lines = describe(c.status())
    assert lines[0].startswith("fake: suspended") and \
        "  suspended at step 3: baton scale --max-dp 0; --clear goes on from there" in lines
    baton.scale(c.base, None)
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert c.step == 8 and [e["kind"] for e in c.events] == ["suspend", "resume"]
    assert c.events[1]["resumed_from_step"] == 3 and c.events[1]["dp"] == 2
    ids = [i for step, _, part in sorted(c.samples.ledger) for i in part]
    assert sorted(ids[:12]) == list(range(12)) and sorted(ids[12:24]) == list(range(12))


@pytest.mark.parametrize("args,message", [
    (["--max-dp", "3"], "--max-dp 3: give 1 (elastic.min_dp) to 2 (elastic.max_dp), or 0 to suspend it"),
    ([], "give --max-dp N, or --clear"),
    (["--max-dp", "1", "--clear"], "give --max-dp N, or --clear"),
    (["--max-dp", "1", "--set", "elastic.min_dp=2"], "job 'fake' is not elastic (elastic.min_dp "
                                                     "and max_dp are both 2)"),
    (["--max-dp", "-1"], "--max-dp -1: give 1 (elastic.min_dp) to 2 (elastic.max_dp), or 0"),
])
def test_baton_scale_refuses_a_ceiling_the_job_cannot_keep_in_one_line(tmp_path, capsys, args, message):
    from baton import cli
    from baton.coordinator import ceiling
    from helpers import write_spec

    job = write_spec(tmp_path / "job.yaml", {
        "name": "fake", "data": {"source": "parquet", "path": str(tmp_path)},
        "train": {"steps": 8, "global_batch": 4}, "parallel": {"dp": 2},
        "checkpoint": {"path": str(tmp_path / "ckpt")}, "elastic": {"min_dp": 1}})
    assert cli.main(["scale", str(job), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "ckpt" / "fake" / ceiling.FILE).exists()
    (tmp_path / "ckpt" / "fake").mkdir(parents=True)
    (tmp_path / "ckpt" / "fake" / ceiling.FILE).write_text("{not json")  # a broken one: not obeyed
    assert ceiling.asked(CheckpointStore(str(tmp_path / "ckpt" / "fake"))) is None


def test_continue_goes_on_with_the_survivors_and_grows_back_once_replacements_start(tmp_path):
    """elastic.recovery continue: the world re-forms at once from the survivor (dp 1) instead
    of waiting for a new worker's process, the replacement starts at the recovery's first
    step as a growth's worker does, and the world grows back once it is ready. Every sample
    is still trained once an epoch."""
    cluster = FakeCluster(free=2)
    cluster.failures[4] = ("actor_died", 1, False)  # its room is free again at once
    cluster.start_checks = 2
    c = _coordinator(tmp_path, cluster, min_dp=1, recovery="continue")  # rescale_check_s 10
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 1 and c.step == 3
    assert cluster.free == 1 and not c.group.spares  # nothing started in the recovery
    c.tick()  # the recovery's first step, at dp 1
    recovery = [e for e in c.events if e["kind"] == "recovery"][0]
    assert recovery["workers_reused"] == 1 and recovery["workers_new"] == 0 and recovery["dp"] == 1
    c.tick()  # the next step's check starts the replacement (not 10 s later), and dp 1 goes on
    assert c.state is State.RUNNING and c.dims.dp == 1 and len(c.group.spares) == 1
    _tick_until(c, lambda c: c.state is State.RESCALING)
    c.tick()
    assert c.dims.dp == 2 and not c.group.spares
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [dp for _, dp in c.dp_history] == [2, 1, 2]
    assert [e["kind"] for e in c.events] == ["failure", "recovery", "rescale"]
    ids = [i for step, _, part in sorted(c.samples.ledger) for i in part]
    assert sorted(ids[:12]) == list(range(12)) and sorted(ids[12:24]) == list(range(12))


def test_continue_keeps_a_survivor_beyond_whole_replicas_as_a_spare_for_the_growth(tmp_path):
    """dp 4 loses one worker: the 3 survivors make 2 replicas (a batch of 4 splits over 1, 2
    or 4); the third waits as a spare instead of being let go, and the growth back to 4
    takes it with one new worker."""
    cluster = FakeCluster(free=4)
    cluster.failures[2] = ("actor_died", 3, False)
    c = _coordinator(tmp_path, cluster, parallel={"dp": 4}, min_dp=1, recovery="continue")
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.dims.dp == 2 and len(c.group.spares) == 1 and cluster.free == 1
    kept = c.group.spares[0]
    _tick_until(c, lambda c: c.state is State.RESCALING)
    c.tick()
    assert c.dims.dp == 4 and kept[0] in c.group.actors and cluster.free == 0
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [dp for _, dp in c.dp_history] == [4, 2, 4]


def test_a_killed_worker_is_replaced_at_the_same_world_size(tmp_path):
    cluster = FakeCluster(free=2)
    cluster.failures[3] = ("actor_died", 0, False)
    c = _coordinator(tmp_path, cluster)
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.dims.dp == 2 and c.step == 2
    _tick_until(c, lambda c: c.state is State.FINISHED)
    recovery = c.events[1]
    assert cluster.requested == []  # a fixed world asks an autoscaler for nothing
    assert recovery["workers_reused"] == 1 and recovery["workers_new"] == 1
    assert c.group.probes_skipped == [{0}]  # the dead rank is not asked again (a frozen one
    # would hold the answer back for the probe's whole timeout)
    # the survivor held step 2, which checkpoint 2 already has: loaded from there
    assert recovery["state_from"] == "checkpoint" and recovery["resumed_from_step"] == 2
    assert set(recovery["phases_s"]) == {"stop", "survivor_save", "reschedule", "group_init",
                                         "checkpoint_load", "first_step"}


def test_a_draining_node_is_left_at_a_step_boundary_with_nothing_lost(tmp_path):
    """Ray drains a node before it goes (a preemption notice): its workers are moved off at
    the next step boundary, from a checkpoint of that step written with every worker alive.
    No failure, no step trained twice, and the leaving worker is let go."""
    cluster = FakeCluster(free=3)
    c = _coordinator(tmp_path, cluster)
    _tick_until(c, lambda c: c.step == 3)
    leaving = c.workers[0]
    cluster.draining = {leaving["node"]: 28.0, "node-elsewhere": 5.0}  # one of ours, one not
    c.placement.next_drain_check = 0.0  # asked every second; these steps take microseconds
    _tick_until(c, lambda c: c.state is State.MOVING)
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2
    moved_at = c.step  # the steps queued at the notice were trained first
    assert moved_at >= 3 and CheckpointStore(c.spec.checkpoint_dir).latest() == moved_at
    assert leaving["pid"] not in [w["pid"] for w in c.workers]
    cluster.draining = {}
    _tick_until(c, lambda c: c.state is State.FINISHED)
    drain, move = c.events
    assert drain == {**drain, "kind": "drain", "step": moved_at, "nodes": [leaving["node"]],
                     "ranks": [0], "deadline_in_s": 28.0, "moved": True}
    assert move["kind"] == "move" and move["resumed_from_step"] == moved_at
    assert move["from_dp"] == move["dp"] == 2 and move["workers_moved"] == move["workers_new"] == 1
    assert set(move["phases_s"]) == {"queued_steps", "checkpoint", "reschedule", "group_init",
                                     "checkpoint_load", "first_step"}
    # 8 steps of 2 ranks, each trained once (a rewind would train some again)
    assert sum(method == "train_step" for method, _ in c.group.calls) == 16
    assert sorted(step for step, _, _ in c.samples.ledger) == sorted(list(range(8)) * 2)
    assert not c.failures.seen


def test_a_draining_node_with_no_room_elsewhere_keeps_its_workers_until_there_is(tmp_path):
    """Nowhere to go (dp 2 is the least, and no node has room): the world stays, with this
    step's checkpoint committed, and asks again after rescale_check_s; once room appears the
    workers move."""
    cluster = FakeCluster(free=2)
    c = _coordinator(tmp_path, cluster, rescale_check_s=1e-9)
    _tick_until(c, lambda c: c.step == 2)
    cluster.draining = {c.workers[1]["node"]: float("inf")}
    c.placement.next_drain_check = 0.0  # asked every second; these steps take microseconds
    _tick_until(c, lambda c: c.state is State.MOVING)
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 2
    [drain] = c.events
    assert drain["moved"] is False and drain["deadline_in_s"] is None and drain["ranks"] == [1]
    assert CheckpointStore(c.spec.checkpoint_dir).latest() == drain["step"]
    cluster.free = 1  # a node joins
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [e["kind"] for e in c.events] == ["drain", "drain", "move"]
    assert c.events[1]["moved"] is True and not c.failures.seen


def test_the_budget_spent_fails_the_run(tmp_path):
    cluster = FakeCluster(free=2)
    cluster.failures.update({3: ("actor_died", 0, False), 5: ("actor_died", 1, False)})
    c = _coordinator(tmp_path, cluster, max_failures=1)
    with pytest.raises(WorkerError, match="giving up after 2 failures"):
        c.run()
    assert c.state is State.FAILED and CheckpointStore(c.store.root).latest() == 4


def test_fewer_than_min_dp_fails_with_what_the_cluster_has(tmp_path, monkeypatch):
    import baton.coordinator.placement as placement

    # the wait for room (parallel.timeout_s, 120 s here) runs on a clock that sleeping
    # advances: patched where the wait is (placement.py since the coordinator left it there;
    # patching the coordinator's clock let this test wait the real 120 s in CI)
    monkeypatch.setattr(placement, "time", _FastClock())
    cluster = FakeCluster(free=2)
    cluster.failures[3] = ("node_died", 1, True)
    c = _coordinator(tmp_path, cluster)  # min_dp = dp = 2: no shrinking
    with pytest.raises(WorkerError, match=r"could place only 1 of the 2 workers needed"):
        c.run()


class _FastClock:
    """time, with sleep that advances the clock instead of waiting."""

    def __init__(self):
        import time

        self._time, self._offset = time, 0.0

    def monotonic(self):
        return self._time.monotonic() + self._offset

    def sleep(self, s):
        self._offset += s

    def __getattr__(self, name):
        return getattr(self._time, name)


def test_growing_twice_in_a_row_records_both_rescales(tmp_path):
    """Room for more appears again before the first step after a rescale (seen on the
    autoscaler test once the data stopped being read before scheduling): the coordinator
    trains that step first, so each rescale's event is recorded (the second used to overwrite
    the first's pending record)."""
    cluster = FakeCluster(free=1)
    c = _coordinator(tmp_path, cluster, min_dp=1, max_dp=4, rescale_check_s=1e-9)
    c.tick()
    assert c.state is State.RUNNING and c.dims.dp == 1
    cluster.free = 1
    c.tick()
    assert c.state is State.RESCALING
    c.tick()
    assert c.dims.dp == 2 and c.resumed is not None
    cluster.free = 2  # room for dp 4 before dp 2 has trained a step
    c.tick()
    assert c.state is State.RUNNING and c.resumed is None  # a step, not a rescale
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [dp for _, dp in c.dp_history] == [1, 2, 4]
    assert [e["kind"] for e in c.events] == ["rescale", "rescale"]


def test_a_rescale_verifies_the_checkpoint_it_loads(tmp_path):
    """A growth of a world whose replicas hold their state in shards (here ZeRO-1) writes a
    checkpoint and loads it into the larger world; that load is verified as a recovery's is.
    Here the checkpoint the growth wrote is damaged between its commit and the load: it is
    set aside, the world goes back to the checkpoint before it, and the run still trains
    every step once."""
    damaged = []

    class Damaging(FakeGroup):
        def form(self, members, spec, dims):
            if dims.dp == 2:  # the growth's world, formed after its checkpoint was committed
                store = CheckpointStore(str(tmp_path / "ckpt" / "fake"))
                damaged.append(store.latest())
                part = tmp_path / "ckpt" / "fake" / f"step_{damaged[0]:08d}" / "model-0000.pt"
                data = bytearray(part.read_bytes())
                data[len(data) // 2] ^= 0xFF
                part.write_bytes(bytes(data))
            super().form(members, spec, dims)

    cluster = FakeCluster(free=1)
    c = _coordinator(tmp_path, cluster, {"dp": 2, "shard": "optimizer"}, min_dp=1,
                     rescale_check_s=1e-9)
    c.group_factory = lambda s, d: Damaging(s, d, cluster)
    c._launch()
    _tick_until(c, lambda c: c.step == 4)
    assert c.dims.dp == 1 and c.store.latest() == 4
    cluster.free = 1  # room for dp 2
    _tick_until(c, lambda c: c.state is State.RESCALING)
    c.tick()
    (step,) = damaged
    assert step > 4 and step % 2 == 1  # written for the growth (every_steps is 2)
    assert c.state is State.RUNNING and c.dims.dp == 2 and c.step == 4
    rejected = [e for e in c.events if e["kind"] == "checkpoint_rejected"]
    assert [(e["step"], e["why"]) for e in rejected] == [
        (step, "part model-0000.pt does not match its checksum")]
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert c.step == 8 and sorted({step for step, _, _ in c.samples.ledger}) == list(range(8))


def test_a_recovery_skips_a_checkpoint_that_fails_verification(tmp_path):
    """Checkpoint 6 is damaged on disk after its commit (one byte of a part flipped); the
    failure at step 7 leaves no survivor state newer than it, so the recovery loads a
    checkpoint: 6 fails its checksum, is set aside, and the run goes back to 4."""
    cluster = FakeCluster(free=2)
    cluster.failures[7] = ("actor_died", 1, False)
    c = _coordinator(tmp_path, cluster)
    _tick_until(c, lambda c: c.store.latest() == 6)
    part = tmp_path / "ckpt" / "fake" / "step_00000006" / "model-0000.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    _tick_until(c, lambda c: c.state is State.RECOVERING)
    c.tick()
    assert c.state is State.RUNNING and c.step == 4
    rejected = [e for e in c.events if e["kind"] == "checkpoint_rejected"]
    assert [(e["step"], e["why"]) for e in rejected] == [
        (6, "part model-0000.pt does not match its checksum")]
    assert c.store.committed_steps() == [4]  # 6 stays on disk (REJECTED), never loaded
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert c.store.latest() == 8 and c.store.verify(6) is None  # step 6 written again, whole


def test_a_resume_whose_checkpoint_fails_its_checksums_on_the_workers_goes_back(tmp_path):
    """The driver checks a resume's checkpoint by size only (api.plan_resume); the workers
    check the checksums before loading. A flipped byte in checkpoint 6 sends the run back to
    4 (set aside, warned, the resume's tag corrected); with every checkpoint damaged the run
    is refused rather than started over on top of them."""
    first = _coordinator(tmp_path, FakeCluster(free=2))
    _tick_until(first, lambda c: c.store.latest() == 6)
    first.group.shutdown()

    def flip(step):
        part = tmp_path / "ckpt" / "fake" / f"step_{step:08d}" / "model-0000.pt"
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))

    flip(6)
    assert first.store.latest_verified(sizes_only) == (6, [])  # what the driver sees
    c = _coordinator(tmp_path, FakeCluster(free=2))
    c.resume_meta = c.store.read_meta(6)
    c.tick()
    assert c.state is State.RUNNING and c.step == 4 and c.resume_meta["step"] == 4
    assert ("check_sums", 6) in c.group.calls and ("check_sums", 4) in c.group.calls
    assert [(e["step"], e["why"]) for e in c.events if e["kind"] == "checkpoint_rejected"] == [
        (6, "part model-0000.pt does not match its checksum")]
    assert c.store.committed_steps() == [4]  # (keep: 2 had dropped 2)

    flip(4)
    c = _coordinator(tmp_path, FakeCluster(free=2))
    c.resume_meta = c.store.read_meta(4)
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(checkpoint 4: part "
                                              r"model-0000.pt does not match its checksum\); move"):
        c.tick()
    assert c.store.committed_steps() == []


def test_background_saves_commit_at_the_next_boundary_and_the_end_waits_for_the_last(tmp_path):
    """checkpoint.async: each save returns at once and is committed from `written` at the
    next step boundary; the run's last checkpoint is committed before it finishes."""
    c = _coordinator(tmp_path, FakeCluster(free=2))
    c.commits.background = True
    _tick_until(c, lambda c: c.state is State.FINISHED)
    saves = [(m, r) for m, r in c.group.calls if m in ("save", "written")]
    assert saves == [(m, r) for _ in (2, 4, 6, 8) for m in ("save", "written") for r in (0, 1)]
    assert c.store.committed_steps() == [6, 8] and c.store.verify(8) is None
    assert c.commits.pending is None and c.commits.last.endswith("step_00000008")


@pytest.mark.parametrize("free,shard", [(1, "none"), (2, "none"), (2, "full")])
def test_parameters_are_hashed_only_where_there_are_replicas_to_compare(tmp_path, free, shard):
    """Each checkpoint compares the replicas' parameter digests; a world of one replica (here
    the cluster holds one worker, or two hold one replica's shards) has nothing to compare
    and hashes nothing."""
    c = _coordinator(tmp_path, FakeCluster(free=free), parallel={"dp": 2, "shard": shard}, min_dp=1)
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert c.dims.dp == free and c.store.committed_steps() == [6, 8]
    digests = [r for m, r in c.group.calls if m == "digest"]
    replicas = free == 2 and shard == "none"
    assert digests == ([0, 1] * 4 if replicas else [])
    assert c.commits.replica_digests == (["same", "same"] if replicas else [])


def test_saves_due_faster_than_the_store_writes_them_are_said_once_and_all_commit(tmp_path, capsys):
    """A background write still going when the next save is due: training waits for it (one
    in flight at most). The run says so once, with the wait, and every save still commits."""
    cluster = FakeCluster(free=2)
    cluster.slow_writes = True
    c = _coordinator(tmp_path, cluster)
    c.commits.background = True
    _tick_until(c, lambda c: c.state is State.FINISHED)
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, warnings
    assert re.fullmatch(r"warning: checkpoint 4 came due while checkpoint 2 was still being written "
                        r"in the background, and training waited \d+\.\d\d s for that write \(one "
                        r"is in flight at most\): save less often \(checkpoint.every_steps\) or to "
                        r"a faster store", warnings[0]), warnings
    assert c.store.committed_steps() == [6, 8] and c.commits.pending is None


def test_a_worker_lost_while_its_ledger_is_read_leaves_step_and_cursor_together(tmp_path):
    """Step 5 completes on both workers; rank 0 is lost as its ledger is read. The step used
    to be counted before that read and the data cursor after it, so the survivors' state of
    step 5 was committed with the cursor of step 4: one batch trained twice and every later
    epoch shifted (found by benchmarks/chaos.py). Now the step counts only with its ledger:
    the run goes on from a consistent point and every sample is trained once per epoch."""
    cluster = FakeCluster(free=2)
    cluster.ledger_failures[5] = 0
    c = _coordinator(tmp_path, cluster, min_dp=1)
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [e["kind"] for e in c.events][:1] == ["failure"] and not cluster.ledger_failures
    assert sorted({step for step, _, _ in c.samples.ledger}) == list(range(8))
    for epoch in (0, 1):  # 12 samples, 3 steps an epoch: epochs 0 and 1 whole
        ids = [i for step, _, part in c.samples.ledger if step // 3 == epoch for i in part]
        assert sorted(ids) == list(range(12)), (epoch, sorted(ids))


def test_a_worker_killed_for_memory_is_named_out_of_memory():
    """Ray's memory monitor kills an actor that starts while its node runs low on memory: the
    start fails with ActorDiedError whose exit detail says so (the message's layout as Ray
    prints it, ray-project/ray#28778; not triggered here: that would take this machine's memory).
    Named as out of memory with the node's figures, not as the actor's generic death."""
    import ray
    from ray.core.generated.common_pb2 import ActorDiedErrorContext

    from baton.workers.group import why_not_started

    detail = ("The actor is dead because its worker process has died. Worker exit type: USER_ERROR "
              "Worker exit detail: Task was killed due to the node running low on memory.\n"
              "Memory on the node (IP: 10.0.3.7, ID: 208ebdd0) where the task was running was "
              "30.41GB / 31.00GB (0.981), which exceeds the memory usage threshold of 0.95.")
    died = ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        error_message=detail, class_name="Worker", actor_id=bytes(16), node_ip_address="10.0.3.7"))
    assert why_not_started(died) == (
        "out of memory: Memory on the node (IP: 10.0.3.7, ID: 208ebdd0) where the task was "
        "running was 30.41GB / 31.00GB (0.981), which exceeds the memory usage threshold of 0.95.")
    plain = ray.exceptions.ActorDiedError(ActorDiedErrorContext(
        error_message="The actor is dead because it was killed by `ray.kill`.", class_name="Worker",
        actor_id=bytes(16)))
    assert why_not_started(plain) == "The actor died unexpectedly before finishing this task."


def test_a_replicas_tp_workers_are_ranked_on_one_node_where_they_can_be():
    """placement.together: workers as Ray placed them, alternating over two nodes with one
    left over: each run of tp = 2 neighbouring ranks is on one node, and the worker that
    could not join one comes last, where a world of fewer replicas leaves it out."""
    from baton.coordinator.placement import together

    placed = [(f"w{i}", {"node": node}) for i, node in enumerate("ABABA")]
    ranked = together(placed, 2)
    assert [a for a, _ in ranked] == ["w0", "w2", "w1", "w3", "w4"]
    nodes = [info["node"] for _, info in ranked]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]
    assert together(placed, 1) == placed  # without tp, the order stays


def test_a_run_paused_at_a_step_ends_there_on_a_checkpoint_and_says_so(tmp_path):
    """`until` (baton run --until 5, checkpoints every 2 steps): steps 1-5 and no more are
    handed to the workers, the run ends "paused" on a checkpoint of step 5, and its status
    says how to go on."""
    from baton.status import describe

    c = _coordinator(tmp_path, FakeCluster(free=2), until=5)
    _tick_until(c, lambda c: c.state in (State.PAUSED, State.FINISHED))
    assert (c.state, c.step, c.flight.submitted) == (State.PAUSED, 5, 5)
    assert c.store.committed_steps()[-1] == 5 and c._result().state == "paused"
    lines = describe(c.status())
    assert lines[0].startswith("fake: paused (updated ")
    assert "  paused at step 5 of 8: run the job again to go on" in lines


class ScriptedEvaluation:
    """The held-out evaluation's interface (coordinator/evaluation.py), after every step, with
    eval_loss scripted by step: queued on the workers behind its step as the real one is (the
    fake group evaluates nothing)."""

    def __init__(self, losses: dict):
        self.losses, self.last, self.step, self.judged = losses, {}, 0, []

    def due(self, done):
        return True

    def submit(self, group, global_batch):
        return Pass([group.submit("evaluate")], [1])

    def collect(self, group, queued, step):
        for batch_refs in queued.refs:
            group.wait(batch_refs, f"evaluating after step {step}")
        self.judged.append(step)
        self.last, self.step = {"eval_loss": self.losses[step], "eval_samples": 4}, step
        return self.last

    def close(self):
        pass


def _stopping(tmp_path, cluster, losses, parallel=None, **eval_):
    c = _coordinator(tmp_path, cluster, parallel, sections={
        "eval": {"path": str(tmp_path), "every_steps": 1, **eval_},
        "checkpoint": {"path": str(tmp_path / "ckpt"), "every_steps": 2, "best": "eval_loss"}})
    c.evaluation = ScriptedEvaluation(losses)
    return c


# the best so far improves at 2 and 3, not (by more than 0) at 4, 5 and 6
LOSSES = {1: 5.0, 2: 4.0, 3: 3.9, 4: 3.95, 5: 3.97, 6: 3.99, 7: 3.0, 8: 2.0}


@pytest.mark.parametrize("patience,min_delta,stop", [(2, 0.0, 5), (3, 0.0, 6), (2, 0.2, 4), (9, 0.0, None)])
def test_the_run_stops_once_patience_evaluations_have_not_improved(tmp_path, patience, min_delta, stop):
    """eval.patience: the run ends at the evaluation that spends it, on a checkpoint of that
    step (written for it where the step is not a checkpoint step), with nothing trained or
    queued past it; the state it stops with is that checkpoint's, so a resume is refused
    until the patience is raised, and goes on from there once it is."""
    from baton.api import plan_resume

    c = _stopping(tmp_path, FakeCluster(free=2), LOSSES, patience=patience, min_delta=min_delta)
    _tick_until(c, lambda c: c.state is State.FINISHED)
    result = c._result()
    if stop is None:
        assert c.step == 8 and result.stopped_early is None
        return
    assert c.step == stop and c.evaluation.judged == list(range(1, stop + 1))
    assert c.flight.submitted == stop  # no step past it was handed to the workers
    assert c.store.latest() == stop and c.store.verify(stop) is None
    best = 3 if min_delta == 0 else 2  # the improvement that counted last
    assert result.stopped_early == {
        "step": stop, "metric": "eval_loss", "best": LOSSES[best], "best_step": best,
        "waited": patience, "why": f"eval_loss has not improved on {LOSSES[best]:g} (step {best}) "
                                  f"by more than {min_delta:g} in {patience} evaluations (eval.patience {patience})"}
    assert [e["kind"] for e in c.events] == ["early_stop"]
    assert c.store.read_meta(stop)["early_stop"]["waited"] == patience
    from baton.status import describe

    assert f"  stopped early at step {stop}: {result.stopped_early['why']}" in describe(c.status())

    with pytest.raises(CheckpointError, match=rf"job 'fake' already stopped early at step {stop}: "
                                              rf"eval_loss has not improved .* raise eval.patience"):
        plan_resume(c.base, "job.yaml", None)
    more = spec_from_dict({**c.base.to_dict(), "eval": {**c.base.to_dict()["eval"], "patience": patience + 1}})
    meta, _ = plan_resume(more, "job.yaml", None)
    assert meta["step"] == stop and meta["early_stop"]["waited"] == patience


def test_a_recovery_from_a_checkpoint_counts_its_evaluations_again_from_there(tmp_path):
    """dp 1 loses its only worker at step 6: the run goes back to checkpoint 4 and evaluates 5
    again. The count of evaluations without improvement is checkpoint 4's, not the one the
    lost run had reached (which had counted 5 already and would stop a step early)."""
    cluster = FakeCluster(free=2)
    cluster.failures[6] = ("actor_died", 0, False)
    c = _stopping(tmp_path, cluster, LOSSES, parallel={"dp": 1}, patience=3)
    _tick_until(c, lambda c: c.state is State.FINISHED)
    assert [e["kind"] for e in c.events] == ["failure", "recovery", "early_stop"]
    assert c.events[1]["resumed_from_step"] == 4 and c.events[1]["state_from"] == "checkpoint"
    assert c.evaluation.judged == [1, 2, 3, 4, 5, 5, 6]
    assert c.step == 6 and c._result().stopped_early["waited"] == 3
