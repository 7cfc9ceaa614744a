"""A job's status: the coordinator writes it (`StatusBoard`: status.json beside the
checkpoints, and a log line under Ray's job API); `baton status` reads it, from status.json (a
local run, or shared storage) or from the last status line in a submitted job's log."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from baton.checkpoint import CheckpointStore
from baton.spec import CheckpointSpec, join_path
from baton.tracking.metrics import MEMORY_LABEL

STATUS_LINE = "baton-status: "  # what the coordinator prints under Ray's job API
EVERY_S = 5.0  # how often a running job's status.json is rewritten between events
LOG_EVERY_S = 30.0  # and its log line, between changes of state
# set by Ray's job supervisor for a submitted job's entrypoint: there the status also goes to
# the log, where `baton status ID` reads it through the job API
UNDER_JOB_API = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ


class StatusBoard:
    """Where a running job's coordinator publishes its status: status.json beside the
    checkpoints, at each change of state and every EVERY_S; under the job API also a log line,
    at each change and every LOG_EVERY_S. Best effort: a status that cannot be written never
    stops training."""

    def __init__(self, store: CheckpointStore):
        self.store = store
        self.at = self.logged_at = 0.0

    def due(self) -> bool:
        return time.monotonic() - self.at >= EVERY_S

    def publish(self, status: dict, changed: bool) -> None:
        now = self.at = time.monotonic()
        try:
            self.store.write_status(status)
        except OSError:
            pass
        if UNDER_JOB_API and (changed or now - self.logged_at >= LOG_EVERY_S):
            self.logged_at = now
            print(f"{STATUS_LINE}{json.dumps(status)}", flush=True)


def is_job_file(target: str) -> bool:
    return target.endswith((".yaml", ".yml")) and os.path.isfile(target)


def local_root(target: str, checkpoint_path: Optional[str] = None) -> Optional[str]:
    """The checkpoint folder of a job given by its YAML file or its name (under
    `checkpoint_path`, the spec's default `checkpoints` otherwise); None for neither."""
    if is_job_file(target):
        from baton.spec import load_spec

        return load_spec(target).checkpoint_dir
    if "/" in target or target.startswith("."):
        return None
    return join_path(checkpoint_path or CheckpointSpec.path, target)


def local(target: str, checkpoint_path: Optional[str] = None) -> Optional[dict]:
    """The status of a local job (see `local_root`), or None when there is none."""
    root = local_root(target, checkpoint_path)
    return None if root is None else CheckpointStore(root).read_status()


def from_logs(text: str) -> Optional[dict]:
    for line in reversed(text.splitlines()):
        if line.startswith(STATUS_LINE):
            try:
                return json.loads(line[len(STATUS_LINE):])
            except ValueError:
                return None
    return None


def describe(s: dict) -> list[str]:
    """The lines `baton status` prints."""
    ago = time.time() - s["updated_at"]
    where = f"pid {s['pid']} on {s['host']}"
    lines = [f"{s['job']}: {state_of(s)} (updated {_ago(ago)} ago, {where})"]
    loss = f", loss {s['loss']:.4f}" if s.get("loss") is not None else ""
    tps = f", {s['tokens_per_s']:,.0f} {s.get('unit', 'tokens')}/s" if s.get("tokens_per_s") else ""
    lines.append(f"  step {s['step']}/{s['steps']}{loss}{tps}")
    starting, spares = s.get("workers_starting", 0), s.get("spares", 0)  # absent from older files
    tp = "".join(f" x {k} {s[k]}" for k in ("tp", "cp") if s.get(k, 1) > 1)
    lines.append(f"  world: dp {s['dp']} x pp {s['pp']}{tp} = {s['world_size']} "
                 f"worker{'s' * (s['world_size'] != 1)}, "
                 f"{s['workers_alive']} alive"
                 + (f"; {starting} more starting, to grow into" if starting else "")
                 + (f"; {spares} spare{'s' * (spares > 1)}" if spares else ""))
    held = s.get("memory_mib") or {}  # absent from older status files
    if held:
        lines.append("  memory of the largest worker: " + ", ".join(
            f"{what} {held[kind]:,} MiB" for kind, what in MEMORY_LABEL.items() if kind in held))
    lag = s.get("straggler")  # only while one lags
    if lag:
        lines.append(f"  straggler: rank {lag['rank']} (node {str(lag['node'])[:12]}, pid {lag['pid']}) "
                     f"computes {lag['ratio']:.1f}x as long as its peers "
                     f"({lag['compute_s']:.3f} s a step against {lag['peers_s']:.3f} s)")
    skipped = s.get("skipped_steps")  # train.skip_nonfinite's, in this run
    if skipped:
        shown = ", ".join(map(str, skipped[-5:]))
        lines.append(f"  updates skipped (gradient not finite): {len(skipped)}, at step"
                     f"{'s' * (len(skipped) > 1)} {'..., ' * (len(skipped) > 5)}{shown}")
    if s.get("skipped_row_groups"):  # data.skip_bad_row_groups's, in this run
        lines.append(f"  row groups skipped for bad rows: {s['skipped_row_groups']}")
    spikes = s.get("spikes")  # train.rewind_on_spike's, in this run
    if spikes:
        lines.append(f"  loss spikes rewound from: {len(spikes)}, at step"
                     f"{'s' * (len(spikes) > 1)} {'..., ' * (len(spikes) > 5)}"
                     f"{', '.join(map(str, spikes[-5:]))}")
    lines.append(f"  last checkpoint: {s['last_checkpoint'] or 'none yet'}")
    best = s.get("best_checkpoint")  # checkpoint.best's, once one is kept
    if best:
        lines.append("  best checkpoint: step " + ", ".join(
            [str(best["step"]), *(f"{k} {v:.4g}" for k, v in best.items() if k != "step")]))
    stop = s.get("stopped_early")  # eval.patience, once it ended the run
    if stop:
        lines.append(f"  stopped early at step {stop['step']}: {stop['why']}")
    # the ceiling's: baton scale's, a job of higher priority's ("priority: NAME"), or that of
    # a job ahead in line taking back room it lent ("line: NAME")
    by = s.get("max_dp_by", "baton scale")
    lent, job = by.startswith("line: "), None if by == "baton scale" else by.partition(": ")[2]
    if s["state"] == "suspended" and "max_dp" not in s:  # held no more: in line
        lines.append(f"  suspended at step {s['step']}: it goes on from there when its turn in line comes")
    elif s["state"] == "suspended":  # its workers given to a job of higher priority, or back
        lines.append(f"  suspended at step {s['step']}: " + (
            f"its workers given back to job {job}, ahead of it in line; it goes on from there "
            "when its turn comes" if lent else
            f"its workers given to job {job}, of higher priority; it goes on from there once "
            "that job ends" if job else "baton scale --max-dp 0; --clear goes on from there"))
    elif s.get("max_dp"):
        lines.append(f"  at most {s['max_dp']} replica{'s' * (s['max_dp'] > 1)} " + (
            f"(room given back to job {job}, ahead of it in line, until it has started)" if lent else
            f"(room given to job {job}, of higher priority, while it runs)" if job else
            "(baton scale; --clear lifts it)"))
    if s.get("lent_by"):  # started out of turn on room jobs ahead of it in line cannot use yet
        lenders = s["lent_by"]
        lines.append(f"  out of turn: on room lent by {', '.join(lenders)} (ahead of it in line), "
                     f"given back when {'it' if len(lenders) == 1 else 'one of them'} can start")
    if s.get("room_from"):  # the claims this job holds on jobs of lower priority
        lines.append("  room taken from: " + ", ".join(
            f"{name} ({f'at most {at} replica' + 's' * (at > 1) if at else 'suspended'})"
            for name, at in s["room_from"].items()))
    quota = s.get("quota_wait")  # waiting for its quota (resources.quota), out of the line
    if quota:
        lines.append("  waiting for room within " + quota_held(quota["quota"], quota["room"], quota["held_by"]))
    line = s.get("in_line")  # waiting for room other jobs hold (queued, or suspended)
    if line:
        lines.append(f"  in line for room for {_ago(time.time() - line['since'])}: "
                     + place_in_line(line["ahead"], line["room_held_by"]))
    if s["state"] == "paused":  # baton run --until
        lines.append(f"  paused at step {s['step']} of {s['steps']}: run the job again to go on")
    causes = ", ".join(f"{k} {v}" for k, v in sorted(s["failures_by_cause"].items()))
    lines.append(f"  failures: {s['failures']}" + (f" ({causes})" if causes else "")
                 + f"; rescales: {s['rescales']}")
    if s.get("mlflow_run_id"):
        degraded = s.get("tracking", "ok") != "ok"  # absent from older status files
        lines.append(f"  MLflow run: {s['mlflow_run_id']}"
                     + (f" (tracking {s['tracking']})" if degraded else ""))
    if s.get("error"):
        lines.append(f"  error: {s['error'].splitlines()[0]}")
    return lines


def state_of(s: dict) -> str:
    """A status's state, and whether its process is gone where it says it is still at work
    (a run on this machine killed outright)."""
    state = s["state"]
    if state not in ("finished", "paused", "failed") and s["host"] == socket.gethostname() \
            and not _alive(s["pid"]):
        state += f" when last seen: its process (pid {s['pid']} on {s['host']}) is gone"
    return state


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def brief(s: dict) -> str:
    """A status in a few words, for `baton list`: `running, step 120/600, dp 2`, `queued, 2nd
    in line`, `suspended at step 106`; `..., out of turn` on room lent by jobs in line."""
    state, line = s["state"], s.get("in_line")
    if state == "queued" and s.get("quota_wait"):
        return f"queued, waiting for quota {s['quota_wait']['quota']}"
    if state == "queued" and line:
        return f"queued, {_nth(len(line['ahead']) + 1)} in line"
    if state in ("suspended", "paused"):
        return f"{state} at step {s['step']}"
    return f"{state}, step {s['step']}/{s['steps']}" + (f", dp {s['dp']}" if state == "running" else "") \
        + (", out of turn" if s.get("lent_by") else "")


def quota_held(name: str, room: Optional[dict], held_by: list[str]) -> str:
    """`quota team (1 CPU, 2 GPU): held by a, b`."""
    sizes = ", ".join(f"{n:g} {kind}" for kind, n in (room or {}).items() if n is not None)
    return f"quota {name}" + (f" ({sizes})" if sizes else "") + (
        f": held by {', '.join(held_by)}" if held_by else "")


def place_in_line(ahead: list[str], holders: list[str]) -> str:
    """A waiting job's place: `first; held by a` or `3rd, behind c, b; held by a`."""
    return (f"{_nth(len(ahead) + 1)}, behind {', '.join(ahead)}" if ahead else "first") + \
        (f"; held by {', '.join(holders)}" if holders else "")


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _ago(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds} s" if seconds < 120 else f"{seconds // 60} min"

