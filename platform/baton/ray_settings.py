"""The Ray settings baton's clusters run with: the embedded Ray's (`api.start_local_ray`), the
rendered KubeRay manifests' (as `RAY_<name>` variables on every pod, which each Ray process
reads at start) and the simulated clusters' of the tests and benchmarks.

- `kill_worker_timeout_milliseconds`: a raylet that destroys a worker (`ray.kill`) sends it
  SIGTERM and SIGKILL only this long after. Ray 2.60's 5 s held a frozen worker's peers in
  their collective 5 s after the coordinator killed it (measured: a SIGSTOPped actor gone
  5.01 s after `ray.kill` by default, 1.01 s with 1000). A worker that answers dies at once
  either way (its core worker exits on the kill request); a baton worker has nothing to
  finish on SIGTERM (a checkpoint commits only once whole, and a half-written one is never
  loaded).
- `num_workers_soft_limit`: how many idle task workers a raylet keeps instead of ending them
  (Ray's default: the node's CPU count). baton reads its data with Ray Data tasks that ask
  for no CPU, across the nodes, the head included, which is started with no CPUs (`k8s/`,
  the simulated clusters): Ray then ended a read worker there a second after each read (when
  every read ran on the driver's node, as they did until data.read: spread), and the next block's
  read started a new process (Ray Data's imports, seconds of CPU). Where a new epoch's first
  block waited for it, the step did: steps of 2.0-3.5 s among steps of 0.05-0.6 s on the
  simulated cluster (`benchmarks/chaos.py`'s 5-step epochs), none above 1.2 s with 4 kept,
  one for each read that may run at once (`data.feed.READ_CONCURRENCY`).
"""

from __future__ import annotations

SYSTEM_CONFIG = {"kill_worker_timeout_milliseconds": 1000, "num_workers_soft_limit": 4}


def ray_env() -> dict[str, str]:
    """The settings as the environment variables a Ray process reads them from."""
    return {f"RAY_{name}": str(value) for name, value in SYSTEM_CONFIG.items()}
