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


def quota_left(me: Entry, entries: list[Entry], quotas: dict[str, dict]) -> Optional[int]:
    """Workers of `me`'s size that the quota it counts against leaves it, its own included:
    the quota's CPUs and GPUs less what the other jobs counting against it hold (their worlds,
    and the workers they are starting). None: no quota (none named, or none set)."""
    q = quotas.get(me.quota) if me.quota else None
    if q is None:
        return None
    others = [e for e in entries if e.key != me.key and e.quota == me.quota]
    held = [(e.dp * e.per_replica + e.starting) for e in others]
    cpus = None if q.get("CPU") is None else q["CPU"] - sum(n * e.cpus for n, e in zip(held, others))
    gpus = None if q.get("GPU") is None else q["GPU"] - sum(n * e.gpus for n, e in zip(held, others))
    return _fit_within(me, cpus, gpus)


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


def quota_use() -> dict[str, list[Entry]]:
    """The jobs of the cluster's list by the quota they count against."""
    out: dict[str, list[Entry]] = {}
    for e in read_list()[0]:
        if e.quota:
            out.setdefault(e.quota, []).append(e)
    return out
