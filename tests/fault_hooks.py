"""Ray `worker_process_setup_hook`s for the fault tests and benchmarks: faults injected by the
test, not hooks in baton.

A setup hook runs in every process of the cluster's job, Ray Data's read workers included, so
this module imports nothing heavy: `helpers` brings torch and baton's models (3.5 s of CPU a
process on a slow 2-core machine, on the way to every read a run makes through Ray Data).
"""

from __future__ import annotations

import time


def pause_between_checkpoint_parts() -> None:
    """In each worker process, every model part of a checkpoint is followed by a 0.5 s pause,
    so that a test can kill a worker while its checkpoint is half written."""
    from baton.checkpoint import store

    write = store.CheckpointStore.write_tensors

    def write_then_pause(self, step, name, obj):
        record = write(self, step, name, obj)
        if name.startswith("model-"):
            time.sleep(0.5)
        return record
    store.CheckpointStore.write_tensors = write_then_pause
