"""The worker as Ray and the driver see it: its calls, and the threads they run on, without
torch. `ray.remote` needs a class, so the driver imports the actor's class; were it the worker
itself (`baton.workers.worker`), the driver would load torch, models and engines it never uses:
1.9 CPU-s, on a 2-core machine, of the start that the workers' own imports need
(docs/benchmarks.md, "From the command to the first step"). Each call here runs the worker's
method of the same name; the actor's process imports the worker in the constructor.

Steps run on a thread of the worker's own (`Steps`), not on Ray's. Ray starts an actor's next
queued call only after the one before has returned: each step waited for that hand-over,
1.4-1.6 ms (median; p90 about 5 ms) on a loaded 2-core machine, against 0.12-0.14 ms from the
end of one step to the start of the next on this thread (docs/benchmarks.md, "Steps on the
worker's own thread"). So `train_step` only hands the step over, and its result comes back
through `step_result` on a thread of its own. Every other call is handed to the same thread by
Ray's default thread, which waits for it: calls run in the order they were sent, so a
checkpoint queued behind step k sees the state after step k."""

from __future__ import annotations

import collections
import threading
import traceback
from typing import Any, Callable, Optional

import ray

from baton.workers import host

# The worker's calls (a unit test holds this list to `Worker`'s public methods): each runs on
# the worker's training thread, one at a time and in the order sent, but for those in GROUPS
CALLS = ("rest", "renew", "assign", "ready", "heartbeat", "leave", "write_kept",
         "write_kept_shards", "rendezvous_address", "profile_layers", "setup", "train_step",
         "gradients", "evaluate", "save", "write_planned", "written", "check_sums", "load",
         "share_state", "digest", "take_ledger", "shutdown")
# Calls beside the training thread. "health": a busy or stuck worker still answers its
# heartbeat, and a recovery's `end_world` arrives while a step runs; "io": a background save's
# writes and their wait do not hold up the training calls queued meanwhile; "steps": the
# steps' results, each waited for on a thread of its own (as many as the coordinator queues,
# and a few of a world a recovery gave up, until `end_world` or `leave` ends their wait)
GROUPS = {"heartbeat": "health", "write_planned": "io", "written": "io", "step_result": "steps",
          "end_world": "health"}
CONCURRENCY = {"health": 1, "io": 1, "steps": 4}
ENDING = ("leave", "rest", "shutdown")  # the worker leaves its world: its steps not started are dropped


class Steps:
    """The worker's training thread: runs the steps handed to it (`put`) and the worker's
    other calls (`call`), one at a time, in the order they came, and keeps each step's result
    (or error) until `result` takes it. Every call that touches torch runs here, the
    constructor's included: torch keeps some state per thread (DeviceMesh's registry,
    autocast, the CUDA stream), and a world's meshes made on one thread and forgotten on
    another outlived their process groups (found by a fault test under hybrid sharding).
    Steps belong to a world (the group's name for one formation of its workers); `end` ends
    every world joined, so a result asked for a step that will never run (its hand-over
    cancelled by a recovery) fails instead of waiting for ever."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (key, run)
        self._results: dict[Any, tuple[bool, Any]] = {}  # by key: (world, step), or a call's
        self._worlds: set[str] = set()  # joined (`join`), not ended
        self._ended: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="baton-steps", daemon=True)
        self._thread.start()

    def join(self, world: str) -> None:
        with self._cond:
            self._worlds.add(world)

    def put(self, world: str, step: int, run: Callable[[], Any]) -> None:
        with self._cond:
            if world not in self._ended:  # else dropped: `result` fails for an ended world
                self._queue.append(((world, step), run))
                self._cond.notify_all()

    def result(self, world: str, step: int) -> Any:
        key = (world, step)
        with self._cond:
            self._cond.wait_for(lambda: key in self._results or world in self._ended)
            if key not in self._results:
                raise RuntimeError(f"step {step + 1} was not run: world {world} ended")
            return self._take(key)

    def call(self, run: Callable[[], Any]) -> Any:
        """`run()` on this thread, after everything handed over before it; its result."""
        key = object()
        with self._cond:
            self._queue.append((key, run))
            self._cond.notify_all()
            self._cond.wait_for(lambda: key in self._results)
            return self._take(key)

    def end(self, world: Optional[str] = None) -> None:
        """End `world` (None: every world joined): its steps not started are dropped, its
        results not taken are forgotten, and waits for either fail. A step still running goes
        on: a `call` after this runs once it has ended."""
        with self._cond:
            ending = set(self._worlds) if world is None else {world}
            self._ended |= ending
            self._worlds -= ending
            self._queue = collections.deque(item for item in self._queue if not _of(item[0], ending))
            self._results = {k: v for k, v in self._results.items() if not _of(k, ending)}
            self._cond.notify_all()

    def _take(self, key) -> Any:
        ok, value = self._results.pop(key)
        if not ok:
            raise value
        return value

    def _loop(self) -> None:
        while True:
            self._run_next()

    def _run_next(self) -> None:
        """The next item. A step's error keeps its traceback's lines but not the variables of
        its frames: they hold the world's modules and process groups, which `leave` frees so
        that peers still in a collective with this rank fail at once, and the error outlived
        `leave` (kept past its handing over to Ray; not found where). Found by a fault test
        (pp 2 x hybrid ZeRO-3): a stage's peer waited out the 30 s collective timeout in a
        send to a rank that had left; with the frames cleared, all had left 0.5 s after the
        recovery began."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue)
            key, run = self._queue.popleft()
        try:
            outcome = (True, run())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter, which raises it
            traceback.clear_frames(e.__traceback__)  # its lines stay, their variables go (above)
            outcome = (False, e)
        with self._cond:
            if not _of(key, self._ended):
                self._results[key] = outcome
            self._cond.notify_all()


def _of(key, worlds: set) -> bool:
    """Whether `key` is a step's, of one of `worlds` (a call's key is not a tuple)."""
    return type(key) is tuple and key[0] in worlds


def _make_worker(*args):
    with host.collector_paused():  # torch and the worker's modules load faster (host.py)
        from baton.workers.worker import Worker
    return Worker(*args)


class WorkerActor:
    def __init__(self, *args) -> None:
        self.steps = Steps()
        self.worker = self.steps.call(lambda: _make_worker(*args))

    def assign(self, spec, dims, rank: int, world: str) -> None:
        """A new world (`world`: its name): from here on its steps may be handed over."""
        self.steps.join(world)
        self.steps.call(lambda: self.worker.assign(spec, dims, rank))

    def train_step(self, world: str, step: int, *args) -> None:
        """Hand step `step` to the training thread; `step_result` returns what it returned."""
        self.steps.put(world, step, lambda: self.worker.train_step(step, *args))

    def step_result(self, world: str, step: int) -> dict:
        return self.steps.result(world, step)

    def end_world(self, world: str) -> None:
        """The coordinator gave `world` up (a recovery): none of its steps handed over starts
        now, as Ray's cancelling of a queued call did when steps were Ray's calls. Sent beside
        the calls in flight: a rank whose step did not fail would otherwise start the next
        one, and wait in its collectives with peers that are leaving."""
        self.steps.end(world)


def _call(name: str):
    def call(self, *args, **kwargs):
        method = getattr(self.worker, name)
        if name in GROUPS:
            return method(*args, **kwargs)
        if name in ENDING:  # after a failure, steps handed over belong to a world that is gone
            self.steps.end()
        return self.steps.call(lambda: method(*args, **kwargs))  # after the steps sent before

    call.__name__ = call.__qualname__ = name
    return call


for _name in CALLS:
    if _name not in WorkerActor.__dict__:
        setattr(WorkerActor, _name, _call(_name))
for _name, _group in GROUPS.items():
    setattr(WorkerActor, _name, ray.method(concurrency_group=_group)(getattr(WorkerActor, _name)))
for _name in ("train_step", "end_world"):  # nothing to wait for
    setattr(WorkerActor, _name, ray.method(num_returns=0)(getattr(WorkerActor, _name)))

RemoteWorker = ray.remote(concurrency_groups=CONCURRENCY)(WorkerActor)
