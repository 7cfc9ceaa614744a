"""Checkpoint commits, for the coordinator: it decides when; this writes them.

A checkpoint is queued behind the step it captures (the workers run calls in order, so the
save sees exactly the state after that step), then committed once every part is written and
the replicas are seen to agree: metadata first, the marker last (`CheckpointStore.commit`).

Synchronous saves write before the workers take the next step. Background saves
(`checkpoint.async`) only copy the state before the next step (a snapshot in host memory),
write it on a thread of each worker while training goes on, and are committed at the first
step boundary after every part is written: at most one is in flight (queueing the next waits
for it), the run's end and a rescale wait for it, and a failure abandons it (its folder stays
torn, never loaded; the survivors' state or the previous checkpoint serve the recovery).
A sharded background save takes DCP's two rounds through here instead of a process group:
each worker's local plan comes back with its snapshot, the global plan goes out, each worker
writes its part on its thread, and the index is written here once every part is.

After a failure, the survivors' in-memory state of the last completed step may be committed
instead of training again from the last checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from baton.checkpoint import CheckpointStore
from baton.checkpoint.lease import Lease
from baton.errors import WorkerError
from baton.parallel import ParallelDims


@dataclass
class Save:
    """A checkpoint queued on the workers, from queueing to commit."""

    step: int
    dims: ParallelDims  # the world that writes it
    save_refs: list  # each worker's save: its parts' records (sync) or None (background)
    digest_refs: list  # each worker's parameter digest at that step
    background: bool
    meta: Optional[dict] = None  # when its step has completed
    written_refs: Optional[list] = None  # background: each worker's parts, once written
    finish: Optional[Callable] = None  # background and sharded: writes DCP's index, returns its record


class Commits:
    def __init__(self, store: CheckpointStore, tracker, live, keep: int,
                 lease: Optional[Lease] = None, background: bool = False,
                 best: Optional[tuple[str, bool]] = None):
        self.store, self.tracker, self.live, self.keep = store, tracker, live, keep
        self.best = best  # checkpoint.best: (metric, lower is better), kept beside the newest
        self.best_found: Optional[tuple[int, float]] = None  # its (step, value), once looked for
        self.best_read = False  # whether the store's checkpoints were (a resumed run's best)
        self.best_warned = False
        self.lease = lease  # held for the run (api.run): nothing is written without it
        self.background = background  # checkpoint.async
        self.pending: Optional[Save] = None  # a background save being written
        self.last: Optional[str] = None  # where the newest checkpoint this run committed is
        self.last_step: Optional[int] = None  # its step
        self.replica_digests: list[str] = []  # each worker's parameter digest at that commit
        self.outpaced = False  # a save came due while the one before it was still being written

    def queue(self, group, dims: ParallelDims, step: int, background: Optional[bool] = None) -> Save:
        """Start checkpoint `step`: a clean folder, and each worker's save and parameter digest
        queued behind the step in flight (with replicas to compare: hashing the parameters of
        a world of one replica, 0.2-0.3 s of the training thread for 113 M parameters on a CPU,
        would check nothing; nor would hashing shards no other worker holds, under `full`
        sharding with one replica group). A save still being written is committed first."""
        self._drain_before(group, step)
        self._begin(step)
        background = self.background if background is None else background
        return Save(step, dims, group.submit("save", self.store.root, step, background),
                    group.submit("digest") if dims.dp_replicate > 1 else [], background)

    def staged(self, group, save: Save, meta: dict) -> None:
        """`save`'s step has completed: commit it now (sync), or once written (background)."""
        t0 = time.perf_counter()  # what the workers wait for before their next step
        save.meta = meta
        done = group.wait(save.save_refs, f"saving checkpoint {save.step}", checkpoint=True)
        if save.background:  # what was waited for is the copy; the write goes on
            # one in flight: the previous save, when no queueing came between (the last two
            # steps of a run, both saved), is committed first, not dropped (found by the
            # sharded background test: checkpoint N-1 of an every-step run was left torn)
            self.drain(group)
            if all(done):  # sharded: each worker's local plan; DCP's second round, from here
                from baton.checkpoint import sharded  # torch.distributed.checkpoint: only now

                plans, save.finish = sharded.plan_globally(self.store.shards(save.step),
                                                           [d["plan"] for d in done])
                group.submit_each("write_planned", [(save.step, plan) for plan in plans])
            save.written_refs = group.submit("written", save.step)
            self.pending = save
        else:
            self._finish(group, save, [p for parts in done for p in parts])
        self.live.checkpoint_saved(time.perf_counter() - t0)

    def holds(self, step: int) -> bool:
        """Whether checkpoint `step` is committed, or being written in the background."""
        return self.last_step == step or (self.pending is not None and self.pending.step == step)

    def poll(self, group) -> None:
        """Commit the background save if every part of it is written (does not wait)."""
        if self.pending is not None and group.finished(self.pending.written_refs):
            self.drain(group)

    def _drain_before(self, group, step: int) -> None:
        """Commit the save in flight before queueing `step`'s. Saves asked for faster than the
        store writes them make training wait for each write (at most one is in flight): said
        once, with the wait, since no setting of the save itself can hide it (seen on an H200:
        1.37 GB every 0.46 s, about 3 s a write; docs/checkpoints.md)."""
        behind = self.pending
        if behind is None or self.outpaced or group.finished(behind.written_refs):
            self.drain(group)
            return
        t0 = time.perf_counter()
        self.drain(group)
        self.outpaced = True
        print(f"warning: checkpoint {step} came due while checkpoint {behind.step} was still being "
              f"written in the background, and training waited {time.perf_counter() - t0:.2f} s "
              "for that write (one is in flight at most): save less often "
              "(checkpoint.every_steps) or to a faster store", flush=True)

    def drain(self, group) -> None:
        """Wait for the background save in flight, and commit it."""
        save, self.pending = self.pending, None
        if save is None:
            return
        written = group.wait(save.written_refs, f"writing checkpoint {save.step}", checkpoint=True)
        if save.finish is None:
            self._finish(group, save, [p for parts in written for p in parts])
            return
        index = save.finish([results for results, _ in written])  # once every shard is written
        self._finish(group, save, [p for _, parts in written for p in parts] + index)

    def abandon(self) -> None:
        """A failure: the save in flight is never committed (its folder stays torn)."""
        self.pending = None

    def newest_whole(self, group) -> tuple[Optional[dict], list[tuple[int, str]]]:
        """The metadata of the newest committed checkpoint that is whole, and the newer ones
        that are not (step, what is wrong), each set aside (`CheckpointStore.reject`). The
        metadata and the parts' sizes are checked here; the checksums by the workers, each
        reading its share of the parts where it runs (`WorkerGroup.check_sums`), instead of
        the whole checkpoint through the driver (all of a model's state, and its moments,
        through one process and one network link)."""
        step, failed = self.store.latest_verified(
            lambda step, parts: group.check_sums(self.store.root, step, parts))
        for bad, why in failed:
            self.store.reject(bad, why)
        if failed:  # the best may have been one of them: looked for again at the next commit
            self.best_read = False
        return (None if step is None else self.store.read_meta(step)), failed

    def _finish(self, group, save: Save, parts: list[dict]) -> None:
        digests = group.wait(save.digest_refs, f"hashing parameters for checkpoint {save.step}")
        # an invariant of data parallelism, worth the milliseconds: the copies of each stage
        # (of each shard, when sharded) hold the same parameters
        for ranks in save.dims.replica_groups() if digests else ():
            replicas = [digests[r] for r in ranks]
            if len(set(replicas)) != 1:
                raise WorkerError(f"replicas of ranks {ranks} diverged at step {save.step}: "
                                  f"parameter digests {replicas}")
        self.replica_digests = digests
        self._commit(save.step, save.meta, parts)

    def commit_survivors(self, group, dims: ParallelDims, step: int, left: dict[int, int],
                         meta: dict) -> bool:
        """The in-memory copy of the last step: the replicas of a stage (of a shard of it, when
        sharded; of a tp share of its layers) hold the same state, so when every part of a
        replica (`ParallelDims.part_of`) has a survivor whose state is that of `step` (the
        last step the coordinator saw complete), that state is committed as checkpoint
        `step`, and the failure costs only the step that was running rather than everything
        since the last checkpoint. Under sharding that takes a second replica group
        (`shard_group`): plain `full` loses a shard with any worker; under tensor parallelism,
        a second replica (dp > 1). `left`: survivor rank -> the step of the state it kept.
        False: nothing committed."""
        if step <= (self.store.latest() or 0):
            return False
        writers: dict[tuple, int] = {}  # a part of the replica -> one survivor holding it
        for rank, done in left.items():
            if done == step:
                writers.setdefault(dims.part_of(rank), rank)
        if len(writers) < dims.parts:
            return False
        self._begin(step)
        parts = group.write_kept(sorted(writers.values()), self.store.root, step)
        if parts is None:
            return False
        self._commit(step, meta, parts)
        return True

    def _begin(self, step: int) -> None:
        if self.lease is not None:
            self.lease.check()
        self.store.begin(step)

    def _commit(self, step: int, meta: dict, parts: list[dict]) -> None:
        if self.lease is not None:
            self.lease.check()
        # Metrics first, then the marker: a crash between the two replays steps whose metrics
        # are already logged, and the tracker skips those; the other order could lose them.
        self.tracker.flush()
        best = self._best_with(step, meta)
        self.last = self.store.commit(step, meta, self.keep, parts, protect=[best[0]] if best else [])
        self.last_step = step
        self.tracker.set_tags({"checkpoint.latest": self.last})
        if best is not None and best != self.best_found:
            self.best_found = best
            self.tracker.set_tags({"checkpoint.best": self.store.step_dir(best[0]),
                                   "checkpoint.best_step": str(best[0])})

    def _best_with(self, step: int, meta: dict) -> Optional[tuple[int, float]]:
        """The best checkpoint by checkpoint.best once checkpoint `step` (`meta`) commits."""
        if self.best is None:
            return None
        metric, lowest = self.best
        if not self.best_read:  # a resumed run's checkpoints hold its best so far
            self.best_found, self.best_read = self.store.best(metric, lowest), True
        evaluated = meta.get("eval", {})
        value = evaluated.get(metric)
        if evaluated and value is None and not self.best_warned:  # a task of the user's
            self.best_warned = True
            print(f"baton: warning: checkpoint.best: {metric} is not among this run's held-out "
                  f"metrics ({', '.join(sorted(evaluated))}); only the newest checkpoints are kept",
                  flush=True)
        old = self.best_found
        if value is None or not math.isfinite(value) or (
                old is not None and not (value < old[1] if lowest else value > old[1])):
            return old
        return step, float(value)
