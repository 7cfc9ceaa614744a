"""The worker group: dp x pp Ray actors in one placement group, joined in one torch.distributed
group. Every call fans out to all ranks and waits with a timeout, so a lost or stuck worker
surfaces as a `WorkerError` rather than a hang."""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from baton.errors import WorkerError
from baton.parallel import ParallelDims
from baton.spec import JobSpec
from baton.workers.worker import Worker

RemoteWorker = ray.remote(Worker)


class WorkerGroup:
    def __init__(self, spec: JobSpec, dims: ParallelDims):
        self.spec, self.dims = spec, dims
        self.timeout_s = spec.parallel.timeout_s
        self.actors: list = []
        self.pg = None

    def place(self) -> None:
        """Reserve the workers' resources and start the actors (no process group yet)."""
        r = self.spec.resources
        bundle = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker else {})}
        self.pg = placement_group([bundle] * self.dims.world_size, strategy=r.placement.upper())
        try:
            ray.get(self.pg.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(
                f"could not place {self.dims.world_size} workers of {bundle} within "
                f"{self.timeout_s:g} s (parallel.timeout_s); the cluster has "
                f"{ray.available_resources()} free") from None
        self.actors = [
            RemoteWorker.options(
                num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank),
            ).remote(self.spec, self.dims, rank)
            for rank in range(self.dims.world_size)]

    def setup(self, table_ref: Any, record_samples: bool, stage_layers) -> list[dict]:
        """Form the process group and build each worker's part of the model."""
        master = self.call_one(0, "rendezvous_address")
        return self.call("setup", master, table_ref, record_samples, stage_layers,
                         what="joining the group")

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        return self.wait([getattr(self.actors[rank], method).remote(*args)], method)[0]

    def submit(self, method: str, *args: Any) -> list:
        """Queue `method(*args)` on every rank without waiting; actors run calls in order."""
        return [getattr(a, method).remote(*args) for a in self.actors]

    def call(self, method: str, *args: Any, what: str = "") -> list:
        """Call `method(*args)` on every rank; results in rank order."""
        return self.wait(self.submit(method, *args), what or method)

    def wait(self, refs: list, what: str) -> list:
        try:
            # the collective timeout plus a margin: a stuck peer fails inside the group first
            return ray.get(refs, timeout=self.timeout_s + 30)
        except ray.exceptions.RayTaskError as e:
            rank = next((i for i, r in enumerate(refs) if _failed(r)), "?")
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise WorkerError(f"worker rank {rank} failed while {what}: "
                              f"{type(cause).__name__}: {str(cause).splitlines()[0][:300]}") from e
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"workers did not finish {what} within {self.timeout_s + 30:g} s "
                              "(parallel.timeout_s + 30)") from None
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"a worker died while {what}: {str(e).splitlines()[0][:300]}") from e

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None


def _failed(ref) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return False
    try:
        ray.get(ref)
        return False
    except Exception:
        return True
