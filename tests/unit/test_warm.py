"""Which kept-warm workers may serve another run: none whose code changed on disk. What a
new worker (a spare, say) has imported before it joins a world."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from pathlib import Path

from baton.workers.warm import changed_code


def test_a_module_changed_after_the_start_is_named(tmp_path, monkeypatch):
    (tmp_path / "user_model_for_warm.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    began = time.time() + 1  # as if the process had started after the file was written
    importlib.import_module("user_model_for_warm")
    try:
        assert changed_code(began) is None  # torch, ray, the standard library: not looked at
        later = began + 5
        os.utime(tmp_path / "user_model_for_warm.py", (later, later))
        assert changed_code(began) == "user_model_for_warm"
    finally:
        sys.modules.pop("user_model_for_warm")


def test_a_worker_made_for_a_job_of_several_replicas_imports_what_ddp_needs_before_its_world():
    """The group creates every worker, spares included, in a world of one; a job that may
    have several replicas has it import torch._dynamo then, not in DDP's first wrap after a
    fault (0.65 s, which the survivor waited for). A job of one replica does not import it."""
    code = """
import sys
from baton.parallel import ParallelDims
from baton.spec import spec_from_dict
from baton.workers.worker import Worker

def made(**parallel):
    spec = spec_from_dict({"name": "w", "model": {"name": "gpt", "layers": 1, "width": 32,
                           "heads": 2, "seq_len": 16}, "data": {"source": "parquet", "path": "/nowhere"},
                           "train": {"steps": 3, "global_batch": 4}, "parallel": parallel})
    assert Worker(spec, ParallelDims(1), 0).start_error is None
    return "torch._dynamo" in sys.modules

print(made(dp=1), made(dp=2))
"""
    platform = str(Path(__file__).resolve().parents[2] / "platform")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": platform})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


def test_the_group_makes_new_workers_for_the_job_whatever_world_it_is_in(monkeypatch):
    """A world of fewer replicas than the job's most runs a spec of that one world (`at_dp`,
    its elastic range dropped). Workers made while it runs (a growth, a spare, a replacement)
    are made for the job: made for the world of one, a worker skipped torch._dynamo at its
    start and imported it in its first DDP wrap, 0.46-0.64 s of a growth's group_init."""
    from baton.spec import spec_from_dict
    from baton.workers import group as group_module

    made = []

    class Actor:
        class assign:
            @staticmethod
            def remote(*args):
                pass

    class FakeRemoteWorker:
        @staticmethod
        def options(**options):
            return FakeRemoteWorker

        @staticmethod
        def remote(spec, dims, rank):
            made.append(spec)
            return Actor()

    monkeypatch.setattr(group_module, "RemoteWorker", FakeRemoteWorker)
    job = spec_from_dict({"name": "w", "model": {"name": "gpt", "layers": 1, "width": 32, "heads": 2,
                                                  "seq_len": 16},
                          "data": {"source": "parquet", "path": "/nowhere"},
                          "train": {"steps": 3, "global_batch": 4},
                          "parallel": {"dp": 2}, "elastic": {"min_dp": 1, "max_dp": 2}})
    group = group_module.WorkerGroup(job, job.dims())
    world = job.at_dp(1)
    assert world.dp_range == (1, 1)  # what a worker made for it would see
    group.form([(Actor(), {})], world, world.dims())
    group._create(1)
    assert made[-1].dp_range == (1, 2)


def test_the_actor_offers_every_call_of_the_worker_on_its_thread():
    """The driver makes actors from `baton.workers.actor` (without torch); each call there runs
    the worker's method of the same name. A method added to the worker and not to the actor
    would not exist for the coordinator; the heartbeat must keep its own thread, or a busy
    worker would look frozen."""
    import inspect

    from baton.workers import actor
    from baton.workers.worker import Worker

    public = {name for name, _ in inspect.getmembers(Worker, inspect.isfunction)
              if not name.startswith("_")}
    assert set(actor.CALLS) == public
    assert all(callable(getattr(actor.WorkerActor, name)) for name in actor.CALLS)
    assert actor.WorkerActor.heartbeat.__ray_concurrency_group__ == "health"
    assert actor.WorkerActor.written.__ray_concurrency_group__ == "io"
    assert not hasattr(actor.WorkerActor.train_step, "__ray_concurrency_group__")


def test_workers_kept_by_an_earlier_ray_are_not_offered_to_the_next(tmp_path):
    """A driver that starts a second local Ray (a second sweep in one process, a notebook's
    ray.shutdown and ray.init) must not be offered the first Ray's kept workers: they went
    with it. Ray derives the driver's worker id from the job's id, which a new cluster
    numbers from 1 again, so that id alone matched, and the next run called a dead actor
    ("Can't find actor ..."; found by benchmarks/sweeps.py)."""
    code = """
import ray
from baton.api import start_local_ray
from baton.spec import spec_from_dict
from baton.workers import warm

spec = spec_from_dict({"name": "w", "model": {"name": "gpt", "layers": 1, "width": 32, "heads": 2,
                       "seq_len": 16}, "data": {"source": "parquet", "path": "/nowhere"},
                       "train": {"steps": 3, "global_batch": 4},
                       "resources": {"keep_warm_s": 60, "cpus_per_worker": 0.5}})

@ray.remote(num_cpus=0.5)
class Kept:
    def renew(self, spec):
        return True

start_local_ray()
first = Kept.remote()
warm.keep(spec, [first])
assert [a._actor_id for a in warm.claim(spec)] == [first._actor_id]  # the same Ray: renewed
warm.keep(spec, [first])
ray.shutdown()
start_local_ray()
print(len(warm.claim(spec)), warm.held())
ray.shutdown()
"""
    platform = str(Path(__file__).resolve().parents[2] / "platform")
    env = {**os.environ, "PYTHONPATH": platform, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                         env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "0"]
