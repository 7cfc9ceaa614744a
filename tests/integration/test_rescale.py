"""A resize before the first step: the new world takes a state of step 0, whose optimizer never
stepped (rank 0 sends it; a sharded world saves and loads a checkpoint of it). torch's
get/set_state_dict would "initialise" such an optimizer with a zero-gradient step, leaving
Adam's step count at 1, and every later update would be off (by 5e-2 after 8 steps). Found by
the autoscaling fault test; here it is forced on a local Ray."""

from __future__ import annotations

import time

from ray.util.placement_group import placement_group, remove_placement_group

from baton.checkpoint import CheckpointStore
from baton.coordinator import Coordinator
from baton.coordinator.coordinator import State
from baton.spec import spec_from_dict
from baton.tracking import make_tracker
from helpers import assert_params_close, await_growth, reference_run, tiny_spec, write_dataset


def test_growing_before_the_first_step_keeps_the_maths(tmp_path, local_ray):
    data = write_dataset(tmp_path / "data", 40, 32)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="grow-at-0", train={"steps": 8, "global_batch": 8, "micro_batch": None},
        resources={"cpus_per_worker": 1}, elastic={"min_dp": 1, "max_dp": 2, "rescale_check_s": 1e-9}))
    blocker = placement_group([{"CPU": 1}])  # room for one worker at the start
    local_ray.get(blocker.ready(), timeout=60)
    c = Coordinator(spec, make_tracker(spec.tracking), record_samples=True, show_progress=False)
    try:
        c.tick()
        c.tick()
        assert c.state is State.RUNNING and c.dims.dp == 1 and c.step == 0
        remove_placement_group(blocker)  # a second CPU is free before step 1
        deadline = time.monotonic() + 30
        while local_ray.available_resources().get("CPU", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # what the first step's rescale check does: it starts the growth's worker (training
        # would go on meanwhile); here the first step waits for it, so the world grows before it
        assert not c.placement.growth_due(c.dims.dp) and c.placement.joining == 1
        await_growth(c)
        while c.state not in (State.FINISHED, State.FAILED):
            c.tick()
    finally:
        if c.group is not None:
            c.group.shutdown()
        c.priorities.close()  # (as run() does)
    assert c.state is State.FINISHED and c.dp_history == [(0, 1), (0, 2)]
    assert [e["kind"] for e in c.events] == ["rescale"] and c.events[0]["resumed_from_step"] == 0
    assert "state_copy" in c.events[0]["phases_s"]  # rank 0's state, sent to the new worker
    want, _, _ = reference_run(spec, data, steps=8)
    got = CheckpointStore(spec.checkpoint_dir).read_model(8)
    assert_params_close(got, want, rtol=1e-5, atol=1e-5)


def test_baton_scale_gives_a_worker_back_mid_run_with_every_sample_once(tmp_path, local_ray):
    """`baton scale JOB --max-dp 1` while the job trains at dp 2 (one CPU a worker, the local
    Ray's 2): within a check the job re-forms at dp 1 from a checkpoint of the step it reached,
    the other worker's CPU is free again, the run finishes, and its ledger holds every sample
    once per epoch. Not grown back while the ceiling holds."""
    from collections import Counter

    from baton import api, cli
    from baton.coordinator import ceiling
    from helpers import write_spec

    data = write_dataset(tmp_path / "data", 40, 32)
    raw = tiny_spec(tmp_path, data, name="scaled", train={"steps": 8, "global_batch": 8, "micro_batch": None},
                    resources={"cpus_per_worker": 1}, checkpoint={"every_steps": 4, "keep": 4},
                    elastic={"min_dp": 1, "max_dp": 2, "rescale_check_s": 1e-9})
    job = write_spec(tmp_path / "job.yaml", raw)
    spec = spec_from_dict(raw)
    freed = []

    def on_step(c):
        if c.step == 2:
            assert cli.main(["scale", str(job), "--max-dp", "1"]) == 0
        if c.step == 6:  # after the shrink: the let-go worker's CPU is free again
            deadline = time.monotonic() + 30
            while local_ray.available_resources().get("CPU", 0) < 1:
                assert time.monotonic() < deadline, local_ray.available_resources()
                time.sleep(0.1)
            freed.append(c.dims.dp)

    result = api.run(spec, record_samples=True, show_progress=False, on_step=on_step)
    assert result.step == 8 and freed == [1]
    assert [dp for _, dp in result.dp_history] == [2, 1]
    rescale = next(e for e in result.events if e["kind"] == "rescale")
    assert (rescale["from_dp"], rescale["dp"], rescale["asked"]) == (2, 1, "baton scale")
    by_epoch = {0: Counter(), 1: Counter()}
    for step, _, ids in result.ledger:
        by_epoch[0 if step < 5 else 1].update(ids)
    assert sorted({step for step, _, _ in result.ledger}) == list(range(8))
    assert sorted(by_epoch[0]) == list(range(1000, 1040)) and set(by_epoch[0].values()) == {1}
    assert sum(by_epoch[1].values()) == 24 and set(by_epoch[1].values()) == {1}
    assert ceiling.asked(CheckpointStore(spec.checkpoint_dir)) == 1  # kept for a resume
    assert cli.main(["scale", str(job), "--clear"]) == 0
    assert ceiling.asked(CheckpointStore(spec.checkpoint_dir)) is None


def test_a_job_of_higher_priority_takes_room_from_a_lower_one_which_grows_back(tmp_path, local_ray):
    """`lo` (elastic 1-2, one CPU a worker) holds both of the local Ray's CPUs when `hi`
    (resources.priority 1, dp 1) starts: hi claims one of lo's replicas, lo shrinks to dp 1 at
    its next check from a checkpoint of the step it reached (no failure counted), hi trains on
    the CPU it let go and ends, its claim withdrawn, and lo grows back to dp 2 and finishes with
    every sample once per epoch. The cluster's list is empty afterwards. (lo sleeps 0.1 s a
    step while it waits for each of these, so that it does not finish first.)"""
    import threading
    from collections import Counter

    from baton import api
    from baton.coordinator import priorities
    from baton.status import describe

    data = write_dataset(tmp_path / "data", 40, 32)
    lo = spec_from_dict(tiny_spec(
        tmp_path, data, name="lo", train={"steps": 400, "global_batch": 8, "micro_batch": None},
        resources={"cpus_per_worker": 1}, checkpoint={"every_steps": 100, "keep": 2},
        elastic={"min_dp": 1, "max_dp": 2, "rescale_check_s": 0.2}))
    hi = spec_from_dict(tiny_spec(
        tmp_path / "hi", data, name="hi", train={"steps": 4, "global_batch": 8, "micro_batch": None},
        parallel={"dp": 1, "timeout_s": 60}, resources={"cpus_per_worker": 1, "priority": 1}))
    ran, said = [], {}

    def hi_step(c):
        said.setdefault("hi", describe(c.status()))

    hi_run = threading.Thread(target=lambda: ran.append(api.run(hi, show_progress=False, on_step=hi_step)))

    def on_step(c):
        if c.step == 2:
            hi_run.start()
        elif c.step > 2 and c.dims.dp == 1 and hi_run.is_alive():
            said["lo"] = describe(c.status())
            hi_run.join(timeout=120)  # hi trains on the CPU lo let go
        elif c.step > 2 and (hi_run.is_alive() or c.dims.dp < 2):
            time.sleep(0.1)

    result = api.run(lo, record_samples=True, show_progress=False, on_step=on_step)
    hi_run.join(timeout=120)
    assert ran and ran[0].state == "finished" and ran[0].step == 4
    assert "  at most 1 replica (room given to job hi, of higher priority, while it runs)" in said["lo"]
    assert "  room taken from: lo (at most 1 replica)" in said["hi"]
    assert result.state == "finished" and result.step == 400
    assert [dp for _, dp in result.dp_history] == [2, 1, 2], result.events
    rescales = [e for e in result.events if e["kind"] == "rescale"]
    assert [(e["from_dp"], e["dp"], e.get("asked")) for e in rescales] == [
        (2, 1, "priority: hi"), (1, 2, None)]
    assert not [e for e in result.events if e["kind"] == "failure"]
    by_epoch: dict = {}
    for step, _, ids in result.ledger:  # 5 steps an epoch
        by_epoch.setdefault(step // 5, Counter()).update(ids)
    assert len(by_epoch) == 80
    assert all(sorted(seen) == list(range(1000, 1040)) and set(seen.values()) == {1}
               for seen in by_epoch.values())
    assert priorities._keys("") == []


def test_a_claim_whose_job_is_gone_is_dropped(tmp_path, local_ray):
    """A claim left by a driver Ray marks dead (or one that does not read) holds nothing: the
    job it was on reads no ceiling from it and deletes it."""
    from baton.coordinator import priorities

    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path, name="claimed",
                                    elastic={"min_dp": 1, "max_dp": 2}))
    mine = priorities.Priorities(spec)
    live = local_ray.get_runtime_context().get_job_id()
    priorities._put(f"claim/{mine.key}/gone", {"max_dp": 1, "by": "gone", "priority": 3, "driver": "ffff0000"})
    priorities._put(f"claim/{mine.key}/broken", {"max_dp": "one"})
    assert mine.ceiling() is None and priorities._keys(f"claim/{mine.key}/") == []
    priorities._put(f"claim/{mine.key}/here", {"max_dp": 1, "by": "here", "priority": 3, "driver": live})
    assert mine.ceiling() == 1 and mine.holding == [{"by": "here", "priority": 3, "max_dp": 1}]
    priorities._delete(f"claim/{mine.key}/here")


def test_a_job_that_cannot_shrink_is_suspended_and_goes_on_bitwise(tmp_path, local_ray):
    """`lo` (dp 2, not elastic, one CPU a worker) holds the local Ray's CPUs when `hi`
    (priority 1, dp 1) starts: lo cannot shrink, so it is suspended (a checkpoint of the step it
    reached, every worker let go), hi trains and ends, and lo starts again from that
    checkpoint in the same run and ends bit for bit where a run of its own ends."""
    import threading

    import torch

    from baton import api
    from baton.coordinator import priorities
    from baton.status import describe

    data = write_dataset(tmp_path / "data", 40, 32)

    def lo_spec(where):
        return spec_from_dict(tiny_spec(
            where, data, name="lo", train={"steps": 100, "global_batch": 8, "micro_batch": None},
            resources={"cpus_per_worker": 1}, checkpoint={"every_steps": 50, "keep": 2},
            elastic={"rescale_check_s": 0.2}))

    hi = spec_from_dict(tiny_spec(
        tmp_path / "hi", data, name="hi", train={"steps": 4, "global_batch": 8, "micro_batch": None},
        parallel={"dp": 1, "timeout_s": 60}, resources={"cpus_per_worker": 1, "priority": 1}))
    ran, said = [], {}

    def hi_step(c):
        if c.step == 1:  # lo has given its workers: what `baton status` says of each
            said["hi"] = describe(c.status())
            said["lo"] = describe(CheckpointStore(lo.checkpoint_dir).read_status())

    hi_run = threading.Thread(target=lambda: ran.append(api.run(hi, show_progress=False, on_step=hi_step)))

    def on_step(c):
        if c.step == 2:
            hi_run.start()
        elif c.step > 2 and hi_run.is_alive():
            time.sleep(0.1)

    lo = lo_spec(tmp_path)
    result = api.run(lo, show_progress=False, on_step=on_step)
    hi_run.join(timeout=120)
    assert ran and ran[0].state == "finished" and ran[0].step == 4
    assert "  room taken from: lo (suspended)" in said["hi"]
    assert said["lo"][0].startswith("lo: suspended") and any(
        line.startswith("  suspended at step ") and "given to job hi, of higher priority" in line
        for line in said["lo"])
    assert result.state == "finished" and result.step == 100
    [suspend] = [e for e in result.events if e["kind"] == "suspend"]
    [resume] = [e for e in result.events if e["kind"] == "resume"]
    assert suspend["for"] == "hi" and resume["resumed_from_step"] == suspend["step"] > 2
    assert resume["dp"] == 2 and not [e for e in result.events if e["kind"] == "failure"]
    alone = api.run(lo_spec(tmp_path / "alone"), show_progress=False)
    assert alone.step == 100
    got = CheckpointStore(lo.checkpoint_dir).read_model(100)
    want = CheckpointStore(lo_spec(tmp_path / "alone").checkpoint_dir).read_model(100)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert priorities._keys("") == []


def test_two_jobs_claiming_at_once_do_not_count_the_same_replica(tmp_path, local_ray, monkeypatch):
    """Two jobs of priority 1, each short of one worker, claim from a job of priority 0 at dp 3
    at the same moment (each one's planning slowed to 0.3 s, so that without the list's lock
    both would read it before either wrote): between them they take two replicas, not the
    same one twice."""
    import threading

    from baton.coordinator import priorities

    live = local_ray.get_runtime_context().get_job_id()
    lo = priorities.Entry("victim", "lo", 0, 3, 1, 1, 1.0, 0.0, 0.0, live)
    priorities._put("job/victim", vars(lo))
    planned = priorities.plan

    def slow_plan(*args, **kwargs):
        time.sleep(0.3)
        return planned(*args, **kwargs)

    monkeypatch.setattr(priorities, "plan", slow_plan)
    askers = [priorities.Priorities(spec_from_dict(tiny_spec(
        tmp_path / name, tmp_path, name=name, resources={"priority": 1}))) for name in ("a", "b")]
    threads = [threading.Thread(target=asker.ask, args=(1,)) for asker in askers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(asker.claimed["victim"] for asker in askers) == [1, 2]
    for asker in askers:
        asker.close()
    priorities._delete("job/victim")
    assert priorities._keys("") == []


def _queue_spec(tmp_path, data, name, priority, dp, steps, **resources):
    return spec_from_dict(tiny_spec(
        tmp_path / name, data, name=name, train={"steps": steps, "global_batch": 8, "micro_batch": None},
        parallel={"dp": dp, "timeout_s": 60}, resources={"cpus_per_worker": 1, "priority": priority, **resources},
        checkpoint={"every_steps": 1000, "keep": 2}, elastic={"rescale_check_s": 0.2}))


def test_a_suspended_job_goes_on_before_a_lower_one_that_queued_meanwhile(tmp_path, local_ray, monkeypatch):
    """`b` (priority 1, dp 2) is suspended for `c` (priority 2); `d` (priority 0, dp 1) starts
    while c runs, finds the room held and waits in line. When c ends, b goes on first (its
    place: priority 1, in line from its suspension) and d waits on (it neither takes the CPU c
    lets go first nor is suspended for b); once b ends, d starts. (b sleeps 0.05 s a step until
    it has been suspended, so that it does not finish before c reaches it.) A run's end is
    slowed by 2 s after its workers have gone: c's claim on b must be withdrawn before then, or
    d, first in line while the claim holds b out of it, takes the room (it did, in CI)."""
    import threading

    from baton import api
    from baton.checkpoint import store
    from baton.coordinator import priorities
    from baton.status import describe

    settle = store.CheckpointStore.settle

    def slow_settle(self, folder=None):
        time.sleep(2.0)
        settle(self, folder)

    monkeypatch.setattr(store.CheckpointStore, "settle", slow_settle)

    data = write_dataset(tmp_path / "data", 40, 32)
    results: dict = {}
    said: list = []

    def run(name, s, on_step=None):
        results[name] = api.run(s, show_progress=False, on_step=on_step)

    d_spec = _queue_spec(tmp_path, data, "d", 0, 1, 20)
    d = threading.Thread(target=run, args=("d", d_spec))

    def c_step(c):
        if c.step == 1:
            d.start()  # no room: c holds it
        elif c.step == 4:
            _until_queued(d_spec)

    c = threading.Thread(target=run, args=("c", _queue_spec(tmp_path, data, "c", 2, 2, 6), c_step))

    def b_step(b):
        suspended = any(e["kind"] == "suspend" for e in b.events)
        if b.step == 2:
            c.start()
        elif suspended and not said:  # gone on: what `baton status` says of d once it
            deadline = time.monotonic() + 10  # has looked at the line again (every second)
            status = CheckpointStore(d_spec.checkpoint_dir).read_status()
            # c still holds its room until its run has ended (2 s of settling after b went on):
            # wait for the look after that, or the line reads "held by b, c" (it did, once)
            while status.get("in_line", {}).get("room_held_by") != ["b"] and time.monotonic() < deadline:
                time.sleep(0.1)
                status = CheckpointStore(d_spec.checkpoint_dir).read_status()
            said.extend(describe(status))
        if not suspended:
            time.sleep(0.05)

    run("b", _queue_spec(tmp_path, data, "b", 1, 2, 150), b_step)
    c.join(timeout=120)
    d.join(timeout=120)
    assert {name: (r.state, r.step) for name, r in results.items()} == {
        "b": ("finished", 150), "c": ("finished", 6), "d": ("finished", 20)}
    assert [(e["kind"], e.get("for")) for e in results["b"].events] == [
        ("suspend", "c"), ("resume", None)]
    assert results["d"].events == [] and results["d"].start["phases_s"]["queued"] > 0
    assert said[0].startswith("d: queued") and any(
        line.startswith("  in line for room for ") and line.endswith(": first; held by b")
        for line in said), said
    assert priorities._keys("") == []


def _until_queued(spec, timeout_s=60.0):
    """Wait until the job's status says it is in line."""
    deadline = time.monotonic() + timeout_s
    while (CheckpointStore(spec.checkpoint_dir).read_status() or {}).get("state") != "queued":
        assert time.monotonic() < deadline, f"{spec.name} never queued"
        time.sleep(0.1)


def _behind(holder, specs, on_step, after=lambda: None):
    """Run job `holder`; at its first step, start each job of `specs` in a thread of its own,
    in order, each once the one before is in line, then call `after()` (the holder's step
    waits for all that). Returns the holder's result, the others' results and when each of
    them ended (monotonic), once all have."""
    import threading

    from baton import api

    results, done = {}, {}

    def run(name):
        results[name] = api.run(specs[name], show_progress=False, on_step=lambda c: on_step(name, c))
        done[name] = time.monotonic()

    threads = {name: threading.Thread(target=run, args=(name,)) for name in specs}

    def holder_step(c):
        if c.step == 1:
            for name, thread in threads.items():
                thread.start()
                _until_queued(specs[name])
            after()

    held = api.run(holder, show_progress=False, on_step=holder_step)
    for thread in threads.values():
        thread.join(timeout=120)
    return held, results, done


def test_jobs_waiting_for_room_start_by_priority_then_arrival(tmp_path, local_ray, monkeypatch):
    """`a` (priority 2, dp 2) holds the local Ray's two CPUs. `x` (priority 0, dp 2) comes
    and waits in line; `y` (priority 1, dp 2) comes after it and goes ahead of it; `z`
    (resources.queue_timeout_s 1) stops after a second in line, naming who is ahead and who
    holds the room. When a ends, y starts and x waits on; x starts when y ends. Each job's
    workers are created 1.5 s after it decides to start (a busy scheduler): the free room
    Ray shows x meanwhile is y's, which y's entry in the list says (without that, x started
    beside y and one of them waited for room it could not get: checked)."""
    import pytest

    from baton import api
    from baton.coordinator import priorities
    from baton.errors import WorkerError
    from baton.workers import WorkerGroup

    launch = WorkerGroup.launch

    def slow_launch(self, n):
        time.sleep(1.5)
        launch(self, n)

    monkeypatch.setattr(WorkerGroup, "launch", slow_launch)

    data = write_dataset(tmp_path / "data", 40, 32)
    specs = {name: _queue_spec(tmp_path, data, name, priority, 2, 4)
             for name, priority in (("x", 0), ("y", 1))}
    first_step, x_while_y_runs = {}, []

    def on_step(name, c):
        first_step.setdefault(name, time.monotonic())
        if name == "y" and c.step == 2:
            x_while_y_runs.append(CheckpointStore(specs["x"].checkpoint_dir).read_status()["state"])

    def then():  # x and y are in line
        z = _queue_spec(tmp_path, data, "z", 0, 1, 4, queue_timeout_s=1)
        with pytest.raises(WorkerError, match=r"waited \d+ s in line for room for 1 worker "
                           r"\(resources.queue_timeout_s: 1\): 3rd, behind y, x; held by a$"):
            api.run(z, show_progress=False)

    a, results, _ = _behind(_queue_spec(tmp_path, data, "a", 2, 2, 4), specs, on_step, then)
    assert a.state == "finished"
    assert {name: (r.state, r.step) for name, r in results.items()} == {"x": ("finished", 4), "y": ("finished", 4)}
    assert first_step["y"] < first_step["x"] and x_while_y_runs == ["queued"]
    assert results["x"].start["phases_s"]["queued"] > results["y"].start["phases_s"]["queued"] > 0
    assert priorities._keys("") == []


def test_a_job_claims_nothing_where_lower_jobs_cannot_give_its_smallest_world(tmp_path, local_ray):
    """Short of two workers with one to be had (a job of priority 0 at dp 1): no claim is
    written, so that job is not suspended for nothing; with one short, it is."""
    from baton.coordinator import priorities

    live = local_ray.get_runtime_context().get_job_id()
    priorities._put("job/small", vars(priorities.Entry("small", "lo", 0, 1, 1, 1, 1.0, 0.0, 0.0, live)))
    asker = priorities.Priorities(spec_from_dict(tiny_spec(tmp_path, tmp_path, name="hi",
                                                           resources={"priority": 1, "cpus_per_worker": 1})))
    assert asker.ask(2, 2) == (0, {}) and priorities._keys("claim/") == []
    assert asker.ask(1, 1) == (1, {"lo": 0}) and priorities._keys("claim/") == [f"claim/small/{asker.key}"]
    asker.close()
    priorities._delete("job/small")
    assert priorities._keys("") == []


def test_room_the_line_cannot_use_yet_is_lent_to_a_job_behind_and_given_back(tmp_path, local_ray, monkeypatch):
    """`a` (dp 1) holds one of the local Ray's two CPUs. `x` (dp 2) comes and waits in line:
    one CPU is too little for it. `y` (dp 1, of the same priority) comes after x and, the
    free CPU having been too little for x for 3 s, starts on it out of turn. When a ends, x
    claims the lent CPU back: y is suspended from a checkpoint of the step it reached, x
    trains (its claim lapses once its world has formed: y waits in line, first, not held
    by it), and y goes on once x ends. (y sleeps 0.05 s a step until it has been suspended,
    so that it does not finish first; a's steps wait for y's first.) The live gauge of each
    job's wait in line (ray_baton_waiting_seconds) is set at each look and 0 with a world."""
    from baton.coordinator import priorities
    from baton.status import describe
    from baton.tracking.metrics import LiveMetrics

    waits: dict = {}
    monkeypatch.setattr(LiveMetrics, "waiting", lambda self, s: waits.setdefault(self.job, []).append(s))

    data = write_dataset(tmp_path / "data", 40, 32)
    specs = {"x": _queue_spec(tmp_path, data, "x", 0, 2, 4), "y": _queue_spec(tmp_path, data, "y", 0, 1, 300)}
    results, said = {}, {}

    def y_step(c):
        if c.step == 1:
            said.setdefault("y", describe(c.status()))
        if not any(e["kind"] == "suspend" for e in c.events):
            time.sleep(0.05)

    def x_step(c):  # x's world has formed: its claim lapses, and y is in line behind nobody
        deadline, status = time.monotonic() + 10, {}  # (y looks at the line every second)
        while c.step == 1 and "x" not in status.get("in_line", {}).get("room_held_by", []):
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
            status = CheckpointStore(specs["y"].checkpoint_dir).read_status()
            said["y suspended"] = describe(status)

    steps = {"x": x_step, "y": y_step}

    def y_started():  # y starts out of turn while a holds the other CPU
        deadline = time.monotonic() + 90
        while "y" not in said:
            assert time.monotonic() < deadline, "y never started"
            time.sleep(0.2)

    a, results, _ = _behind(_queue_spec(tmp_path, data, "a", 0, 1, 4), specs,
                            lambda name, c: steps[name](c), y_started)
    assert a.state == "finished"
    assert {name: (r.state, r.step) for name, r in results.items()} == {"x": ("finished", 4), "y": ("finished", 300)}
    assert said["y"][0].startswith("y: running") and \
        "  out of turn: on room lent by x (ahead of it in line), given back when it can start" in said["y"]
    assert said["y suspended"][0].startswith("y: suspended") and any(
        line.startswith("  in line for room for ") and line.endswith(": first; held by x")
        for line in said["y suspended"]), said["y suspended"]
    y = results["y"].events
    assert [(e["kind"], e.get("lent_by") or e.get("for")) for e in y] == [
        ("backfill", ["x"]), ("suspend", "x"), ("resume", None)]
    assert y[1]["step"] == y[2]["resumed_from_step"] > 1
    assert results["x"].events == [] and results["x"].start["phases_s"]["queued"] > 0
    # y waited 3 s in line before it borrowed; x until a ended; y again while x ran
    assert max(waits["y"][:waits["y"].index(0)]) >= 2.0 and max(waits["x"]) > 2.0
    assert waits["y"].count(0) == 2 and all(w[-1] == 0 for w in waits.values())
    assert priorities._keys("") == []


def test_a_job_leaves_room_for_the_smallest_world_behind_it_and_grows_later(tmp_path, local_ray):
    """`h` (dp 2) holds the local Ray's two CPUs; `e` (elastic, min_dp 1, max_dp 2) waits in
    line, and `s` (dp 1) behind it. When h ends, e starts with one CPU, leaving the other to
    s, which starts beside it instead of waiting for e to end; e grows to dp 2 once s ends.
    (e sleeps 0.05 s a step until it has grown, so that it outlasts s.)"""
    from baton.coordinator import priorities

    data = write_dataset(tmp_path / "data", 40, 32)
    specs = {"e": _queue_spec(tmp_path, data, "e", 0, 2, 300), "s": _queue_spec(tmp_path, data, "s", 0, 1, 4)}
    specs["e"] = spec_from_dict({**specs["e"].to_dict(), "elastic": {
        **specs["e"].to_dict()["elastic"], "min_dp": 1, "max_dp": 2}})
    at = {}

    def on_step(name, c):
        at.setdefault(f"{name} first", time.monotonic())
        if name == "e" and c.dims.dp < 2:
            time.sleep(0.05)

    h, results, done = _behind(_queue_spec(tmp_path, data, "h", 0, 2, 4), specs, on_step)
    at.update({f"{name} done": t for name, t in done.items()})
    assert h.state == "finished"
    assert {name: (r.state, r.step) for name, r in results.items()} == {"e": ("finished", 300), "s": ("finished", 4)}
    assert at["s first"] < at["e done"] and at["s done"] < at["e done"]  # beside e
    assert [dp for _, dp in results["e"].dp_history] == [1, 2]  # grew once s ended
    assert priorities._keys("") == []


def test_a_job_waits_for_its_quota_while_a_job_of_no_quota_takes_the_free_room(tmp_path, local_ray):
    """Quota `team` holds 1 CPU. `q1` (team, 1 CPU) runs; `q2` (team, 1 CPU) comes and waits
    for the quota although the local Ray has a CPU free (`baton quota` and `baton status` say
    so); `free` (no quota) then starts on that CPU at once, the line holding nothing for q2,
    and ends while q1 runs. q2 starts once q1 has ended."""
    import threading

    from baton import api
    from baton.coordinator import priorities, quotas

    data = write_dataset(tmp_path / "data", 40, 32)
    q1, q2 = (_queue_spec(tmp_path, data, name, 0, 1, 4, quota="team") for name in ("q1", "q2"))
    free = _queue_spec(tmp_path, data, "free", 0, 1, 4, queue_timeout_s=30)  # (not behind q2)
    seen, done = {}, {}
    api.quotas(set_to=("team", 1.0, None))

    def run_q2():
        seen["q2"] = api.run(q2, show_progress=False)
        done["q2"] = time.monotonic()

    thread = threading.Thread(target=run_q2)

    def holder_step(c):
        if c.step != 1:
            return
        thread.start()
        _until_queued(q2)
        seen["status"] = CheckpointStore(q2.checkpoint_dir).read_status()
        seen["quotas"] = api.quotas()
        seen["free"] = api.run(free, show_progress=False)
        done["free"] = time.monotonic()

    try:
        held = api.run(q1, show_progress=False, on_step=holder_step)
        done["q1"] = time.monotonic()
        thread.join(timeout=120)
    finally:
        quotas.clear_quota("team")
    assert held.state == seen["free"].state == seen["q2"].state == "finished"
    assert seen["free"].start["phases_s"].get("queued", 0) == 0
    assert seen["status"]["quota_wait"] == {"quota": "team", "room": {"CPU": 1.0, "GPU": None},
                                            "held_by": ["q1"]} and "in_line" not in seen["status"]
    from baton import status
    assert "  waiting for room within quota team (1 CPU): held by q1" in status.describe(seen["status"])
    assert seen["quotas"] == {"team": {"CPU": 1.0, "GPU": None, "held": {"CPU": 1.0, "GPU": 0.0},
                                       "jobs": [("q1", "running"), ("q2", "waiting for the quota")]}}
    # (free ran inside q1's first step: that it never waited is its missing queued phase)
    assert done["q1"] < done["q2"]
    assert priorities._keys("") == []
