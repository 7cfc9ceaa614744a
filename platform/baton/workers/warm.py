"""Workers kept warm between the runs of one driver (`resources.keep_warm_s`).

A new worker process spends seconds of CPU importing torch and baton before it can join a
world (about 7 CPU-seconds on a 2-core machine). A sweep, a notebook or a test suite runs job
after job from one Python process, and each run used to start its workers again. With
`keep_warm_s` > 0, a run that finishes leaves its workers out of any world and holding no
model (`Worker.rest`), and keeps them that many seconds; the next run of this driver whose
workers take the same resources renews them (`Worker.renew`: the constructor's work again,
no new process) and starts new ones only for the rest. Meanwhile the kept workers hold their
resources, as any actor does: a run that needs other resources lets them go first, and the
room is free before it counts what the cluster has.

A kept worker runs the code it imported when it started: one whose job or baton code changed
on disk since then is let go (`renew` says so), and a new process runs the new code.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from typing import Any, Optional

import ray

from baton.spec import JobSpec

RENEW_S = 10.0  # how long a kept worker may take to renew before it is let go
FREED_S = 5.0  # how long letting workers go waits for their room to show as free

_lock = threading.Lock()
_kept: list[tuple[tuple, Any, float]] = []  # (key, actor, kept until: monotonic)


def _connection() -> str:
    """This Ray connection: a new `ray.init` has new actors. The driver's worker id alone does
    not tell two apart: Ray derives it from the job's id, and a new local cluster numbers its
    jobs from 1 again (a second sweep in one process found the first's workers, gone with
    its cluster: benchmarks/sweeps.py); its node is new."""
    context = ray.get_runtime_context()
    return f"{context.get_worker_id()}@{context.get_node_id()}"


def _key(spec: JobSpec) -> tuple:
    """What a worker must share with a run to serve it: this Ray connection and the
    resources and threads its process was made with."""
    r = spec.resources
    return (_connection(), r.cpus_per_worker, r.gpus_per_worker, r.placement, r.threads_per_worker)


def keep(spec: JobSpec, actors: list) -> None:
    """Keep `actors` (rested: out of any world) for spec.resources.keep_warm_s."""
    wait_s = spec.resources.keep_warm_s
    if not actors or wait_s <= 0:
        return
    key = _key(spec)
    with _lock:
        _kept.extend((key, actor, time.monotonic() + wait_s) for actor in actors)
    timer = threading.Timer(wait_s + 0.5, expire)
    timer.daemon = True
    timer.start()


def claim(spec: JobSpec) -> list:
    """The kept workers that can serve `spec`, renewed for it (those beyond what its world
    takes are let go as it starts: kept, they would hold room its spares or growth need);
    every other kept worker is let go (its room freed before this returns)."""
    if not ray.is_initialized():
        return []
    key, now = _key(spec), time.monotonic()
    with _lock:
        mine = [actor for k, actor, until in _kept if k == key and until > now]
        others = [(actor, k[1]) for k, actor, until in _kept
                  if k[0] == key[0] and (k != key or until <= now)]
        _kept.clear()  # those of an earlier Ray connection went with it
    let_go([actor for actor, _ in others], sum(cpus for _, cpus in others))
    if not mine:
        return []
    refs = [actor.renew.remote(spec) for actor in mine]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RENEW_S)
    renewed, stale = [], []
    for actor, ref in zip(mine, refs):
        try:
            ok = ref in ready and ray.get(ref)
        except ray.exceptions.RayError:
            ok = False
        (renewed if ok else stale).append(actor)
    let_go(stale, spec.resources.cpus_per_worker * len(stale))
    return renewed


def expire() -> None:
    """Let go of the workers whose time is up (a timer calls this after each `keep`)."""
    now = time.monotonic()
    with _lock:
        due = [(k, actor) for k, actor, until in _kept if until <= now]
        _kept[:] = [entry for entry in _kept if entry[2] > now]
    if due and ray.is_initialized():
        me = _connection()
        let_go([actor for k, actor in due if k[0] == me], wait=False)


def forget() -> None:
    """Forget every kept worker: Ray is shutting down, and they go with it."""
    with _lock:
        _kept.clear()


def drain() -> None:
    """Let go of every kept worker now."""
    with _lock:
        kept, _kept[:] = list(_kept), []
    if kept and ray.is_initialized():
        me = _connection()
        mine = [(actor, k[1]) for k, actor, _ in kept if k[0] == me]
        let_go([actor for actor, _ in mine], sum(cpus for _, cpus in mine))


def held() -> int:
    """How many workers are kept now."""
    with _lock:
        return len(_kept)


def held_cpus() -> float:
    """The CPUs the workers kept now hold (the next run of their kind takes them)."""
    with _lock:
        return sum(key[1] for key, _, _ in _kept)


def let_go(actors: list, cpus: float = 0.0, wait: bool = True) -> None:
    """Kill `actors` and, with `wait`, wait (up to FREED_S) until Ray shows their room, `cpus`
    in all, free again: a run counts free room right after this."""
    if not actors:
        return
    if not wait:
        for actor in actors:
            ray.kill(actor)
        return
    free_before = ray.available_resources().get("CPU", 0.0)
    deaths = [actor.heartbeat.remote() for actor in actors]  # fail once each actor is dead
    for actor in actors:
        ray.kill(actor)
    deadline = time.monotonic() + FREED_S
    ray.wait(deaths, num_returns=len(deaths), timeout=FREED_S)
    # an actor is dead before its node has handed its resources back: wait for those too
    while (ray.available_resources().get("CPU", 0.0) < free_before + cpus - 1e-9
           and time.monotonic() < deadline):
        time.sleep(0.05)


def changed_code(since: float) -> Optional[str]:
    """A module this process imported from outside Python's installation (the job's code,
    baton's own in a checkout) whose file changed after `since` (a time.time()), or None."""
    paths = [p for name in ("stdlib", "platstdlib", "purelib", "platlib")
             if (p := sysconfig.get_paths().get(name))]
    installed = tuple({form + os.sep for p in paths for form in (p, os.path.realpath(p))})
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not path or not os.path.isabs(path) or path.startswith(installed):
            continue  # (torch.ops and the like name a file that is not there)
        try:
            if os.stat(path).st_mtime > since:
                return name
        except OSError:  # in a zip archive, or gone (a new process would not find it either)
            continue
    return None
