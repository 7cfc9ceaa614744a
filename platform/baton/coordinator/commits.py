"""Checkpoint commits, for the coordinator: it decides when; this writes them.

A checkpoint is queued behind the step it captures (the workers run calls in order, so the
save sees exactly the state after that step), then committed once every part is written and
the replicas are seen to agree: metadata first, the marker last (`CheckpointStore.commit`).
After a failure, the survivors' in-memory state of the last completed step may be committed
instead of training again from the last checkpoint.
"""

from __future__ import annotations

import time
from typing import Optional

from baton.checkpoint import CheckpointStore
from baton.checkpoint.lease import Lease
from baton.errors import WorkerError
from baton.parallel import ParallelDims


class Commits:
    def __init__(self, store: CheckpointStore, tracker, live, keep: int, lease: Optional[Lease] = None):
        self.store, self.tracker, self.live, self.keep = store, tracker, live, keep
        self.lease = lease  # held for the run (api.run): nothing is written without it
        self.last: Optional[str] = None  # where the newest checkpoint this run committed is
        self.replica_digests: list[str] = []  # each worker's parameter digest at that commit

    def queue(self, group, step: int) -> tuple[list, list]:
        """Start checkpoint `step`: a clean folder, and each worker's save and parameter digest
        queued behind the step in flight. Returns (save refs, digest refs) for `commit`."""
        self._begin(step)
        return group.submit("save", self.store.root, step), group.submit("digest")

    def commit(self, group, dims: ParallelDims, step: int, meta: dict, save_refs: list,
               digest_refs: list) -> None:
        t0 = time.perf_counter()  # the saves were queued behind the step just completed
        parts = [p for written in group.wait(save_refs, f"saving checkpoint {step}", checkpoint=True)
                 for p in written]
        digests = group.wait(digest_refs, f"hashing parameters for checkpoint {step}")
        # an invariant of data parallelism, worth the milliseconds: the copies of each stage
        # (of each shard, when sharded) hold the same parameters
        for ranks in dims.replica_groups():
            replicas = [digests[r] for r in ranks]
            if len(set(replicas)) != 1:
                raise WorkerError(f"replicas of ranks {ranks} diverged at step {step}: "
                                  f"parameter digests {replicas}")
        self.replica_digests = digests
        self._commit(step, meta, parts)
        self.live.checkpoint_saved(time.perf_counter() - t0)

    def commit_survivors(self, group, dims: ParallelDims, step: int, left: dict[int, int],
                         meta: dict) -> bool:
        """The in-memory copy of the last step: the replicas of a stage (of a shard of it, when
        sharded) hold the same state, so when every stage's every shard has a survivor whose
        state is that of `step` (the last step the coordinator saw complete), that state is
        committed as checkpoint `step`, and the failure costs only the step that was running
        rather than everything since the last checkpoint. Under sharding that takes a second
        replica group (`shard_group`): plain `full` loses a shard with any worker. `left`:
        survivor rank -> the step of the state it kept. False: nothing committed."""
        if step <= (self.store.latest() or 0):
            return False
        writers: dict[tuple[int, int], int] = {}  # (stage, shard) -> one survivor holding it
        for rank, done in left.items():
            if done == step:
                writers.setdefault((dims.coords(rank)[1], dims.shard_of(rank)), rank)
        if len(writers) < dims.pp * dims.dp_shard:
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
        self.last = self.store.commit(step, meta, self.keep, parts)
        self.tracker.set_tags({"checkpoint.latest": self.last})
