"""Room on the cluster for a job's workers: asking Ray's autoscaler for it, and waiting for it
at the start when the cluster has too little now (scaled to zero, as the shipped
`k8s/raycluster.yaml` is when idle: a head with no CPUs and `minReplicas: 0`)."""

from __future__ import annotations

import json
import re
import time
from typing import Callable

import ray

from baton.errors import SpecError
from baton.spec import JobSpec
from baton.spec_checks import check_fits

POLL_S = 1.0  # how often the start looks at the cluster's resources while it waits


def fit_or_wait(spec: JobSpec, source: str, where: str, log: Callable[[str], None]) -> None:
    """Refuse a job the cluster cannot place, as `check_fits` does; but where an autoscaler
    runs, first ask it for the job's smallest world and wait up to
    `resources.wait_for_nodes_s` for the nodes (a fixed cluster is refused at once: nothing
    will come). The request is withdrawn when the wait ends; the workers' own pending
    placement, and an elastic job's standing request, keep the nodes wanted from then on."""
    try:
        _check(spec, source, where)
        return
    except SpecError:
        wait_s = spec.resources.wait_for_nodes_s
        if wait_s <= 0 or not autoscaler_present():
            raise
    r = spec.resources
    workers = spec.dp_range[0] * spec.per_replica
    bundle = {"CPU": r.cpus_per_worker, **({"GPU": r.gpus_per_worker} if r.gpus_per_worker else {})}
    log(f"{where} has too little room for {workers} worker{'s' * (workers != 1)} now; its autoscaler is asked for "
        f"them, waiting up to {wait_s:g} s (resources.wait_for_nodes_s)")
    requester, t0 = f"baton:{spec.name}:start", time.monotonic()
    ask_autoscaler(requester, [bundle] * workers)
    try:
        while True:
            time.sleep(POLL_S)
            try:
                _check(spec, source, where)
            except SpecError as e:
                if time.monotonic() - t0 >= wait_s:
                    raise SpecError(f"{e} (after waiting {wait_s:g} s for its autoscaler: "
                                    "resources.wait_for_nodes_s)") from None
                continue
            log(f"{where} has room for them after {time.monotonic() - t0:.0f} s")
            return
    finally:
        ask_autoscaler(requester, [])


def _check(spec: JobSpec, source: str, where: str) -> None:
    res = ray.cluster_resources()
    check_fits(spec, res.get("CPU", 0), res.get("GPU", 0), source, where)


def autoscaler_present() -> bool:
    """Whether the connected cluster runs an autoscaler that can add nodes. Every Ray head runs
    the (v1) monitor and writes its status to the GCS's key-value store; on a fixed cluster its
    provider is read-only and names each node's type after the node (`node_<id>`), where a
    real one (the fake multi-node provider, KubeRay's, `ray up`'s) names the types of its
    configuration. The v2 autoscaler marks itself there when it starts."""
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    if raw:
        report = json.loads(raw).get("autoscaler_report") or {}
        types = {*(report.get("active_nodes") or {}), *(report.get("pending_launches") or {}),
                 *(node[1] for node in report.get("pending_nodes") or [])}
        if any(not READ_ONLY_TYPE.fullmatch(str(t)) for t in types):
            return True
    try:
        from ray.autoscaler.v2.utils import is_autoscaler_v2

        return is_autoscaler_v2(fetch_from_server=True)
    except Exception:  # noqa: BLE001 - another Ray's layout: no v2 marker to read
        return False


READ_ONLY_TYPE = re.compile(r"node_[0-9a-f]{56}")  # a fixed cluster's node, typed by its id


REQUEST_TTL_S = 600.0  # a standing autoscaler request lapses unless renewed within this


def ask_autoscaler(requester: str, bundles: list[dict]) -> None:
    """Set `requester`'s standing request to `bundles` (none: withdraw it).

    Ray's `request_resources` replaces the cluster's one standing request, and Ray Data keeps
    its own through a named coordinator actor that re-sends the merged requests of its
    requesters every 20 s: once baton's data read has run, a plain `request_resources` from
    baton would be undone within 20 s, before a cloud node has even booted. So baton asks
    through that coordinator, as one more requester, and both requests stand. A Ray without
    it (other versions) gets the plain call."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            DefaultAutoscalingCoordinator)
    except ImportError:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=bundles)
        return
    client = DefaultAutoscalingCoordinator(requester)
    if bundles:
        client.request_resources(bundles, expire_after_s=REQUEST_TTL_S)
    else:
        client.cancel_request()
