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
