"""Quotas (`baton quota NAME --cpus N --gpus M`, `resources.quota: NAME`): the CPUs and GPUs
the workers of every job naming a quota may hold together on one cluster. Kept in the
cluster's key-value store beside its list of jobs (`priorities.py`), as `quota/<name>`; a
job's entry names its quota and says when it waits for it (`Entry.over_quota`: out of the
line meanwhile, its place kept). A job starts and grows only within what its quota leaves it
(`quota_left`), decided under the list's lock (`Priorities.turn`, `Priorities.claiming`)."""

from __future__ import annotations

import json
import math
from typing import Optional

from baton.coordinator.priorities import NAMESPACE, Entry, _delete, _keys, _put, read_list


def _fit_within(me: Entry, cpus: Optional[float], gpus: Optional[float]) -> Optional[int]:
    """How many of `me`'s workers `cpus` and `gpus` hold, either None for no bound (both
    None: None)."""
    counts = [math.floor((cpus + 1e-9) / me.cpus)] if cpus is not None and me.cpus else []
    counts += [math.floor((gpus + 1e-9) / me.gpus)] if gpus is not None and me.gpus else []
    return max(0, min(counts)) if counts else None


def held(entries: list[Entry]) -> dict[str, float]:
    """The CPUs and GPUs `entries` hold: their worlds, and the workers they are starting."""
    return {"CPU": sum((e.dp * e.per_replica + e.starting) * e.cpus for e in entries),
            "GPU": sum((e.dp * e.per_replica + e.starting) * e.gpus for e in entries)}


def quota_left(me: Entry, entries: list[Entry], quotas: dict[str, dict]) -> Optional[int]:
    """Workers of `me`'s size that the quota it counts against leaves it, its own included:
    the quota's CPUs and GPUs less what the other jobs counting against it hold (`held`).
    None: no quota (none named, or none set)."""
    q = quotas.get(me.quota) if me.quota else None
    if q is None:
        return None
    taken = held([e for e in entries if e.key != me.key and e.quota == me.quota])
    left = {kind: None if q.get(kind) is None else q[kind] - taken[kind] for kind in ("CPU", "GPU")}
    return _fit_within(me, left["CPU"], left["GPU"])


def quota_holders(me: Entry, entries: list[Entry]) -> list[str]:
    """The other jobs counting against `me`'s quota that hold workers."""
    return [e.name for e in entries if e.key != me.key and me.quota and e.quota == me.quota
            and (e.dp or e.starting)]


def read_quotas() -> dict[str, dict]:
    """The quotas set on the cluster (`baton quota`): name -> {"CPU": n or None, "GPU": n or
    None} (None: no bound on that resource)."""
    from ray.experimental.internal_kv import _internal_kv_get

    out = {}
    for key in _keys("quota/"):
        try:
            q = json.loads(_internal_kv_get(key, namespace=NAMESPACE))
            out[key.split("/", 1)[1]] = {k: None if q.get(k) is None else float(q[k]) for k in ("CPU", "GPU")}
        except (TypeError, ValueError, AttributeError):
            continue
    return out


def set_quota(name: str, cpus: Optional[float] = None, gpus: Optional[float] = None) -> None:
    """Set quota `name` on the connected cluster: the CPUs and GPUs the workers of every job
    naming it (resources.quota) may hold together (None: no bound on that one)."""
    _put(f"quota/{name}", {"CPU": cpus, "GPU": gpus})


def clear_quota(name: str) -> None:
    _delete(f"quota/{name}")


def report() -> dict[str, dict]:
    """Every quota with its use (`baton quota`): name -> {"CPU", "GPU" (None: no bound),
    "held": what its jobs hold, "jobs": [(name, state)] by name}."""
    by_quota: dict[str, list[Entry]] = {}
    for e in read_list()[0]:
        if e.quota:
            by_quota.setdefault(e.quota, []).append(e)
    out = {}
    for name, q in sorted(read_quotas().items()):
        jobs = sorted(by_quota.get(name, []), key=lambda e: e.name)
        out[name] = {**q, "held": held(jobs), "jobs": [
            (e.name, "running" if e.dp else "starting" if e.starting else
             "waiting for the quota" if e.over_quota else "in line") for e in jobs]}
    return out
