"""The worker group: the Ray actors of one world (dp x pp), joined in one torch.distributed
group, and the health checks that notice when one of them is gone.

Every wait watches the workers as well as the results: a worker's heartbeat (answered on its
own thread) must come back within elastic.hang_timeout_s, a dead actor fails the wait at once,
and the whole call has the collective timeout plus a margin. Whatever goes wrong surfaces as a
`WorkerLost` naming the cause and the ranks, never as a hang.

A world can be re-formed without new processes: `leave` on the survivors, `form` with new
ranks, `setup` on a fresh port.
"""

from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Optional

import ray

from baton.checkpoint import CheckpointStore
from baton.errors import WorkerError, WorkerLost, raised_cause, reason
from baton.parallel import ParallelDims
from baton.spec import JobSpec
from baton.workers import warm
from baton.workers.capacity import ask_autoscaler
from baton.workers.actor import RemoteWorker

BEAT_S = 0.5  # how often a waiting coordinator sends each worker a heartbeat
START_WAIT_S = 60.0  # how long a worker given room may take to start (imports, CUDA)


class WorkerGroup:
    def __init__(self, spec: JobSpec, dims: ParallelDims):
        self.spec, self.dims = spec, dims  # the current world's (`form`)
        # the job's, elastic range and all: what a new worker is made for, whatever world it
        # joins (made for a world of one replica, it would not import what DDP needs ahead)
        self.job = spec
        self.timeout_s = spec.parallel.timeout_s
        self.hang_timeout_s = spec.elastic.hang_timeout_s
        self.actors: list = []  # by rank
        self.infos: list[dict] = []  # pid and node of each, by rank
        self._beats: dict[int, Any] = {}  # rank -> the heartbeat in flight
        self._sent: dict[int, float] = {}  # rank -> when the heartbeat in flight was sent
        self._requested = False  # an autoscaler request stands (request_capacity)
        self._launched: list = []  # workers created by launch, for the next start
        self.spares: list = []  # warm standby workers (elastic.spares), outside the world
        self._spare_ready: dict[int, Any] = {}  # id(spare) -> its `ready` call
        self.spares_taken = 0  # spares handed out by start, in all
        self.start_failures: list[str] = []  # why workers of the last start died before ready
        # workers an earlier run of this driver kept warm (resources.keep_warm_s), renewed
        # for this one: the first start takes them before making new ones
        self.warm: list = warm.claim(spec)

    # -- placement ----------------------------------------------------------------------------

    def start(self, n: int, timeout_s: float, need: Optional[int] = None,
              grace_s: float = 0.0) -> list[tuple[Any, dict]]:
        """Start up to `n` new workers: wait up to `timeout_s` for room for `need` of them
        (default all), then `grace_s` more for the rest (`wait_started`); those with no room
        by then are killed. Returns (actor, info) of the ones that started."""
        kept, extra, self.warm = self.warm[:max(n, 0)], self.warm[max(n, 0):], []
        warm.let_go(extra, wait=False)  # kept warm beyond what the job wants
        launched, self._launched = self._launched, []
        if len(launched) != n - len(kept):
            for actor in launched:
                ray.kill(actor)
            launched = []
        if n <= 0:
            return []
        need = n if need is None else min(need, n)
        pool = self._take_spares(n - len(kept) - len(launched))
        actors = kept + launched + pool + self._create(n - len(kept) - len(launched) - len(pool))
        refs = [a.ready.remote() for a in actors]
        ready = wait_started(actors, refs, need, timeout_s, grace_s)
        started, self.start_failures = [], []
        for actor, ref in zip(actors, refs):
            try:
                if ref in ready:
                    started.append((actor, ray.get(ref)))
                    continue
            except ray.exceptions.RayError as e:
                self.start_failures.append(why_not_started(e))
            ray.kill(actor)
        return started

    def keep_spares(self, n: int) -> int:
        """Keep `n` warm spares: worker processes started (their imports done) and not in the
        world, which `start` hands out before creating any, so a lost worker is replaced in
        the time a process group takes to form instead of the seconds a new process takes to
        start. New ones are made only in room free now (the caller has found that the job
        cannot grow into it), so a spare never waits for resources and never takes room a
        growth would use. Returns how many spares there are."""
        self.spares = [a for a in self.spares if _alive(a, 0.5)]
        self._spare_ready = {id(a): self._spare_ready[id(a)] for a in self.spares}
        make = min(n, self.free_workers()) - len(self.spares)  # free_workers counts spares
        if make > 0:
            new = self._create(make)
            self.spares += new
            self._spare_ready.update({id(a): a.ready.remote() for a in new})
        return len(self.spares)

    def spares_ready(self, n: int) -> bool:
        """Whether the first `n` spares (as many as there are) have finished starting: ready,
        or failed to start. Does not wait."""
        refs = [self._spare_ready[id(a)] for a in self.spares[:n]]
        return len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) == len(refs)

    def ready_spares(self) -> int:
        """How many spares, from the first, have finished starting (a recovery that does not
        wait takes only those). Does not wait."""
        refs = [self._spare_ready[id(a)] for a in self.spares]
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        return next((i for i, ref in enumerate(refs) if ref not in done), len(refs))

    def keep_as_spares(self, members: list[tuple[Any, dict]]) -> None:
        """Hold started workers that are not in the world as spares (survivors beyond the
        replicas a recovery could make whole), the state they kept dropped: a growth takes
        them before making any."""
        for actor, _ in members:
            self.spares.append(actor)
            self._spare_ready[id(actor)] = actor.rest.remote()

    def _take_spares(self, n: int) -> list:
        """Up to `n` live spares, which leave the pool (those that died are dropped)."""
        taken = []
        while self.spares and len(taken) < n:
            actor = self.spares.pop(0)
            if _alive(actor, 0.1):
                taken.append(actor)
                self.spares_taken += 1
        return taken

    def launch(self, n: int) -> None:
        """Create `n` workers now, without waiting: the next `start(n)` waits for these instead
        of creating its own, so their processes start (the larger part of a job's start) while
        the coordinator reads the first batch and opens the MLflow run."""
        self._launched = self._create(n - len(self.warm)) if n > len(self.warm) else []

    def _create(self, n: int) -> list:
        r = self.spec.resources
        options = {"num_cpus": r.cpus_per_worker, "num_gpus": r.gpus_per_worker, "max_restarts": 0,
                   "scheduling_strategy": "SPREAD" if r.placement == "spread" else "DEFAULT"}
        return [RemoteWorker.options(**options).remote(self.job, ParallelDims(1), 0)
                for _ in range(n)]

    def request_capacity(self, workers: int) -> None:
        """Ask Ray's autoscaler (KubeRay's in-tree one) for room for `workers` workers in all.
        It adds nodes up to its group's maxReplicas, and the coordinator grows onto them at its
        next rescale check, renewing the request there; `shutdown` withdraws it. Without an
        autoscaler (a laptop, a fixed cluster) it changes nothing."""
        r = self.spec.resources
        bundle = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker else {})}
        ask_autoscaler(f"baton:{self.spec.name}", [bundle] * workers)
        self._requested = workers > 0

    def free_workers(self) -> int:
        """How many more workers the job could have right now: room on the cluster's nodes
        (each worker on one node; none on a node Ray is draining, where Ray places nothing
        new), and its own spares (a growth takes those first)."""
        from ray._private import state

        r, draining = self.spec.resources, draining_nodes()
        n = 0
        for node, free in state.available_resources_per_node().items():
            if node in draining:
                continue
            fit = int((free.get("CPU", 0) + 1e-9) // r.cpus_per_worker)
            if r.gpus_per_worker:
                fit = min(fit, int((free.get("GPU", 0) + 1e-9) // r.gpus_per_worker))
            n += fit
        return n + len(self.spares) + len(self.warm)

    def free_room(self) -> tuple[float, float]:
        """The CPUs and GPUs free on the cluster, all nodes together."""
        free = ray.available_resources()
        return free.get("CPU", 0.0), free.get("GPU", 0.0)

    def draining_nodes(self) -> dict[str, float]:
        return draining_nodes()

    def on_nodes(self, nodes) -> list[int]:
        """The ranks of this world whose workers run on `nodes` (node ids)."""
        return [rank for rank, info in enumerate(self.infos) if info.get("node") in nodes]

    def describe_free(self) -> dict:
        return ray.available_resources()

    def largest_node(self) -> dict:
        """The CPUs and GPUs of the largest live node (by what one worker needs)."""
        sizes = [{"CPU": n["Resources"].get("CPU", 0.0), "GPU": n["Resources"].get("GPU", 0.0)}
                 for n in ray.nodes() if n.get("Alive")]
        key = "GPU" if self.spec.resources.gpus_per_worker else "CPU"
        return max(sizes, key=lambda size: (size[key], size["CPU"]), default={"CPU": 0.0, "GPU": 0.0})

    def place(self) -> None:
        """Start this group's dp x pp workers (no process group yet)."""
        started = self.start(self.dims.world_size, self.timeout_s)
        if len(started) < self.dims.world_size:
            self.release(started)
            r = self.spec.resources
            bundle = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker else {})}
            raise WorkerError(
                f"could not place {self.dims.world_size} workers of {bundle} within "
                f"{self.timeout_s:g} s (parallel.timeout_s); the cluster has "
                f"{ray.available_resources()} free")
        self.form(started, self.spec, self.dims)

    def form(self, members: list[tuple[Any, dict]], spec: JobSpec, dims: ParallelDims) -> None:
        """Make `members` (actor, info) this group's workers, rank by rank, in a world of `dims`."""
        assert len(members) == dims.world_size
        self.spec, self.dims = spec, dims
        self.actors = [a for a, _ in members]
        self.infos = [info for _, info in members]
        self.world = os.urandom(6).hex()  # this world's name, for its steps (actor.py)
        for rank, actor in enumerate(self.actors):
            actor.assign.remote(spec, dims, rank, self.world)  # queued ahead of everything sent after it
        self._beats, self._sent = {}, {}

    def members(self, ranks: Optional[list[int]] = None) -> list[tuple[Any, dict]]:
        ranks = range(len(self.actors)) if ranks is None else ranks
        return [(self.actors[r], self.infos[r]) for r in ranks]

    def setup(self, record_samples: bool, stage_layers, columns=None,
              keep_state: bool = False) -> list[dict]:
        """Form the process group (on a fresh port) and build each worker's part of the model;
        `columns`: what the data's rows hold (None: a language model's token rows);
        `keep_state`: the workers of the world before hold their state for `share_state`."""
        master = self.call_one(0, "rendezvous_address")
        return self.call("setup", master, record_samples, stage_layers, columns, keep_state,
                         what="joining the group")

    # -- calls --------------------------------------------------------------------------------

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        return self.wait([getattr(self.actors[rank], method).remote(*args)], method, [rank])[0]

    def submit(self, method: str, *args: Any) -> list:
        """Queue `method(*args)` on every rank without waiting; actors run calls in order."""
        return [getattr(a, method).remote(*args) for a in self.actors]

    def submit_step(self, step: int, *args: Any) -> list:
        """Hand step `step` (`train_step(step, *args)`) to every rank's training thread, queued
        behind the calls sent before; the refs of its results, in rank order (actor.py)."""
        for a in self.actors:
            a.train_step.remote(self.world, step, *args)
        return [a.step_result.remote(self.world, step) for a in self.actors]

    def submit_each(self, method: str, args: list[tuple]) -> list:
        """Queue `method(*args[rank])` on each rank without waiting."""
        return [getattr(a, method).remote(*a_args) for a, a_args in zip(self.actors, args)]

    def finished(self, refs: list) -> bool:
        """Whether every one of `refs` has finished (without waiting)."""
        return len(ray.wait(list(refs), num_returns=len(refs), timeout=0)[0]) == len(refs)

    def call(self, method: str, *args: Any, what: str = "", checkpoint: bool = False) -> list:
        """Call `method(*args)` on every rank; results in rank order."""
        return self.wait(self.submit(method, *args), what or method, checkpoint=checkpoint)

    def wait(self, refs: list, what: str, ranks: Optional[list[int]] = None,
             checkpoint: bool = False) -> list:
        """The results of `refs` (one per rank, or of `ranks`), watching the workers meanwhile.
        The first failure ends the wait: no waiting out a collective whose peer is gone.
        A checkpoint's save or load may take checkpoint.timeout_s, anything else
        parallel.timeout_s + 30 (a stuck collective fails first)."""
        ranks = list(range(len(refs))) if ranks is None else ranks
        remaining = dict(zip(refs, ranks))
        limit, setting = ((self.spec.checkpoint.timeout_s, "checkpoint.timeout_s") if checkpoint
                          else (self.timeout_s + 30, "parallel.timeout_s + 30"))
        deadline = time.monotonic() + limit
        while remaining:
            ready, _ = ray.wait(list(remaining), num_returns=len(remaining), timeout=BEAT_S)
            for ref in ready:
                rank = remaining.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    raise self._diagnose(rank, e, what) from e
                except ray.exceptions.RayActorError as e:
                    raise self._lost([rank], e, what) from e
            if remaining:
                self.check_health(what)
                if time.monotonic() > deadline:
                    raise WorkerLost(f"workers did not finish {what} within {limit:g} s ({setting})",
                                     "timeout")
        return ray.get(refs)

    # -- health -------------------------------------------------------------------------------

    def check_health(self, what: str) -> None:
        """Send each worker a heartbeat (one in flight at a time); raise `WorkerLost` for one
        that is dead or has answered none for elastic.hang_timeout_s."""
        now = time.monotonic()
        for rank, actor in enumerate(self.actors):
            ref = self._beats.get(rank)
            if ref is None:
                # Silence counts from this beat, not from the last answer: between two waits
                # the coordinator may be busy for longer than the timeout (a checkpoint
                # commit, a hook), and a live worker must not be declared frozen for that.
                self._beats[rank] = actor.heartbeat.remote()
                self._sent[rank] = now
                continue
            done, _ = ray.wait([ref], timeout=0)
            if done:
                del self._beats[rank]
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    raise self._lost([rank], e, what) from e
            elif now - self._sent[rank] > self.hang_timeout_s:
                raise WorkerLost(f"worker rank {rank} answered no heartbeat for "
                                 f"{self.hang_timeout_s:g} s (elastic.hang_timeout_s) while {what}: "
                                 "frozen or cut off", "hang", (rank,))

    def probe(self, timeout_s: float, skip: frozenset = frozenset()) -> dict[int, str]:
        """Each rank's state now: 'ok', 'dead' or 'silent' (no answer within `timeout_s`).
        Ranks in `skip` (already known gone) are not asked: a frozen one would hold the
        answer back for the whole `timeout_s`."""
        refs = {actor.heartbeat.remote(): rank for rank, actor in enumerate(self.actors)
                if rank not in skip}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        state = {rank: "silent" for rank in range(len(self.actors))}
        for ref in ready:
            try:
                ray.get(ref)
                state[refs[ref]] = "ok"
            except ray.exceptions.RayError:
                state[refs[ref]] = "dead"
        return state

    def _diagnose(self, rank: int, error: Exception, what: str) -> WorkerLost:
        """A worker raised. If a peer is gone, that is the cause (the raise is its echo: a
        collective that lost its peer); otherwise the job's own code failed."""
        gone = [r for r, s in self.probe(2.0).items() if s != "ok"]
        cause = error.cause if getattr(error, "cause", None) is not None else error
        line = reason(cause)
        if gone:
            return self._lost(gone, None, what, echo=f"rank {rank}: {line}")
        if raised_cause(cause) == "timeout":  # a collective that hung
            return WorkerLost(f"worker rank {rank} timed out while {what}: {line}", "timeout", (rank,))
        return WorkerLost(f"worker rank {rank} failed while {what}: {line}", "exception", (rank,))

    def _lost(self, ranks: list[int], error: Optional[Exception], what: str,
              echo: str = "") -> WorkerLost:
        """Workers found dead. When their node is gone too, that is what is reported: which
        node, which ranks (not the message a surviving rank's collective saw, in `echo`)."""
        by_node: dict[Optional[str], list[int]] = {}
        for rank in ranks:
            node = self.infos[rank].get("node") if rank < len(self.infos) else None
            by_node.setdefault(node, []).append(rank)
        lost = [(node, rs) for node, rs in by_node.items() if node and node_gone(node)]
        if lost:
            nodes = "; ".join(f"node {_node_name(node)} with worker rank{'s' * (len(rs) > 1)} "
                              f"{', '.join(map(str, rs))}" for node, rs in lost)
            return WorkerLost(f"lost {nodes} while {what}", "node_died", tuple(ranks))
        if error is None:
            return WorkerLost(f"worker rank(s) {ranks} lost while {what} ({echo})", "actor_died",
                              tuple(ranks))
        text = (str(error).strip().splitlines() or [""])[0][:300]
        return WorkerLost(f"worker rank {ranks[0]} died while {what}: {text}", "actor_died",
                          tuple(ranks))

    # -- teardown -----------------------------------------------------------------------------

    def leave(self, ranks: list[int], timeout_s: float) -> dict[int, int]:
        """Ask `ranks` to drop their process group. Returns, for those that did within
        `timeout_s` (the others are stuck in a collective or gone), the last step each
        completed: the step of the state it keeps."""
        refs = {self.actors[r].leave.remote(): r for r in ranks}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        left = {}
        for ref in ready:
            try:
                left[refs[ref]] = ray.get(ref)
            except ray.exceptions.RayError:
                pass
        return dict(sorted(left.items()))

    def write_kept(self, ranks: list[int], root: str, step: int) -> Optional[list[dict]]:
        """Have `ranks` (after `leave`) write the state they kept as checkpoint `step`'s parts;
        returns their records. Sharded state is written through DCP in two rounds, this
        process carrying the plans that a process group would. None if any of them fails: the
        caller falls back to the last committed checkpoint."""
        actors = [self.actors[r] for r in ranks]
        try:
            timeout = self.spec.checkpoint.timeout_s
            kept = ray.get([a.write_kept.remote(root, step) for a in actors], timeout=timeout)
            if all("parts" in k for k in kept):  # whole stages, written
                return [p for k in kept for p in k["parts"]]
            from baton.checkpoint import sharded  # torch.distributed.checkpoint: only when needed

            store = CheckpointStore(root)
            plans, finish = sharded.plan_globally(store.shards(step), [k["plan"] for k in kept])
            written = ray.get([a.write_kept_shards.remote(root, step, p) for a, p in zip(actors, plans)],
                              timeout=timeout)
            index = finish([results for results, _ in written])
            return [p for _, parts in written for p in parts] + index
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError, OSError, ValueError):
            return None  # ValueError: DCP found the plans inconsistent

    def check_sums(self, root: str, step: int, parts: dict) -> Optional[str]:
        """Checkpoint `step`'s `parts` ({name: record}) checked against their checksums by the
        workers, each reading its share (the largest parts first, each to the worker with the
        fewest bytes so far), in parallel and where they run, rather than the whole checkpoint
        through this process. What does not match (the first by name), or None."""
        shares: list[dict] = [{} for _ in self.actors]
        loads = [0] * len(self.actors)
        for name, rec in sorted(parts.items(), key=lambda item: (-item[1]["size"], item[0])):
            least = loads.index(min(loads))
            shares[least][name] = rec
            loads[least] += rec["size"]
        refs = self.submit_each("check_sums", [(root, step, share) for share in shares])
        problems = self.wait(refs, f"checking checkpoint {step}'s checksums", checkpoint=True)
        return min((p for p in problems if p), default=None)

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            ray.kill(self.actors[r])

    def release(self, members: list[tuple[Any, dict]]) -> None:
        """Let go of workers that are not (or no longer) part of the world."""
        for actor, _ in members:
            ray.kill(actor)

    def abandon(self, refs: list) -> None:
        """Give the world up: drop calls not yet started, and the steps each worker's training
        thread holds queued (a call already running finishes or fails on its own)."""
        for ref in refs:
            ray.cancel(ref)
        for actor in self.actors:
            actor.end_world.remote(self.world)

    def discard(self, refs: list) -> None:
        """Collect what `refs` ended with, errors included, once they are done (after `leave`):
        an error never fetched is printed as "Unhandled error" when its ref is dropped."""
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass

    def shutdown(self, finished: bool = False) -> None:
        """Let go of every worker; after a finished run with resources.keep_warm_s, keep those
        that rest cleanly warm for the driver's next run (workers/warm.py)."""
        idle = self.actors + self.spares + self.warm
        kept = []
        if finished and self.spec.resources.keep_warm_s > 0 and idle:
            refs = [actor.rest.remote() for actor in idle]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=warm.RENEW_S)
            for actor, ref in zip(idle, refs):
                try:
                    if ref in ready:
                        ray.get(ref)
                        kept.append(actor)
                except ray.exceptions.RayError:
                    pass
            warm.keep(self.spec, kept)
        for actor in idle + self._launched:
            if not any(actor is k for k in kept):
                ray.kill(actor)
        self.actors, self.infos, self._launched, self.spares, self.warm = [], [], [], [], []
        if self._requested:
            self.request_capacity(0)  # let the autoscaler scale down once the nodes idle


def why_not_started(error: Exception) -> str:
    """One line for a worker that was not ready: the exception its constructor raised (kept
    and raised by `Worker.ready`, or one that killed the actor: the last line of Ray's message,
    which carries the worker's traceback), memory, or its runtime environment."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
    lines = [line.strip() for line in text.splitlines() if line.strip()] or [type(error).__name__]
    if isinstance(error, ray.exceptions.OutOfMemoryError) or "running low on memory" in text:
        # Ray's memory monitor killed it (an actor's death says so in its exit detail): the
        # line with the node's figures, else the first
        where = [line for line in lines if line.startswith("Memory on the node")] or lines
        return f"out of memory: {where[0][:300]}"
    if isinstance(error, ray.exceptions.RuntimeEnvSetupError):
        return f"its runtime environment could not be set up: {lines[-1][:300]}"
    if getattr(error, "actor_init_failed", False) or isinstance(error, ray.exceptions.RayTaskError):
        return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1])[:300]  # baton.errors.X: -> X:
    return lines[0][:300]


def wait_started(actors: list, refs: list, need: int, timeout_s: float, grace_s: float = 0.0) -> list:
    """Of `actors` and their `ready` calls `refs`: the calls that answered. Waits up to
    `timeout_s` for `need` of them and `grace_s` more for the rest, and then for each worker
    given room by then (its process runs) up to START_WAIT_S from the beginning: those
    timeouts are for room (an autoscaler's nodes, a peer's freed CPUs), not for a process's
    imports, which take seconds on a busy node (four at once took more than 10 s on a 2-core
    machine) and longer where CUDA starts."""
    began = time.monotonic()
    ready, _ = ray.wait(refs, num_returns=need, timeout=timeout_s) if need else ([], refs)
    if len(ready) < len(refs) and grace_s > 0:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=grace_s)
    starting = [ref for actor, ref in zip(actors, refs) if ref not in ready and has_process(actor)]
    left = began + START_WAIT_S - time.monotonic()
    if starting and left > 0:
        ready += ray.wait(starting, num_returns=len(starting), timeout=left)[0]
    return ready


def has_process(actor) -> bool:
    """Whether Ray has given `actor` room: a worker process of its own, rather than a wait for
    resources. Read from the GCS's actor table, which has the process id from the moment a
    node grants the actor's lease (Ray's state API has the same, but needs the dashboard)."""
    from ray._private import state

    try:
        info = state.actors(actor._actor_id.hex())
    except Exception:  # an older or newer Ray's table: every worker waits as for room
        return False
    return bool(info and info.get("Pid"))


def _alive(actor, timeout_s: float) -> bool:
    """Whether `actor` is not known dead: it answers a heartbeat, or has not answered within
    `timeout_s` (still starting: `start`'s readiness wait decides). A spare on a node that
    went away fails the call at once."""
    ref = actor.heartbeat.remote()
    done, _ = ray.wait([ref], timeout=timeout_s)
    if not done:
        return True
    try:
        ray.get(done[0])
        return True
    except ray.exceptions.RayError:
        return False


def draining_nodes() -> dict[str, float]:
    """The nodes Ray is draining, by id: seconds until the deadline it was given (inf: none).
    Ray drains a node that is to go: `ray start --block` on SIGTERM (a Kubernetes pod deleted,
    a spot VM's preemption notice; RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 30 s by default), or
    its autoscaler before it removes one. It places nothing new there and stops the raylet at
    the deadline, or as soon as nothing runs there. One call to the GCS (0.5 ms measured);
    read through Ray's private state API (`ray drain-node` is Ray's hidden, developer-facing
    command), so a Ray without it reads as no node draining."""
    from ray._private import state

    try:
        deadlines = state.state.get_draining_nodes()
    except Exception:
        return {}
    now = time.time()
    return {node: ms / 1000 - now if ms else float("inf") for node, ms in deadlines.items()}


def node_gone(node_id: str, timeout_s: float = 1.0) -> bool:
    """Whether a node is lost: Ray says so, or its raylet no longer takes a connection (Ray's
    own health check declares a node dead only after several missed checks, seconds after
    its workers are seen dead; a refused or silent port says it at once)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            if not node.get("Alive"):
                return True
            try:
                socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]),
                                         timeout=timeout_s).close()
                return False
            except OSError:
                return True
    return True


def _node_name(node_id: str) -> str:
    """'192.0.2.7 (3f9a01c2)': the node's address and the start of its id (simulated nodes
    share one address)."""
    address = next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), "?")
    return f"{address} ({node_id[:8]})"
