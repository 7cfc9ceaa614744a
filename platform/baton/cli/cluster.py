"""The `baton` commands that talk to a Ray cluster's job API (`baton.submit.Cluster`):
submit, status (a local job's from its status file first), logs, stop, list."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parsers(sub) -> None:
    """The commands that talk to a cluster's job API: submit, status, logs, stop, list."""
    def cluster_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--address", help="the head's dashboard, e.g. http://HEAD:8265 (default: "
                       "$RAY_API_SERVER_ADDRESS, then $RAY_ADDRESS)")
        p.add_argument("--token-file", help="Ray's auth token (default: $RAY_AUTH_TOKEN, "
                       "$RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token)")

    sm = sub.add_parser("submit", help="run a job on a remote Ray cluster (Ray's job API)")
    sm.add_argument("job", help="the job's YAML file, inside the folder to upload")
    cluster_args(sm)
    sm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a spec value (passed on to baton run)")
    sm.add_argument("--until", type=int, metavar="STEP",
                    help="stop at this step with a checkpoint (baton run --until); submit again to go on")
    sm.add_argument("--id", help="submission id (default: baton-JOBNAME-RANDOM)")
    sm.add_argument("--root", help="the folder to upload (default: the current one)")
    sm.add_argument("--exclude", action="append", default=[], metavar="PATTERN",
                    help="leave out files matching a .gitignore pattern (repeatable)")
    sm.add_argument("--include", action="append", default=[], metavar="PATTERN",
                    help="send credentials files matching this .gitignore pattern, which are "
                    "left out otherwise (.env, *.pem, *.key, id_rsa*, .netrc, .aws/, ...)")
    sm.add_argument("--max-upload-mb", type=float, default=100.0,
                    help="refuse a larger upload (default 100)")
    sm.add_argument("--storage", help="a folder every node mounts: the job's relative data, "
                    "checkpoint and MLflow paths live there, so a resubmission resumes")
    sm.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for the job (repeatable)")
    sm.add_argument("--no-wait", action="store_true", help="submit and return")
    sm.add_argument("--dry-run", action="store_true", help="show what would be sent; send nothing")

    for name, text in (("status", "a job's state: a local job's (its YAML file or name), else "
                                  "a submitted one's"),
                       ("logs", "a submitted job's output"), ("stop", "stop a submitted job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("id", help="the submission id" + (
            ", or a job's YAML file or name (its status.json beside its checkpoints)"
            if name == "status" else ""))
        cluster_args(p)
        if name == "status":
            p.add_argument("--checkpoint-path", help="where a job named by its name keeps its "
                           "checkpoints (default: checkpoints, under $BATON_STORAGE if set)")
        if name == "logs":
            p.add_argument("--follow", "-f", action="store_true", help="stream until the job ends")
    cluster_args(sub.add_parser("list", help="the cluster's jobs"))


def _cluster(args: argparse.Namespace):
    from baton.submit import Cluster

    cluster = Cluster(args.address, args.token_file)
    if cluster.warning:
        print(f"baton: warning: {cluster.warning}", file=sys.stderr)
    return cluster


def _submit(args: argparse.Namespace) -> int:
    from baton import submit
    from baton.spec import load_spec
    from baton.storage import redact

    spec = load_spec(args.job, args.set)  # a bad job file is refused before anything is sent
    env = dict(_key_value(item, "--env") for item in args.env)
    sub = submit.prepare(spec, args.job, args.set, root=args.root, excludes=tuple(args.exclude),
                         includes=tuple(args.include), max_upload_mb=args.max_upload_mb,
                         storage=args.storage, env=env, submission_id=args.id, until=args.until)
    try:
        for warning in sub.warnings:
            print(f"baton: note: {warning}", file=sys.stderr)
        pkg = sub.package
        print(f"package: {len(pkg.files)} files, {pkg.size_bytes / 2**20:.2f} MiB from {pkg.root}")
        if args.dry_run:
            print("\n".join(f"  {rel}" for rel in pkg.files))
            print(f"entrypoint: {redact(sub.entrypoint)}")
            print(f"runtime_env: {redact(json.dumps(sub.runtime_env))}")
            return 0
        cluster = _cluster(args)
        job_id = submit.submit(cluster, sub, spec, args.job)
    finally:
        sub.discard()  # the zip is uploaded (or was never to be)
    print(f"submitted {job_id} to {cluster.address}: {redact(sub.entrypoint)}")
    if args.no_wait:
        print(f"follow it with: baton logs {job_id} --follow")
        return 0
    return _follow(cluster, job_id)


def _follow(cluster, job_id: str) -> int:
    try:
        for chunk in cluster.follow(job_id):
            print(chunk, end="", flush=True)
    except KeyboardInterrupt:
        print(f"\nbaton: stopped following; {job_id} goes on (baton stop {job_id} stops it)",
              file=sys.stderr)
        return 130
    status = cluster.status(job_id)
    print(f"{job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def _status(args: argparse.Namespace) -> int:
    from baton import status
    from baton.errors import BatonError, ClusterError
    from baton.submit import resolve_address

    found = status.local(args.id, args.checkpoint_path)
    if found is not None:
        print("\n".join(status.describe(found)))
        return 0
    if status.is_job_file(args.id):  # a local job, not one to look for on a cluster
        raise BatonError(f"{args.id}: no status in {status.local_root(args.id)}: the job has "
                         "not started there yet")
    try:
        resolve_address(args.address)
    except ClusterError as e:
        raise ClusterError(f"no local job {args.id!r} (no status.json under "
                           f"{args.checkpoint_path or 'checkpoints'}/), and {e}") from None
    cluster = _cluster(args)
    info = cluster.info(args.id)
    print(f"{args.id}: {info.status.value}")
    if info.message:
        print(f"  {info.message.strip().splitlines()[-1]}")
    print(f"  entrypoint: {info.entrypoint}")
    if info.start_time:
        print(f"  started {_when(info.start_time)}, {_duration(info)}")
    coordinator = status.from_logs(cluster.logs(args.id))
    if coordinator is not None:
        print("  coordinator, as of its last status line:")
        print("\n".join("    " + line for line in status.describe(coordinator)))
    return 0


def _logs(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    if args.follow:
        return _follow(cluster, args.id)
    print(cluster.logs(args.id), end="")
    return 0


def _stop(args: argparse.Namespace) -> int:
    cluster = _cluster(args)
    stopped = cluster.stop(args.id)
    print(f"{args.id}: {'stopping' if stopped else 'not running (' + cluster.status(args.id) + ')'}")
    return 0


def _list(args: argparse.Namespace) -> int:
    """The cluster's jobs, and of each running one what its coordinator last said (its
    state, step and world, or its place in line: `baton.status.brief`)."""
    from baton import status

    cluster = _cluster(args)
    jobs = sorted(cluster.list(), key=lambda j: j.start_time or 0)
    rows = [("ID", "STATUS", "JOB", "STARTED", "DURATION", "STATE")]
    for j in jobs:
        meta, job_id = j.metadata or {}, j.submission_id or j.job_id or "-"
        said = status.from_logs(cluster.logs(job_id)) if j.status.value == "RUNNING" else None
        rows.append((job_id, j.status.value, meta.get("baton.job", j.entrypoint[:40]),
                     _when(j.start_time) if j.start_time else "-", _duration(j),
                     status.brief(said) if said else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def _duration(job) -> str:
    if not job.start_time:
        return "-"
    end = job.end_time or time.time() * 1000
    return f"{(end - job.start_time) / 1000:.0f} s"


def _key_value(item: str, flag: str) -> tuple[str, str]:
    from baton.errors import BatonError

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise BatonError(f"{flag} {item!r} must look like KEY=VALUE")
    return key, value


COMMANDS = {"submit": _submit, "status": _status, "logs": _logs, "stop": _stop, "list": _list}
