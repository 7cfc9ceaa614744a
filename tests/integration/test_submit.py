"""`baton submit | status | logs | stop | list` against a real Ray head that this module starts
on 127.0.0.1 (`ray start --head --block` with its own temp dir, ports and token, in its own
session) and stops by that session's process ids. Ray's own `ray job submit` runs the entrypoint
baton generates, to show the cluster needs nothing but baton installed."""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from baton import submit
from baton.cli import main
from baton.spec import load_spec
from helpers import free_ports, stop_session

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# the quick-start job, made small: a few seconds of training once the workers are up
SMALL = ["model.layers=1", "model.width=32", "model.heads=2", "model.seq_len=32",
         "data.path=data/stdlib-32", "train.global_batch=8", "train.micro_batch=4",
         "checkpoint.every_steps=3"]
pytestmark = pytest.mark.slow


@dataclass
class Head:
    address: str
    token: str
    root: Path
    log: Path


@pytest.fixture(scope="module")
def head():
    root = Path(tempfile.mkdtemp(prefix="bh-", dir="/tmp"))  # short: Ray's socket paths
    (root / "home").mkdir()
    token = secrets.token_hex(16)
    gcs, dashboard, client, agent, agent_grpc, runtime_env, metrics = free_ports(7)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token,
           "HOME": str(root / "home"), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    log = root / "head.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
             f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
             "--num-cpus=2", f"--temp-dir={root / 'ray'}", "--disable-usage-stats"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    address = f"http://127.0.0.1:{dashboard}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
            try:
                r = requests.get(f"{address}/api/jobs/", timeout=2,
                                 headers={"Authorization": f"Bearer {token}"})
                if r.status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.time() < deadline, f"no job server after 120 s: {log.read_text()[-3000:]}"
            time.sleep(1)
        yield Head(address, token, root, log)
    finally:
        stop_session(proc)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def as_user(head, monkeypatch):
    """The submitter's environment: the cluster's address and token, the repo as project."""
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", head.address)
    monkeypatch.setenv("RAY_AUTH_TOKEN", head.token)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.chdir(REPO)
    return head


def _baton(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _wait_status(head: Head, job_id: str, wanted: set[str], timeout_s: float = 180) -> str:
    cluster = submit.Cluster(head.address)
    deadline = time.time() + timeout_s
    while (status := cluster.status(job_id)) not in wanted:
        assert time.time() < deadline, f"{job_id} still {status}: {cluster.logs(job_id)[-2000:]}"
        time.sleep(1)
    return status


def test_bad_addresses_and_tokens_fail_in_one_line(as_user, capsys, monkeypatch, tmp_path):
    [closed] = free_ports(1)
    code, out, err = _baton(capsys, "list", "--address", f"http://127.0.0.1:{closed}")
    assert (code, err) == (2, f"baton: error: cannot reach a Ray job server at http://127.0.0.1:"
                              f"{closed}: is the head running, and the port forwarded?\n"), out
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-token")
    code, out, err = _baton(capsys, "list")
    assert code == 2 and err == (f"baton: error: the cluster at {as_user.address} refused the "
                                 "token from $RAY_AUTH_TOKEN\n")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    code, out, err = _baton(capsys, "status", "whatever")
    assert code == 2 and err.startswith(f"baton: error: the cluster at {as_user.address} requires "
                                        "a token and none was found")
    token_file = tmp_path / "token"
    token_file.write_text(as_user.token + "\n")
    code, out, err = _baton(capsys, "status", "nope", "--token-file", str(token_file))
    assert code == 2 and err == f"baton: error: no job 'nope' on the cluster at {as_user.address}\n"


def test_submit_the_quickstart_job_and_follow_it_to_succeeded(as_user, capsys, tmp_path):
    store = tmp_path / "store"
    sets = [a for s in ["train.steps=6", *SMALL] for a in ("--set", s)]
    code, out, err = _baton(capsys, "submit", "jobs/quickstart.yaml", "--id", "qs-1",
                            "--storage", str(store), *sets)
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("package: ") and "MiB from " + str(REPO) in lines[0]
    assert lines[1] == (f"submitted qs-1 to {as_user.address}: baton run jobs/quickstart.yaml "
                        + " ".join(sets))
    # the entrypoint joined this cluster (Ray sets $RAY_ADDRESS for it); it started no Ray of its own
    assert any(line.startswith("joining the Ray cluster at ") and line.endswith("($RAY_ADDRESS)")
               for line in lines), out
    assert any(line.startswith("quickstart: finished at step 6, loss ") for line in lines)
    assert lines[-1] == "qs-1: SUCCEEDED"
    # relative paths went to --storage: a resubmission would resume from there
    assert (store / "checkpoints" / "quickstart").is_dir() and (store / "mlflow.db").is_file()
    assert (store / "data" / "stdlib-32").is_dir()

    code, out, _ = _baton(capsys, "status", "qs-1")
    assert code == 0 and out.splitlines()[0] == "qs-1: SUCCEEDED"
    assert "  entrypoint: baton run jobs/quickstart.yaml --set train.steps=6" in out
    code, out, _ = _baton(capsys, "logs", "qs-1")
    assert code == 0 and "quickstart: finished at step 6" in out
    code, out, err = _baton(capsys, "submit", "jobs/quickstart.yaml", "--id", "qs-1", "--no-wait")
    assert code == 2 and err.endswith(f"a job with submission id 'qs-1' already exists on the "
                                      f"cluster at {as_user.address}; choose another --id\n")


def test_ray_job_submit_runs_the_entrypoint_baton_generates(as_user, tmp_path):
    spec = load_spec(REPO / "jobs" / "quickstart.yaml", ["train.steps=3", *SMALL])
    sub = submit.prepare(spec, "jobs/quickstart.yaml", ["train.steps=3", *SMALL],
                         storage=str(tmp_path / "store"), submission_id="by-ray-cli",
                         out_dir=tmp_path)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": as_user.token}
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", as_user.address, "--submission-id",
         sub.submission_id, "--runtime-env-json", json.dumps(sub.runtime_env), "--",
         *shlex.split(sub.entrypoint)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _driver_logs(as_user)
    assert "quickstart: finished at step 3" in proc.stdout
    assert submit.Cluster(as_user.address).status("by-ray-cli") == "SUCCEEDED"


def _driver_logs(head: Head, chars: int = 2000) -> str:
    """The ends of the Ray core logs of this head's drivers, newest last: what a driver that
    exited without a word (seen once, 2026-11-29: exit 1 after its last status line) logged
    before it went; the head's folder goes with the module."""
    logs = sorted((head.root / "ray").glob("session_*/logs/python-core-driver-*.log"),
                  key=lambda f: f.stat().st_mtime)[-3:]
    return "".join(f"\n--- {f.name}\n{f.read_text(errors='replace')[-chars:]}" for f in logs)


def test_a_long_job_is_stopped_and_listed(as_user, capsys, tmp_path):
    code, out, err = _baton(capsys, "submit", "jobs/quickstart.yaml", "--id", "long-1",
                            "--no-wait", "--storage", str(tmp_path / "store"),
                            "--set", "train.steps=100000", *[a for s in SMALL for a in ("--set", s)])
    assert code == 0, err
    assert out.splitlines()[-1] == "follow it with: baton logs long-1 --follow"
    cluster = submit.Cluster(as_user.address)
    deadline = time.time() + 180
    while "baton-status: " not in cluster.logs("long-1"):  # its coordinator has said where it is
        assert cluster.status("long-1") in ("PENDING", "RUNNING") and time.time() < deadline
        time.sleep(1)
    code, out, _ = _baton(capsys, "list")
    [row] = [line for line in out.splitlines() if line.startswith("long-1 ")]
    assert out.splitlines()[0].split() == ["ID", "STATUS", "JOB", "STARTED", "DURATION", "STATE"]
    assert re.search(r"  (scheduling|running), step \d+/100000", row), row
    code, out, _ = _baton(capsys, "stop", "long-1")
    assert code == 0 and out == "long-1: stopping\n"
    assert _wait_status(as_user, "long-1", {"STOPPED", "FAILED", "SUCCEEDED"}) == "STOPPED"
    code, out, _ = _baton(capsys, "stop", "long-1")
    assert out == "long-1: not running (STOPPED)\n"

    code, out, _ = _baton(capsys, "list")
    rows = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert rows["long-1"].split()[1:3] == ["STOPPED", "quickstart"] and rows["long-1"].endswith("  -")
