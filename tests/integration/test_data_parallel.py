"""Data parallelism on a local Ray with gloo: equivalence with one process, exactly-once data."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from baton import api
from baton.checkpoint import CheckpointStore
from baton.models import build_model
from baton.spec import spec_from_dict
from baton.tracking.profile import COMPUTE_CPU
from helpers import assert_like_one_process, reference_run, require_cxx, tiny_spec, write_dataset

pytestmark = pytest.mark.usefixtures("local_ray", "warm_workers")


MODELS = {
    "gpt": {"name": "gpt", "layers": 2, "width": 32, "heads": 2, "seq_len": 32},
    "mlp": {"name": "mlp", "layers": 2, "width": 64, "context": 4, "seq_len": 32},
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_dp2_matches_single_process(tmp_path, model):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    spec = spec_from_dict(tiny_spec(tmp_path, data, name=f"eq-{model}", model=MODELS[model],
                                    train={"steps": 3, "global_batch": 8, "micro_batch": 2},
                                    tracking={"trace_step": 2}))  # profiled, and still equal
    result = api.run(spec, show_progress=False)

    assert result.state == "finished" and result.step == 3
    # a checkpoint after every step checks that both replicas hold identical parameters
    assert len(result.replica_digests) == 2 and len(set(result.replica_digests)) == 1
    _, want = assert_like_one_process(spec, data, result, steps=3)
    initial = build_model(spec.model, spec.train.seed).state_dict()
    moved = sum(not torch.equal(ref, initial[name]) for name, ref in want.items())
    assert moved > len(want) // 2  # training changed the parameters: the comparison means something
    # the traced step: rank 0's profile, with DDP's all-reduce on gloo's thread in it
    client = MlflowClient(spec.tracking.uri)
    trace = json.loads(Path(client.download_artifacts(
        result.run_id, "profile/step_000002/trace.json", str(tmp_path))).read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert "gloo:all_reduce" in names and any(n.startswith(COMPUTE_CPU) for n in names)
    [overlap] = [(m.step, m.value) for m in client.get_metric_history(result.run_id, "comm_overlap")]
    assert overlap[0] == 2 and 0 <= overlap[1] <= 1  # a share; how much is in docs/benchmarks.md


def test_a_resume_goes_back_past_a_part_whose_checksum_the_workers_find_wrong(tmp_path, capfd):
    """A resume's checksums are read by the workers, each its share of the parts (the driver
    checks sizes): a flipped byte in checkpoint 2 sends the run back to checkpoint 1."""
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    spec = tiny_spec(tmp_path, data, name="sums", train={"steps": 2})
    assert api.run(spec_from_dict(spec), show_progress=False).step == 2
    store = CheckpointStore(spec["checkpoint"]["path"] + "/sums")
    part = Path(store.step_dir(2)) / "optim-0000.pt"
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01
    part.write_bytes(bytes(damaged))
    result = api.run(spec_from_dict({**spec, "train": {**spec["train"], "steps": 3}}), show_progress=False)
    assert result.state == "finished" and result.step == 3 and result.resumed_from == 1
    assert [(e["step"], e["why"]) for e in result.events if e["kind"] == "checkpoint_rejected"] == [
        (2, "part optim-0000.pt does not match its checksum")]
    assert "checkpoint 2 failed verification (part optim-0000.pt does not match its checksum); it is " \
           "set aside and the run goes back to checkpoint 1" in capfd.readouterr().out


def test_every_sample_exactly_once_per_epoch(tmp_path):
    # 101 samples, batches of 12: 8 full batches and a short one of 5, split 3 + 2 across
    # replicas and further into micro-batches, some of them empty
    data = write_dataset(tmp_path / "data", num_samples=101, seq_len=32, shards=3)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="ledger",
        train={"steps": 11, "global_batch": 12, "micro_batch": 3},
        checkpoint={"every_steps": 100}))
    result = api.run(spec, record_samples=True, show_progress=False)

    by_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    ranks = Counter()
    for step, rank, ids in result.ledger:
        by_epoch[0 if step < 9 else 1].update(ids)
        ranks[rank] += len(ids)
    assert sorted(by_epoch[0]) == list(range(1000, 1101))  # every id of epoch 0 ...
    assert set(by_epoch[0].values()) == {1}  # ... exactly once
    assert sum(by_epoch[1].values()) == 24 and set(by_epoch[1].values()) == {1}
    assert set(ranks) == {0, 1} and abs(ranks[0] - ranks[1]) <= 9  # both replicas trained
    assert np.isfinite(result.loss)



def test_compiled_blocks_train_as_one_eager_process(tmp_path):
    """train.compile: each block compiled in place by torch.compile (Inductor's C++ on CPU)
    at dp 2 trains as one eager process; compiling is a phase of its own in the start."""
    require_cxx()
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = spec_from_dict(tiny_spec(tmp_path, data, name="compiled", train={"compile": True}))
    result = api.run(spec, show_progress=False)
    phases = result.start["phases_s"]
    print(f"start phases: {phases}")
    assert phases["compile"] > 0.5, phases  # measured 14-40 s cold, 1-2 s from the cache
    assert phases["first_step"] < phases["compile"], phases
    # Inductor fuses and reorders float operations: measured 2.4e-05 from one eager process
    # after 3 steps (eager at dp 2: 7.7e-06), inside the default bound (rtol 1e-5, atol 4e-5)
    assert_like_one_process(spec, data, result, steps=3)


def test_bf16_autocast_tracks_the_fp32_reference(tmp_path):
    """The bf16 path (what GPU jobs use) runs in CI on the CPU: close to fp32, not equal."""
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = spec_from_dict(tiny_spec(tmp_path, data, name="bf16", train={"precision": "bf16"}))
    api.run(spec, show_progress=False)
    got = CheckpointStore(spec.checkpoint_dir).read_model(3)
    want, _, _ = reference_run(spec, data, steps=3)  # fp32
    diffs = [(got[k] - want[k]).abs().max().item() for k in want]
    assert max(diffs) < 0.05  # bf16 keeps about 3 significant digits
    assert max(diffs) > 0  # and autocast really was on


def test_a_busy_coordinator_does_not_make_a_live_worker_look_frozen(tmp_path):
    """Silence counts from the heartbeat in flight: a coordinator that was busy elsewhere for
    longer than hang_timeout_s (a checkpoint commit, an on_step hook) and then sends a beat
    must not call the worker frozen before that beat could be answered."""
    import ray

    from baton.parallel import ParallelDims
    from baton.workers import WorkerGroup

    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path, parallel={"dp": 1},
                                    elastic={"hang_timeout_s": 1}))
    group = WorkerGroup(spec, ParallelDims(1))
    group.actors = [actor for actor, _ in group.start(1, 60)]
    try:
        group.check_health("a step")  # a beat goes out
        time.sleep(0.5)
        group.check_health("a step")  # its answer is seen
        time.sleep(1.5)  # the coordinator is busy elsewhere, longer than the timeout
        group.check_health("a step")  # a new beat
        group.check_health("a step")  # at once: not answered yet, and not a hang
    finally:
        ray.kill(group.actors[0])


def test_a_worker_given_room_is_waited_for_past_the_wait_for_room():
    """parallel.timeout_s is a wait for room: a worker whose process runs (its imports, CUDA)
    is waited for past it, up to START_WAIT_S; one the cluster has no room for is not. Once
    failed in CI: four workers starting at once on a 2-core machine took more than 10 s
    (parallel.timeout_s) and the job failed with 'could place only 0' and no CPU free."""
    import ray

    from baton.workers.group import START_WAIT_S, has_process, wait_started

    @ray.remote(num_cpus=0.1)
    class Slow:
        def __init__(self, seconds):
            time.sleep(seconds)

        def ready(self):
            return True

    slow = Slow.remote(5.0)
    deadline = time.monotonic() + 60
    while not has_process(slow):  # room given: its process runs, and sleeps 5 s from now
        assert time.monotonic() < deadline
        time.sleep(0.1)
    unplaceable = Slow.options(num_cpus=10_000).remote(0.0)
    assert not has_process(unplaceable)
    t0 = time.monotonic()
    ref = slow.ready.remote()
    assert wait_started([slow], [ref], 1, timeout_s=0.5) == [ref]  # waited past 0.5 s
    ref = unplaceable.ready.remote()
    assert wait_started([unplaceable], [ref], 1, timeout_s=0.5) == []
    assert time.monotonic() - t0 < START_WAIT_S / 2  # the one without room: not waited for
    for actor in (slow, unplaceable):
        ray.kill(actor)


def test_a_finished_run_keeps_its_workers_warm_for_the_next(tmp_path):
    """resources.keep_warm_s: the next run of this driver takes the finished run's worker
    processes (renewed, not started again) and trains as new ones do, bit for bit; a run
    whose workers take other resources lets them go, and their room is free again; once the
    time is up, the kept workers are gone."""
    import ray

    from baton.workers import warm

    data = write_dataset(tmp_path / "data", num_samples=48, seq_len=32)
    warm.drain()  # what this module's earlier runs kept
    total = ray.cluster_resources()["CPU"]

    def run(name, **resources):
        spec = spec_from_dict(tiny_spec(tmp_path / name, data, name=name,
                                        resources={"cpus_per_worker": 0.5, **resources}))
        result = api.run(spec, show_progress=False)
        assert result.state == "finished" and result.step == 3
        return {w["pid"] for w in result.workers}, CheckpointStore(spec.checkpoint_dir).read_model(3)

    pids, want = run("first", keep_warm_s=60)
    assert warm.held() == 2
    assert ray.available_resources().get("CPU", 0) == pytest.approx(total - 1.0)  # still held
    again, got = run("second", keep_warm_s=60)
    assert again == pids  # the same processes
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    other, _ = run("other", cpus_per_worker=0.25, keep_warm_s=2)  # not what the kept ones hold
    assert not other & pids
    assert warm.held() == 2  # this run's, for 2 s
    deadline = time.monotonic() + 30
    while warm.held() or ray.available_resources().get("CPU", 0) < total - 1e-9:
        assert time.monotonic() < deadline, (warm.held(), ray.available_resources())
        time.sleep(0.2)


def test_powersgd_trains_within_a_measured_margin_of_fp32(tmp_path):
    """parallel.grad_comm: powersgd (rank 2, plain all-reduce for the first 10 steps) against
    the same job with fp32 gradients: the loss of the last 10 of 40 steps."""
    data = write_dataset(tmp_path / "data", num_samples=128, seq_len=32)
    finals = {}
    for comm in ("fp32", "powersgd"):
        spec = spec_from_dict(tiny_spec(
            tmp_path, data, name=f"comm-{comm}", train={"steps": 40, "global_batch": 8, "micro_batch": 4},
            parallel={"dp": 2, "grad_comm": comm, "timeout_s": 60}, checkpoint={"every_steps": 40}))
        result = api.run(spec, show_progress=False)
        assert result.state == "finished"
        finals[comm] = float(np.mean([v for _, v in result.history("loss")[-10:]]))
    print(f"mean loss of the last 10 steps: {finals}")
    # measured: 3.19 against 3.11 (2.7 % above fp32; the same every run: PowerSGD seeds its
    # projections); a 5 % margin
    assert finals["powersgd"] == pytest.approx(finals["fp32"], rel=0.05), finals
    assert finals["powersgd"] != finals["fp32"]  # the compression was on


def test_an_error_nobody_reads_goes_to_the_file_not_the_console(tmp_path, capfd):
    """What baton drops (a cancelled read of the feed, a call abandoned for a recovery) fails
    in Ray without anyone reading it, and Ray logs "Unhandled error" on the console: while
    RayMessages is installed, that goes to its file."""
    import gc

    import ray

    from baton.console import RayMessages

    @ray.remote(num_cpus=0.1)
    def fails(marker):
        open(marker, "w").close()
        raise ValueError("abandoned on purpose")

    messages = RayMessages(str(tmp_path / "ray.log")).install()
    try:
        # Ray reports an error object that was never read (ray.wait counts as reading) when
        # its last reference goes, if it has arrived by then: drop one until it has
        deadline = time.monotonic() + 30
        while not messages.count:
            assert time.monotonic() < deadline, "Ray never reported the unread error"
            marker = tmp_path / f"ran-{time.monotonic_ns()}"
            held = [fails.remote(str(marker))]
            while not marker.exists():
                time.sleep(0.05)
            time.sleep(0.5)
            held.clear()
            gc.collect()
            time.sleep(0.5)
    finally:
        messages.restore()
    assert "abandoned on purpose" in (tmp_path / "ray.log").read_text()
    assert "abandoned on purpose" not in "".join(capfd.readouterr())
    assert messages.where() == f"ray: a message from Ray kept out of the console is in {tmp_path / 'ray.log'}"


def test_a_worker_slower_than_its_peers_is_named_and_an_even_world_names_none(tmp_path):
    """A replica whose every forward takes 0.05 s longer (helpers:uneven_gpt on rank 1, two
    forwards a step) is named
    once it has lagged for half a window (10 steps), with its node and pid, in the events, on
    `baton status` and in MLflow's compute_spread; the same job without it names no one."""
    data = write_dataset(tmp_path / "data", num_samples=256, seq_len=32)
    runs = {}
    for name, model in (("even", {}), ("uneven", {"name": "helpers:uneven_gpt",
                                                  "options": {"seconds": 0.05, "rank": 1}})):
        spec = spec_from_dict(tiny_spec(
            tmp_path / name, data, name=name, model=model, train={"steps": 14, "micro_batch": 2},
            checkpoint={"every_steps": 100}))
        runs[name] = api.run(spec, show_progress=False)
        spread = [v for _, v in runs[name].history("compute_spread")]
        print(name, [round(v, 2) for v in spread])  # measured: see below
    assert not [e for e in runs["even"].events if e["kind"].startswith("straggler")]
    [named] = [e for e in runs["uneven"].events if e["kind"].startswith("straggler")]
    worker = runs["uneven"].workers[1]
    assert (named["kind"], named["rank"], named["step"]) == ("straggler", 1, 10)
    assert (named["node"], named["pid"]) == (worker["node"], worker["pid"])
    # its 0.1 s of sleep a step, less a few ms of the peers' compute that differs run to run
    assert named["ratio"] >= 1.5 and named["compute_s"] - named["peers_s"] >= 0.09
    spread = runs["uneven"].history("compute_spread")
    assert [s for s, _ in spread] == list(range(10, 15)) and min(v for _, v in spread) >= 1.5
    lag = CheckpointStore(spec.checkpoint_dir).read_status()["straggler"]  # what `baton status` reads
    assert (lag["rank"], lag["pid"]) == (1, worker["pid"])
