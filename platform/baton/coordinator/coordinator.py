"""The coordinator owns a run: a state machine that makes one transition per `tick()`.

    pending --(the data's manifest and order ready, MLflow run open)--> scheduling
    pending --(other baton jobs hold the room its smallest world needs)--> queued
    queued --(its turn in line: priority, then arrival; room for min_dp replicas)--> scheduling
    scheduling --(workers placed, group formed, checkpoint loaded)--> running
    running --(one optimizer step; a checkpoint when due)--> running | finished
    running --(step `until` done: a checkpoint here)--> paused (`baton run --until`)
    running --(eval.patience evaluations without improvement: a checkpoint here)--> finished
    running --(a step's loss spiked: train.rewind_on_spike)--> rewinding
    rewinding --(the steps queued behind it dropped, world re-formed, newest checkpoint loaded,
                 the data taken on after the spike's batch)--> running
    running --(room for more replicas, seen every elastic.rescale_check_s)--> rescaling
    rescaling --(checkpoint here, world re-formed larger, checkpoint loaded)--> running
    running --(`baton scale`, or a job of higher priority, set a ceiling below the world: seen
               every rescale_check_s)--> shrinking
    shrinking --(checkpoint here, world re-formed smaller, the rest let go)--> running
    running --(a job of higher priority needs every worker: a ceiling of 0)--> suspended
               (a checkpoint here, every worker let go)
    suspended --(that job ended, room for min_dp replicas: workers started, checkpoint
                 loaded)--> running
    any --(a worker lost: dead, frozen, failed)--> recovering
    recovering --(survivors kept, workers topped up, world re-formed, latest checkpoint
                  loaded, data cursor rewound with it)--> running
    recovering --(the failure policy gives up)--> failed
    any --(any other error)--> failed

It decides (which samples, which learning rate, when to checkpoint, what world size); the
workers execute. The decisions about failures and world sizes come from the pure policies in
`policy.py`; its collaborators take the job's turn for room (`admission.py`: the line,
room out of turn, room claimed from jobs of lower priority; `priorities.py`), place workers
(`placement.py`) within the ceiling `baton scale` and jobs of higher priority set
(`ceiling.py`), commit checkpoints
(`commits.py`), keep the steps queued on the workers (`flight.py`), stop early (`stopping.py`), judge loss spikes (`spikes.py`), hand out the data and keep the cursor and the ledger (`samples.py`, reading
through `data/feed.py`), and report (`report.py`: MLflow, live metrics, the progress line,
the status file). It is the only writer to MLflow, through them.
"""

from __future__ import annotations

import collections
import enum
import os
import socket
import time
from typing import Callable, Optional

from baton import __version__
from baton.checkpoint import CheckpointStore, frozen
from baton.checkpoint.lease import Lease
from baton.data.manifest import Manifest
from baton.data.source import JobData, preflight
from baton.coordinator.admission import Admission, workers
from baton.coordinator.ceiling import Ceiling
from baton.coordinator.commits import Commits, Save
from baton.coordinator.evaluation import Evaluation, evaluation
from baton.coordinator.flight import Flight, Pending
from baton.coordinator.stopping import early_stop
from baton.coordinator.stragglers import Stragglers
from baton.coordinator.steps import StepStats
from baton.coordinator.phases import Phases
from baton.coordinator.placement import START_WAIT_S, Placement, together
from baton.coordinator.policy import Failure, FailurePolicy, ScalePolicy
from baton.coordinator.priorities import Priorities
from baton.coordinator.report import Report
from baton.coordinator.result import RunResult
from baton.coordinator.samples import Samples
from baton.coordinator.spikes import Spike, Spikes, describe
from baton.errors import CheckpointError, DataError, NoRoom, WorkerError, WorkerLost
from baton.parallel.partition import plan_stages
from baton.spec import JobSpec
from baton.status import StatusBoard
from baton.storage import redact
from baton.workers import WorkerGroup


# A survivor that has not left its group this long after a failure is replaced. One waiting
# on a peer that left or was killed fails at once: `Worker.leave` frees every gloo group of the
# old world, which closes its connections, and a killed process's sockets close with it
# (measured: the survivors of hybrid ZeRO-3 at dp 4 and of pp 2 x hybrid ZeRO-3 all left
# within 1.4 s of a kill). After a death or a silence the survivors get the collective's
# timeout on top, since a lost or frozen machine's sockets may stay open. After a timeout or a
# rank's own error every peer is alive and leaves, so a rank still in its step is a straggler
# in its own compute: the grace alone (it held the stop phase 15 s under `parallel.timeout_s:
# 5`, and would hold it 130 s under the default). `leave` returns once every survivor has left.
LEAVE_GRACE_S = 10.0
LINE_CHECK_S = 1.0  # how often a job waiting for room (queued, suspended) looks for its turn


class State(enum.Enum):
    PENDING = "pending"
    QUEUED = "queued"  # in line for room that other jobs hold (priority, then arrival)
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RECOVERING = "recovering"
    RESCALING = "rescaling"
    REWINDING = "rewinding"  # back to the newest checkpoint from a loss spike
    MOVING = "moving"  # off nodes Ray is draining
    SHRINKING = "shrinking"  # to the ceiling `baton scale` or a job of higher priority set
    SUSPENDED = "suspended"  # every worker given to a job of higher priority, until it ends
    EVALUATING = "evaluating"  # a checkpoint, without training (`baton eval`)
    FINISHED = "finished"
    PAUSED = "paused"  # at `until`, before train.steps, on a checkpoint: a run again goes on
    FAILED = "failed"


WORKING = (State.SCHEDULING, State.RUNNING, State.RECOVERING, State.RESCALING, State.MOVING,
           State.SHRINKING, State.REWINDING)  # states with workers


class Coordinator:
    def __init__(self, spec: JobSpec, tracker, *, resume_meta: Optional[dict] = None,
                 record_samples: bool = False, show_progress: bool = True,
                 on_step: Optional[Callable[["Coordinator"], None]] = None,
                 group_factory: Callable[..., WorkerGroup] = WorkerGroup,
                 data: Optional[JobData] = None, lease: Optional[Lease] = None,
                 evaluate_only: bool = False, until: Optional[int] = None,
                 tags: Optional[dict] = None):
        self.base = spec  # the job as written: its recipe, elastic settings, checkpoints
        self.spec = spec  # the job at the current dp (batch_policy applied)
        self.tracker = tracker
        self.dims = spec.dims()
        self.pp = spec.parallel.pp
        self.per_replica = spec.per_replica  # workers a replica takes: pp x tp x cp
        self.scale = ScalePolicy(tuple(spec.valid_dps()), self.per_replica)  # within the ceiling
        self.failures = FailurePolicy(spec.elastic.max_failures)
        self.on_step = on_step  # called after every completed step (observers, fault tests)
        self.group_factory = group_factory  # the unit tests' fake group stands in for Ray
        self.dp_history: list[tuple[int, int]] = []
        self.failure: Optional[Failure] = None
        self.failure_at = 0.0
        self.starting: Optional[Phases] = Phases("start")  # until the first step is done
        self.resumed: Optional[Phases] = None  # a recovery or rescale awaiting its first step
        # the start's phases, from here to the first step (finished and kept in the result then)
        self.start: dict = {}  # the start's phases, once its first step is done
        self.store = CheckpointStore(spec.checkpoint_dir)
        # what its checkpoints leave out: the frozen parameters of a model started from an
        # export (a LoRA job's checkpoints hold the adapters, not the model: checkpoint/frozen.py)
        self.left_out = frozen.record(spec.model)
        # this job in the cluster's list, its claims on jobs of lower priority and theirs on it
        self.priorities = None if evaluate_only else Priorities(spec)
        # the largest world `baton scale` and the claims of jobs of higher priority allow
        self.ceiling = Ceiling(self.store, spec, self.priorities)
        self.resume_meta = resume_meta
        self.data = data  # checked before Ray started (api.run), or in _prepare
        self.manifest: Optional[Manifest] = None
        self.samples: Optional[Samples] = None  # the cursor, the batches, the ledger
        self.evaluation: Optional[Evaluation] = None
        self.record_samples = record_samples
        # evaluate checkpoint resume_meta on the held-out data and stop (`baton eval`): no
        # training feed, a new MLflow run, and a lost worker ends it (nothing to recover)
        self.evaluate_only = evaluate_only
        # the step this run stops at (`baton run --until`): a checkpoint there, evaluated where
        # the job evaluates; the schedule is still train.steps's, so going on later trains as
        # a run that never stopped
        self.end = min(until, spec.train.steps) if until else spec.train.steps
        self.tags = tags or {}  # on its MLflow run besides its own (a sweep's trial: its parent)
        self.state = State.PENDING
        self.step = 0
        self.group: Optional[WorkerGroup] = None
        self.placement: Optional[Placement] = None  # where the workers come from (_launch)
        self.first_workers = 0  # how many workers the job starts with
        self.last_metrics: dict = {}  # of the last completed step
        self.flight = Flight()  # the steps handed to the workers, not yet completed
        self.workers: list[dict] = []
        self.stage_layers: Optional[list[int]] = None
        t = spec.train
        self.trace_step = spec.tracking.trace_step or min(10, t.steps)
        self.report = Report(spec.name, tracker, StatusBoard(self.store), show_progress)
        self.admission = Admission(self.priorities, self.report, self._record, self._publish_status)
        self.events = self.report.events  # the run record (RunResult.events, events.json)
        self.live = self.report.live
        self.stats = StepStats(spec)  # what the steps measured
        self.stragglers = Stragglers()  # the worker every step waits for, if one does
        # eval.patience; `stopped_early` says why the run ended before train.steps, once it has
        self.early_stop = None if evaluate_only else early_stop(spec)
        self.stopped_early: Optional[dict] = None
        rule = spec.train.rewind_on_spike
        self.spikes = Spikes(rule) if rule and not evaluate_only else None
        self.spike: Optional[Spike] = None  # the one being rewound from
        c = spec.checkpoint
        self.commits = Commits(self.store, tracker, self.live, c.keep, lease, background=c.async_,
                               best=(c.best, c.best_lowest) if c.best else None)
        self.run_id: Optional[str] = None
        self.prepared = False  # data read and the MLflow run open: from here on, a status
        self.started_at = time.time()
        self.suspended_at = 0.0  # when a job of higher priority took every worker (monotonic)

    def run(self) -> RunResult:
        try:
            while self.state not in (State.FINISHED, State.PAUSED, State.FAILED):
                self.tick()
        except BaseException as e:
            self.state = State.FAILED
            self._publish_status(error=f"{type(e).__name__}: {e}")
            self.report.failed(e, self.step, killed=isinstance(e, KeyboardInterrupt))
            raise
        finally:
            if self.priorities is not None:
                self.priorities.withdraw()  # first: a job suspended for it is in line again
            if self.group is not None:
                self.group.shutdown(finished=self.state in (State.FINISHED, State.PAUSED))
            for reads in (self.samples, self.evaluation):
                if reads is not None:
                    reads.close()
            self.store.settle()  # the old checkpoints retention is deleting
            if self.priorities is not None:
                self.priorities.close()  # the room it claimed goes back
            self.live.close()
        return self._result()

    def tick(self) -> None:
        handler = {State.PENDING: self._prepare, State.SCHEDULING: self._schedule,
                   State.RUNNING: self._run_step, State.RECOVERING: self._recover,
                   State.RESCALING: self._rescale, State.MOVING: self._move,
                   State.SHRINKING: self._shrink, State.SUSPENDED: self._wait_for_room,
                   State.QUEUED: self._wait_in_line, State.EVALUATING: self._evaluate,
                   State.REWINDING: self._rewind}[self.state]
        before = self.state
        try:
            self.state = handler()
        except WorkerLost as e:
            if self.state is State.PENDING or self.evaluate_only:
                raise
            self.failure = Failure(self.step + 1, e.cause, str(e), e.ranks)
            self.failure_at = time.time()
            self.state = State.RECOVERING
        except Spike as e:
            self.spike, self.state = e, State.REWINDING
        if self.state is not before or self.report.board.due():
            self._publish_status(changed=self.state is not before)

    # -- transitions --------------------------------------------------------------------------

    def _prepare(self) -> State:
        # the workers' processes start now, while the first batch is read and MLflow opens
        # (measured on 2 cores: about 7 s and 5 s, one after the other before)
        timer = self.starting = Phases("start")
        self._launch()
        if self.data is None:
            self.data = preflight(self.spec, self.spec.name)
        self.manifest = self.data.manifest
        if not self.evaluate_only:
            self.samples = Samples(self.data.feed(self.spec), self.manifest,
                                   lambda event: self.report.mix_phase(event, self._tags()),
                                   lambda event: self.report.bad_rows(event, self._tags()))
        self.evaluation = evaluation(self.spec, self.data, self.end)
        meta = self.resume_meta
        if meta:
            self.step = self.flight.submitted = meta["step"]
        if self.samples:
            if meta:
                self.samples.seek(meta)
            self.samples.prime(self.spec.train.global_batch, self.step)
        timer.lap("data")
        # (an evaluation's run is named apart: `baton report JOB` draws the job's training)
        run_id = self.tracker.start(
            f"{self.spec.name}-eval" if self.evaluate_only else self.spec.name, self.spec.flat(),
            run_id=meta.get("mlflow_run_id") if meta and not self.evaluate_only else None)
        self.tracker.set_tags(self._run_tags(meta))
        self.run_id = run_id
        self.report.opened(self.spec.train.steps, self.step,
                           "tok" if self.spec.task == "language_model" else "samples")
        self.prepared = True
        timer.lap("tracking")
        return State.SCHEDULING if self.first_workers else State.QUEUED

    def _run_tags(self, meta: Optional[dict]) -> dict:
        """The MLflow run's tags: what ran on what data, and where it went on from."""
        training = meta and not self.evaluate_only
        return {"baton.version": __version__, "spec.fingerprint": self.spec.fingerprint(),
                "data.samples": self.data.train_samples, "data.manifest": self.manifest.digest(),
                "checkpoint.dir": self.spec.checkpoint_dir,
                **({"resumed_from_step": self.step} if training else {}),
                **({"forked_from": f"{meta['forked_from']['job']} step {self.step}"}
                   if training and meta.get("forked_from") else {}),
                **({"baton.evaluates": self.store.step_dir(self.step) if meta
                    else self.spec.model.init_from} if self.evaluate_only else {}),
                **self.tags}

    def _launch(self) -> None:
        """The workers' processes start: as many as the cluster has room for, up to max_dp;
        none yet where other jobs hold the room (`_turn`)."""
        self.group = self.group_factory(self.base, self.dims)
        self._place()
        if self._turn():
            self.group.launch(self.first_workers)
        else:
            self.admission.queued(self.scale.min_workers)

    def _place(self) -> None:
        self.placement = Placement(self.group, self.base, self.scale,
                                   lambda short, need: self.admission.ask(short, need, self.step),
                                   self.priorities.spoken_for if self.priorities else lambda: 0,
                                   self.priorities)
        self._cap()

    def _turn(self, suspended: bool = False) -> bool:
        """Whether the job starts now, `first_workers` of them: its turn in line, or room out
        of turn (`Admission.turn`)."""
        self.first_workers = self.admission.turn(self.placement, self.step, self.prepared, suspended)
        return bool(self.first_workers)

    def _wait_in_line(self) -> State:
        """Queued: start once it is this job's turn (`_turn`, every LINE_CHECK_S), or stop
        after resources.queue_timeout_s in line."""
        time.sleep(LINE_CHECK_S)
        if self._turn():
            self.starting.lap("queued")
            self.report.waited(self.starting.phases_s["queued"])
            self.group.launch(self.first_workers)
            return State.SCHEDULING
        self.live.waiting(self.admission.waited(self.scale.min_workers, self.base.resources.queue_timeout_s))
        return State.QUEUED

    def _schedule(self) -> State:
        timer = self.starting
        try:
            members = self.placement.start(self.first_workers)
        except NoRoom:  # an autoscaler at its maximum, and room other jobs hold: in line
            if not self.admission.after_nodes(self.placement, self.base.parallel.timeout_s):
                raise
            return State.QUEUED
        timer.lap("workers")
        self._form(members)
        timer.lap("form")
        if self.evaluate_only:  # the checkpoint asked for (the workers check its checksums),
            if self.resume_meta:  # or the weights the job starts from (model.init_from)
                self._load(self.resume_meta)
            timer.lap("load")
            return State.EVALUATING
        if self.resume_meta:
            self._load_latest(resuming=True)
        timer.lap("load")
        return State.RUNNING

    def _evaluate(self) -> State:
        """`evaluate_only`: one pass over the held-out data, logged at the checkpoint's step."""
        refs = self.evaluation.submit(self.group, self.spec.train.global_batch)
        evaluated = self.evaluation.collect(self.group, refs, self.step)
        self.tracker.log_metrics(self.step, evaluated)
        self.report.evaluated(self.step, evaluated)
        self.tracker.finish("FINISHED", background=True)
        return State.FINISHED

    def _run_step(self) -> State:
        if self.stopped_early:
            return self._finish()
        if self.resumed is None and self.placement.leaving():
            return State.MOVING
        if self.resumed is None and self.ceiling.changed():
            self._cap()
            if self.dims.dp > max(self.scale.valid_dps):
                return State.SHRINKING
        if self.resumed is None and self.ceiling.max_dp == 0 and self.step < self.end:
            return self._suspend()
        if self._rescale_due():
            return State.RESCALING
        # the next step queued on the workers while this one runs (flight.py)
        while self.flight.room(self.end, hold_behind_evaluation=self.early_stop is not None):
            self._submit(self.flight.submitted)
        if not self.flight:
            return self._finish()
        self._complete_next()
        return State.RUNNING

    def _finish(self) -> State:
        """Every step done (to train.steps, or paused at `until`), or stopped early (on a
        checkpoint of the step it stopped at)."""
        if self.stopped_early and not self.commits.holds(self.step):
            self._checkpoint_now()
        self.commits.drain(self.group)  # the last checkpoint, if written in the background
        # the report is drawn while the workers and Ray shut down: api.run waits for it
        self.tracker.finish("FINISHED", background=True)
        paused = self.step < self.spec.train.steps and not self.stopped_early
        return State.PAUSED if paused else State.FINISHED

    def _recover(self) -> State:
        """Keep the workers that are still there, replace the rest where the cluster has room,
        re-form the world (fewer replicas if need be, at least min_dp) and go on from the
        latest committed checkpoint."""
        f, timer = self.failure, Phases("recovery")
        decision = self.failures.decide(f)
        self._record({"kind": "failure", "step": f.step, "cause": f.cause, "ranks": list(f.ranks),
                      "message": f.message, "at": self.failure_at, "recover": decision.recover,
                      "since_last_step_s": self.flight.since_last_step_s()})  # None: no step yet
        self.report.note(f"step {f.step}: {f.cause}: {f.message}")
        self.live.failure(f.cause, alive=len(self.group.actors) - len(f.ranks))
        if not decision.recover:
            raise WorkerError(decision.reason)
        # 1. stop the old world: drop queued calls, keep whoever still answers and gets out
        stale = self.flight.drop()
        self.group.abandon(stale)
        self.commits.abandon()
        # ranks named by a death or a silence go; ranks that raised (their own code, a
        # collective's timeout) are alive and stay
        gone = frozenset(f.ranks) if f.cause in ("actor_died", "node_died", "hang") else frozenset()
        state = self.group.probe(2.0, skip=gone)
        alive = [r for r, s in state.items() if s == "ok" and r not in gone]
        dead = [r for r in state if r not in alive]
        self.group.kill(dead)  # first: that frees their peers
        wait_s = LEAVE_GRACE_S + (self.spec.parallel.timeout_s if dead else 0)
        left = self.group.leave(alive, wait_s)
        self.group.kill([r for r in alive if r not in left])
        self.group.discard(stale)
        timer.lap("stop")
        from_survivors = self.commits.commit_survivors(self.group, self.dims, self.step, left,
                                                       self._meta(self.samples.done, rng=[]))
        timer.lap("survivor_save")
        survivors = self.group.members(list(left))
        # 2. top up to max_dp where there is room (warm spares first), or go on with the
        # survivors (elastic.recovery continue) and grow back once replacements have started
        spares_before = self.group.spares_taken
        new, going_on = self.placement.refill(len(survivors))
        members = survivors + new
        timer.lap("reschedule")
        if self.group.spares_taken > spares_before:
            self.placement.check_soon()  # its replacement starts at the first step after
        return self._reform(timer, members, {
            "after_failure_at_step": f.step, "cause": f.cause,
            "state_from": "survivors" if from_survivors else "checkpoint",
            "workers_reused": len(survivors), "workers_new": len(members) - len(survivors),
            "workers_from_spares": self.group.spares_taken - spares_before}, spares=going_on)

    def _rewind(self) -> State:
        """A step's loss spiked (train.rewind_on_spike): drop the steps queued behind it and
        the checkpoints queued with them (a background save of an earlier step commits
        first), re-form the world on the same workers (as a recovery does: nothing half-done
        is left on them), load the newest whole checkpoint, and take the data on from the
        batch after the spike's. The batches from the checkpoint to the spike are not
        trained; nothing counts as a failure."""
        spike, timer = self.spike, Phases("rewind")
        self.spikes.rewinding(spike.event)  # past train.rewind_on_spike.most: the run fails
        self.commits.drain(self.group)
        stale = self.flight.drop()
        self.group.abandon(stale)
        self._leave_all("a rewind")
        self.group.discard(stale)
        timer.lap("stop")
        state = self._reform(timer, self.group.members(), {"spike_at_step": spike.event["step"]})
        self.samples.skip(spike.cursor)
        self.spike = None
        self.report.spike({**spike.event, "rewound_to": self.step,
                           "batches_skipped": spike.event["step"] - self.step,
                           "rewind": len(self.spikes.rewinds)},
                          describe(spike.event, self.spikes.rule), self.spikes.rule.most, self._tags())
        return state

    def _rescale(self) -> State:
        """Grow at a step boundary: finish the queued steps, take the new workers, re-form the
        world with them and give them the state of this step. A replica's state is whole when
        each worker holds all of it (data parallel, unsharded): the old rank 0 sends its own
        to every worker over the new group. Otherwise a checkpoint of this step is written and
        the world loads the newest whole one: that one, verified as every load's is (the
        previous one if it fails)."""
        timer = Phases("rescale")
        self._finish_queued(timer)  # training, not waiting: steps queued before the growth was due
        grow_to = self.scale.grow_to(self.dims.dp, self.group.free_workers())
        if grow_to is None or self.step >= self.end:
            self.placement.quota.reserve(0)  # (the growth's workers, reserved in its quota)
            return State.RUNNING
        share = self.per_replica == 1 and self.base.parallel.shard == "none"
        self._commit_here(timer, write=not share)  # shared: a background save in flight commits first
        old_dp = self.dims.dp
        new = self.group.start((grow_to - old_dp) * self.per_replica, START_WAIT_S)
        members = self.group.members() + new
        if self.scale.target(len(members)) == old_dp:  # the room went elsewhere meanwhile
            self.group.release(new)
            self.placement.quota.reserve(0)
            return State.RUNNING
        self._leave_all("a resize", new)
        timer.lap("reschedule")
        # the old workers first: rank 0 is one of them
        return self._reform(timer, members, {"from_dp": old_dp, "workers_new": len(new)}, share)

    def _move(self) -> State:
        """Nodes that hold workers are draining: Ray marks a node so when it is about to go (a
        Kubernetes pod deleted, a spot VM's preemption notice reaching `ray start`'s SIGTERM
        handler, an autoscaler's scale-down), places nothing new there, and kills what still
        runs there at the deadline. Move off first, at a step boundary, once the replacements
        (started on other nodes while training went on: `Placement.leaving`) are ready: finish
        the queued steps, commit a checkpoint of this step with every worker alive, and
        re-form with the replacements instead of the leaving workers, from it. No step
        is trained twice, nothing counts as a failure, and the node is let go before its
        deadline (Ray stops a draining node as soon as nothing runs there). Without room
        elsewhere for min_dp replicas the world stays where it is, its checkpoint committed,
        and asks again later; if the node goes first, that is a failure like any other."""
        timer = Phases("move")
        nodes = self.placement.drains
        self._finish_queued(timer)  # steps queued before the notice
        ranks = self.group.on_nodes(set(nodes))  # the world may have changed meanwhile
        if not ranks or self.step >= self.end:
            self.placement.moved()
            return State.RUNNING
        self._commit_here(timer)
        stay = [r for r in range(len(self.group.actors)) if r not in ranks]
        want = min(len(ranks), self.group.free_workers())  # free: on nodes not draining
        new = self.group.start(want, START_WAIT_S) if want else []
        members = self.group.members(stay) + new
        moved = self.scale.target(len(members)) is not None
        left_s = min(nodes.values())
        self._record({"kind": "drain", "step": self.step, "nodes": sorted(nodes), "ranks": ranks,
                      "deadline_in_s": None if left_s == float("inf") else round(left_s, 1),
                      "moved": moved})
        where = ", ".join(n[:8] for n in sorted(nodes))
        if not moved:
            self.group.keep_as_spares(new)  # started for this move: ready for the next try
            self.placement.moved(stay=True)
            self.report.note(
                f"step {self.step}: node {where} is draining, and the cluster has no room "
                f"elsewhere for {workers(self.scale.min_workers)}: training goes on there, "
                f"checkpoint {self.step} committed")
            return State.RUNNING
        self.report.note(f"step {self.step}: node {where} is draining: moving worker "
                                  f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))} off")
        old_dp = self.dims.dp
        self._leave_all("a move", new)
        self.group.kill(ranks)  # their node can go now
        self.placement.moved()
        timer.lap("reschedule")
        return self._reform(timer, members, {"from_dp": old_dp, "workers_moved": len(ranks),
                                             "workers_new": len(new)})

    def _shrink(self) -> State:
        """Give room back (`baton scale --max-dp`): finish the queued steps, commit a
        checkpoint of this step, and re-form the world of as many replicas as the ceiling
        allows from the workers there are, the rest let go (their room is free once they
        are), from that checkpoint. Nothing is trained twice; nothing counts as a failure."""
        timer = Phases("rescale")
        self._finish_queued(timer)
        old_dp = self.dims.dp
        if old_dp <= max(self.scale.valid_dps) or self.step >= self.end:
            return State.RUNNING
        self._commit_here(timer)
        self._leave_all("a resize")
        timer.lap("reschedule")
        # the replicas beyond the ceiling are let go
        state = self._reform(timer, self.group.members(), {"from_dp": old_dp, "asked": self.ceiling.why})
        cap, job = self.ceiling.max_dp, self.ceiling.claimant
        by = (f"room {self.ceiling.given}" if self.ceiling.lent_back else
              f"room for job {job}, of higher priority" if job else "baton scale")
        self.report.note(f"step {self.step}: {by}: at most {cap} "
                         f"replica{'s' * (cap > 1)}, dp {old_dp} -> {self.dims.dp}")
        return state

    def _suspend(self) -> State:
        """Give every worker to a job of higher priority whose smallest world needs them (a
        claim of 0 replicas), or back (`baton scale --max-dp 0`): finish the queued steps,
        commit a checkpoint of this step, and let every worker go. The run waits (`_wait_for_room`) and goes on from that checkpoint, in
        the same MLflow run, once that job has ended (or the ceiling is cleared) and there is
        room again."""
        self._finish_queued()
        if self.step >= self.end or self.stopped_early:
            return State.RUNNING  # (it finishes now)
        self._commit_here()
        self._leave_all("a suspension")
        self.group.shutdown()
        self.priorities.waits(held=self.ceiling.scaled == 0)  # its place in line kept
        self.live.world(alive=0, world_size=0, dp=0)
        self.suspended_at = time.perf_counter()
        job = self.ceiling.claimant
        self._record({"kind": "suspend", "step": self.step, "for": job or "baton scale"})
        self.report.note(f"step {self.step}: suspended: every worker " + (
            f"{self.ceiling.given}; training goes on from checkpoint {self.step} "
            + ("when its turn in line comes" if self.ceiling.lent_back else "once it ends") if job else
            f"let go (baton scale --max-dp 0); training goes on from checkpoint {self.step} "
            "after --clear"))
        return State.SUSPENDED

    def _wait_for_room(self) -> State:
        """Suspended: once no ceiling holds the job at 0 and it is its turn in line (`_turn`:
        the place it took when suspended), start its workers again and load the checkpoint it
        left off at."""
        time.sleep(min(LINE_CHECK_S, self.spec.elastic.rescale_check_s))
        self.ceiling.changed()
        self.live.waiting(time.perf_counter() - self.suspended_at)
        if self.ceiling.max_dp == 0:
            self.priorities.waits(held=self.ceiling.scaled == 0)
            return State.SUSPENDED
        self._place()
        if not self._turn(suspended=True):
            return State.SUSPENDED
        timer = Phases("resume")
        self.report.waited(time.perf_counter() - self.suspended_at)
        members = self.placement.start(self.first_workers)
        timer.lap("workers")
        return self._reform(timer, members,
                            {"suspended_s": round(time.perf_counter() - self.suspended_at, 3)})

    def _finish_queued(self, timer: Optional[Phases] = None) -> None:
        """Train the steps queued on the workers (not thrown away) before the world changes."""
        while self.flight:
            self._complete_next()
        if timer:
            timer.lap("queued_steps")

    def _commit_here(self, timer: Optional[Phases] = None, write: bool = True) -> None:
        """A committed checkpoint of the step reached, before any worker goes (`write`: one
        written now if the newest is older; a background save in flight commits first)."""
        if write and self.store.latest() != self.step:
            self._checkpoint_now()
        self.commits.drain(self.group)
        if timer:
            timer.lap("checkpoint")

    def _reform(self, timer: Phases, members: list, fields: dict, share: bool = False,
                spares: bool = False) -> State:
        """Make `members` the world (`spares`: those beyond it kept as spares) and give it the
        state of this step: rank 0's, sent over the new group (`share`: each worker of the
        world before holds all of it), or the newest whole checkpoint's. The first step after
        it finishes `timer` (an event with `fields`)."""
        self._form(members, rest_as_spares=spares, keep_state=share)
        timer.lap("group_init")
        if share:
            self.group.call("share_state", self.step, what="sharing the state with the new workers")
            timer.lap("state_copy")
        else:
            self._load_latest()
            timer.lap("checkpoint_load")
        timer.fields = {**fields, "dp": self.dims.dp, "resumed_from_step": self.step}
        self.resumed = timer
        return State.RUNNING

    def _leave_all(self, why: str, new: list = ()) -> None:
        """Every worker leaves its group, to re-form (a growth's `new` workers wait outside);
        one that does not within the grace is lost (a timeout), and the new ones let go."""
        everyone = list(range(len(self.group.actors)))
        left = self.group.leave(everyone, LEAVE_GRACE_S)
        if len(left) < len(everyone):
            self.group.release(list(new))
            raise WorkerLost(f"a worker did not leave its group for {why}", "timeout",
                             tuple(r for r in everyone if r not in left))

    def _cap(self) -> None:
        """Place, grow and recover within the ceiling (none: the job's own max_dp); a ceiling
        below min_dp keeps min_dp (`baton scale` refuses one)."""
        valid = self.base.valid_dps()
        ceiling = self.ceiling.max_dp or max(valid)
        self.scale = ScalePolicy(tuple(dp for dp in valid if dp <= ceiling) or (min(valid),),
                                 self.per_replica)
        self.placement.cap(self.scale)
        self.placement.check_soon()  # a ceiling raised: look for room at the next step

    # -- worlds ---------------------------------------------------------------------------------

    def _form(self, members: list, rest_as_spares: bool = False, keep_state: bool = False) -> None:
        """Make `members` the world: as many replicas as they hold (the rest are let go, or
        kept as spares for a growth that is to follow), ranked in order (each replica's tp
        workers on one node where they can be: `together`), joined in a new
        process group, models built from the seed (`keep_state`: the workers of the world
        before hold their state for `share_state`)."""
        dp = self.scale.target(len(members))
        members = together(members, self.base.parallel.tp * self.base.parallel.cp)
        rest = members[dp * self.per_replica:]
        if rest_as_spares:
            self.group.keep_as_spares(rest)
        else:
            self.group.release(rest)
        self.spec = self.base.at_dp(dp)
        self.dims = self.spec.dims()
        self.group.form(members[:dp * self.per_replica], self.spec, self.dims)
        if self.priorities is not None:
            self.priorities.listed(dp)
        if self.samples:
            self.samples.new_world()
        if self.stage_layers is None:
            self.stage_layers = plan_stages(
                self.spec, lambda: self.group.call_one(0, "profile_layers", self.data.columns))
            if self.pp > 1:
                self.tracker.set_tags({"pipeline.layers_per_stage": self.stage_layers,
                                       "pipeline.schedule": self.spec.parallel.schedule})
        self.workers = self.group.setup(self.record_samples, self.stage_layers, self.data.columns,
                                        keep_state=keep_state)
        self.stats.world(self.workers, self.spec)
        self.stragglers.world(self.workers, self.dims)
        self.live.world(alive=len(self.workers), world_size=self.dims.world_size, dp=dp)
        self.live.waiting(0)
        if self.dp_history:
            self.live.rescaled(self.dp_history[-1][1], dp)
        if not self.dp_history or self.dp_history[-1][1] != dp:
            self.dp_history.append((self.step, dp))

    def _load(self, meta: dict) -> None:
        """Load a committed checkpoint into the current world and rewind the run to it."""
        old = meta["layout"]
        every_rng = len(meta.get("rng", [])) == (old["dp"] * old["pp"] * old.get("tp", 1)
                                                 * old.get("cp", 1))
        t0 = time.perf_counter()
        self.group.call("load", self.store.root, meta["step"], old,
                        old == self._layout() and every_rng, what="loading the checkpoint",
                        checkpoint=True)
        self.live.checkpoint_loaded(time.perf_counter() - t0)
        self.step = self.flight.submitted = meta["step"]
        if self.samples:
            self.samples.seek(meta)
        self._rewind_judges(meta)

    def _load_latest(self, resuming: bool = False) -> None:
        """Load the newest whole checkpoint (`Commits.newest_whole`). With none: start over;
        `resuming` (the driver found the checkpoint whole but for its checksums, which the
        workers check), refuse."""
        meta, failed = self.commits.newest_whole(self.group)
        back_to = f"checkpoint {meta['step']}" if meta else "step 0"
        for step, why in failed:
            self._record({"kind": "checkpoint_rejected", "step": step, "why": why})
            print(f"warning: checkpoint {step} failed verification ({why}); it is set aside and "
                  f"the run goes back to {back_to}", flush=True)
        if meta is None and resuming:
            raise CheckpointError(self.store.none_verifies(failed))
        if meta is None:  # no checkpoint yet: start over (setup built the models from the seed)
            self.step = self.flight.submitted = 0
            self.samples.seek(None)
            self._rewind_judges(None)
            return
        self._load(meta)
        if resuming and meta["step"] != self.resume_meta["step"]:
            self.resume_meta = meta
            self.tracker.set_tags({"resumed_from_step": meta["step"]})

    def _rewind_judges(self, meta: Optional[dict]) -> None:
        """eval.patience's count back to checkpoint `meta`'s (None: the start): the evaluations
        after it count again. A failure while the stop's own checkpoint was written leaves the
        survivors' state of that step, which still stops there. train.rewind_on_spike's window
        of losses too."""
        if self.spikes:
            self.spikes.load_state_dict(meta.get("spike") if meta else None, self.step)
        if self.early_stop:
            self.early_stop.load_state_dict(meta.get("early_stop") if meta else None)
            self.stopped_early = (self.early_stop.ended(self.step)
                                  if self.step < self.spec.train.steps else None)

    def _rescale_due(self) -> bool:
        # a recovery or rescale that has not completed its first step yet is still being
        # measured (self.resumed): growing again now would lose its event
        if self.resumed is not None:
            return False
        joining = self.placement.joining
        due = self.placement.growth_due(self.dims.dp)
        if self.placement.joining and not joining:  # a growth's workers started: say so
            n = self.placement.joining
            self.report.note(f"step {self.step}: room to grow: {n} new worker{'s' * (n > 1)} "
                                      f"starting, training goes on at dp={self.dims.dp}")
        return due

    def _record(self, event: dict) -> None:
        self.report.record(event, self._tags())

    def _tags(self) -> dict:
        return {"elastic.failures": len(self.failures.seen), "elastic.dp": self.dims.dp}

    def _finish_phases(self, timer: Phases) -> dict:
        event = timer.finish(self.stats.compile_s)
        self.report.phases(event, self.step, self.dims.dp, len(self.failures.seen), self._tags())
        return event

    # -- helpers ------------------------------------------------------------------------------

    def _layout(self) -> dict:
        return {"dp": self.dims.dp, "pp": self.dims.pp,
                **({"tp": self.dims.tp} if self.dims.tp > 1 else {}),
                **({"stage_layers": self.stage_layers} if self.dims.pp > 1 else {}),
                **({"shard": self.spec.parallel.shard, "dp_shard": self.dims.dp_shard}
                   if self.spec.parallel.shard != "none" else {}),
                **({"ep": self.spec.parallel.ep} if self.spec.parallel.ep > 1 else {}),
                **({"cp": self.dims.cp} if self.dims.cp > 1 else {})}

    def _submit(self, step: int) -> None:
        """Hand step `step` to the workers, queued behind the steps before it, with the
        checkpoint and the evaluation due after it; it is in flight from there on."""
        t = self.spec.train
        try:
            batch, cursor = self.samples.next_batch(t.global_batch, step)
        except DataError as e:
            raise self._stopped_by_data(e) from None
        lr = t.lr_at(step)
        # a pipeline's timeline by default; a data-parallel profile only when asked for, since
        # profiling slows the step it profiles
        traced = step + 1 == self.trace_step and (
            self.dims.pp > 1 or self.spec.tracking.trace_step is not None)
        pending = Pending(step=step, samples=len(batch), lr=lr, submitted_at=time.perf_counter(),
                           refs=self.group.submit_step(step, batch, lr, traced),
                           cursor=cursor, traced=traced)
        self.flight.add(pending)
        if self.record_samples:
            pending.ledger_refs = self.group.submit("take_ledger")
        done = step + 1
        if done % self.spec.checkpoint.every_steps == 0 or done == self.end:
            pending.save = self.commits.queue(self.group, self.dims, done)
        if self.evaluation and self.evaluation.due(done):
            try:
                pending.evaluation = self.evaluation.submit(self.group, t.global_batch)
            except DataError as e:  # held-out rows: the step before it trains first
                raise self._stopped_by_data(e) from None
            for event in pending.evaluation.left_out:
                self.report.bad_rows({"step": done, "held_out": True, **event}, self._tags())

    def _stopped_by_data(self, error: DataError) -> DataError:
        """Rows that cannot be read as the job says (found as they are read: a NaN, a file
        changed or gone) came up in the next batch or held-out pass: train the steps queued,
        commit a checkpoint of the step reached, so that nothing trained is lost, and stop
        saying so."""
        self._finish_queued()
        if not self.step:
            return error
        self._commit_here()
        return DataError(f"{error} (training stopped at step {self.step}: checkpoint "
                         f"{self.step} committed; with the file fixed in place, its row groups "
                         "as they were, --rebase-data goes on from there)")

    def _complete_next(self) -> None:
        """Complete the oldest queued step (left queued if it fails: recovery cancels it),
        then call `on_step`: after every completed step, those a rescale finishes first too."""
        self._complete(self.flight.oldest())
        self.flight.pop()
        if self.on_step is not None:
            self.on_step(self)

    def _complete(self, p: Pending) -> None:
        results = self.group.wait(p.refs, f"training step {p.step + 1}")  # steps count from 1
        # the ledger too before the step counts as done: a failure between the two used to
        # leave the step counted but the cursor a batch behind, and the survivors' checkpoint
        # of that step then trained one batch twice and shifted every later epoch (found by
        # benchmarks/chaos.py: a worker frozen while its ledger was read)
        entries = self.group.wait(p.ledger_refs, "reading the ledger") if p.ledger_refs else []
        step_time_s = self.flight.timed(p)
        metrics = self.stats.measure(p.step + 1, results, step_time_s, p.samples, p.lr,
                                     p.cursor["epoch"], self.dims)  # raises on a NaN loss
        if metrics.get("skipped"):
            self.report.skipped(p.step + 1, metrics["grad_norm"], self.stats.skipped_in_a_row,
                                self.stats.skip_limit, self._tags())
        elif self.spikes and (spike := self.spikes.judge(p.step + 1, metrics["loss"])):
            self.report.step(p.step + 1, metrics | {"loss_spike": 1}, p.lr, step_time_s)
            raise Spike(spike, p.cursor)  # before the step counts: its checkpoint is not committed
        spread, lagging = self.stragglers.step(results, step_time_s)
        self.live.ranks(results, self.workers)
        metrics.update(spread)
        if lagging:
            self.report.straggler({"step": p.step + 1, **lagging}, self._tags())
        self.step = p.step + 1
        self.samples.completed(p.cursor, entries)  # with the step: see above
        if p.traced:
            self.stats.save_trace(self.step, results, self.spec, self.dims, self.tracker)
        if p.evaluation:  # logged with the step's metrics: a step is logged once
            evaluated = self.evaluation.collect(self.group, p.evaluation, self.step)
            metrics.update(evaluated)
            self.report.evaluated(self.step, evaluated)
            if (self.early_stop and self.early_stop.observe(self.step, evaluated)
                    and self.step < self.spec.train.steps):
                self.stopped_early = self.early_stop.ended(self.step)
        self.report.step(self.step, metrics, p.lr, step_time_s)
        self.last_metrics = metrics  # for on_step observers
        if p.save:
            self._commit(p.cursor, p.save)
        self.commits.poll(self.group)  # a background save, written by now
        if self.stopped_early:  # after the step's metrics: its evaluation is why
            self.report.stopped_early(self.stopped_early, self._tags())
        if self.starting:
            self.start = self._finish_phases(self.starting)
        if self.resumed:
            self._finish_phases(self.resumed)
        self.starting = self.resumed = None

    def _checkpoint_now(self) -> None:
        """A checkpoint of the current step, between steps (before a resize)."""
        self._commit(self.samples.done,
                     self.commits.queue(self.group, self.dims, self.step, background=False))

    def _commit(self, cursor: dict, save: Save) -> None:
        meta = self._meta(cursor, rng=[f"rng-rank{r:04d}.pt" for r in range(self.dims.world_size)])
        self.commits.staged(self.group, save, meta)

    def _meta(self, cursor: dict, rng: list[str]) -> dict:
        """The metadata of a checkpoint of the current step. `rng`: the workers' RNG files it
        holds (all of them, or none for one written from the survivors of a failure)."""
        return {"job": self.spec.name, "step": self.step, "cursor": cursor,
                "fingerprint": self.base.fingerprint(), "recipe": redact(self.base.recipe()),
                "layout": self._layout(), "data": self.manifest.summary(),
                "manifest": self.manifest.to_json(),
                "mlflow_run_id": self.run_id, "tracking_uri": redact(self.tracker.uri),
                "schedule": {"step": self.step, "next_lr": self.spec.train.lr_at(self.step)},
                "rng": rng, "loss": self.stats.last_loss, "baton_version": __version__,
                "time": time.time(),
                # the held-out metrics of this step's state, where it was evaluated (checkpoint.best)
                **({"eval": self.evaluation.last}
                   if self.evaluation and self.evaluation.step == self.step else {}),
                **({"frozen": self.left_out} if self.left_out else {}),
                **({"early_stop": self.early_stop.state_dict()} if self.early_stop else {}),
                **({"spike": self.spikes.state_dict()} if self.spikes else {})}

    def status(self) -> dict:
        """What `baton status` shows of a running job."""
        causes = collections.Counter(f.cause for f in self.failures.seen)
        return {"job": self.spec.name, "state": self.state.value, "step": self.step,
                "steps": self.spec.train.steps, "dp": self.dims.dp, "pp": self.dims.pp,
                **({"tp": self.dims.tp} if self.dims.tp > 1 else {}),
                **({"cp": self.dims.cp} if self.dims.cp > 1 else {}),
                "world_size": self.dims.world_size,
                "workers_alive": len(self.group.actors) if self.group else 0,
                # a growth's workers starting, and standby workers (elastic.spares, survivors)
                "workers_starting": self.placement.joining if self.placement else 0,
                "spares": len(self.group.spares) if self.group else 0,
                **self.stats.status(), "unit": "tokens" if self.spec.task == "language_model" else "samples",
                "last_checkpoint": self.commits.last, "failures": sum(causes.values()),
                "failures_by_cause": dict(causes), "rescales": sum(
                    e["kind"] == "rescale" for e in self.events),
                **({"straggler": self.stragglers.named} if self.stragglers.named else {}),
                **({"skipped_row_groups": skipped} if (skipped := sum(
                    e["kind"] == "bad_rows" for e in self.events)) else {}),
                **({"spikes": self.spikes.rewinds} if self.spikes and self.spikes.rewinds else {}),
                **({"best_checkpoint": {"step": best[0], self.spec.checkpoint.best: best[1]}}
                   if (best := self.commits.best_found) else {}),
                **({"stopped_early": self.stopped_early} if self.stopped_early else {}),
                **({"max_dp": self.ceiling.max_dp, "max_dp_by": self.ceiling.why}
                   if self.ceiling.max_dp is not None else {}),
                **(self.priorities.status(working=self.state in WORKING, in_line=self.state in (
                    State.QUEUED, State.SUSPENDED) and self.ceiling.max_dp != 0)
                   if self.priorities else {}),
                "mlflow_run_id": self.run_id, "tracking": self.tracker.state, "pid": os.getpid(),
                "host": socket.gethostname(), "started_at": round(self.started_at, 3),
                "updated_at": round(time.time(), 3)}

    def _publish_status(self, changed: bool = True, error: Optional[str] = None) -> None:
        if self.prepared:  # refused before it began (bad data, no MLflow run): nothing is left
            self.report.status(self.status(), changed, error)

    def _result(self) -> RunResult:
        return RunResult(job=self.spec.name, state=self.state.value, step=self.step,
                         run_id=self.run_id, checkpoint=self.commits.last,
                         resumed_from=self.resume_meta["step"] if self.resume_meta else None,
                         workers=self.workers, replica_digests=self.commits.replica_digests,
                         ledger=self.samples.ledger if self.samples else [],
                         stage_layers=self.stage_layers, events=self.events,
                         dp_history=self.dp_history, start=self.start,
                         eval=self.evaluation.last if self.evaluation else {},
                         best=self.commits.best_found, stopped_early=self.stopped_early,
                         tracking_uri=getattr(self.tracker, "uri", None),
                         **self.stats.result_fields())
