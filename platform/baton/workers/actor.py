"""The worker as Ray and the driver see it: its calls, and the threads they run on, without
torch. `ray.remote` needs a class, so the driver imports the actor's class; were it the worker
itself (`baton.workers.worker`), the driver would load torch, models and engines it never uses:
1.9 CPU-s, on a 2-core machine, of the start that the workers' own imports need
(docs/benchmarks.md, "From the command to the first step"). Each call here runs the worker's
method of the same name; the actor's process imports the worker in the constructor."""

from __future__ import annotations

import ray

from baton.workers import host

# The worker's calls (a unit test holds this list to `Worker`'s public methods): each runs on
# the actor's default thread, one at a time and in order, but for those named in GROUPS
CALLS = ("rest", "renew", "assign", "ready", "heartbeat", "leave", "write_kept",
         "write_kept_shards", "rendezvous_address", "profile_layers", "setup", "train_step",
         "gradients", "evaluate", "save", "write_planned", "written", "check_sums", "load",
         "share_state", "digest", "take_ledger", "shutdown")
# "health": a busy or stuck worker still answers its heartbeat; "io": a background save's
# writes and their wait do not hold up the training calls queued meanwhile
GROUPS = {"heartbeat": "health", "write_planned": "io", "written": "io"}


class WorkerActor:
    def __init__(self, *args) -> None:
        with host.collector_paused():  # torch and the worker's modules load faster (host.py)
            from baton.workers.worker import Worker
        self.worker = Worker(*args)


def _call(name: str):
    def call(self, *args, **kwargs):
        return getattr(self.worker, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    group = GROUPS.get(name)
    return ray.method(concurrency_group=group)(call) if group else call


for _name in CALLS:
    setattr(WorkerActor, _name, _call(_name))

RemoteWorker = ray.remote(concurrency_groups={group: 1 for group in set(GROUPS.values())})(WorkerActor)
