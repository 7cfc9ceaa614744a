"""Shared test set-up. Ray is told its auth mode explicitly and gets a private HOME and temp
dir, so tests neither read nor write the user's ~/.ray and never join another Ray on the host."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_PRIVATE = tempfile.mkdtemp(prefix="baton-tests-")
os.environ["HOME"] = os.path.join(_PRIVATE, "home")
os.environ["RAY_TMPDIR"] = os.path.join(_PRIVATE, "ray")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("RAY_ADDRESS", None)
for d in (os.environ["HOME"], os.environ["RAY_TMPDIR"]):
    os.makedirs(d, exist_ok=True)

sys.path.insert(0, str(Path(__file__).parent))  # the helpers module

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray per test module: 2 CPUs, no dashboard, the tests' folder on the workers'
    path (the user models and tasks in `helpers` live there, as a user's would in their
    project)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def warm_workers():
    """The module's runs keep their workers warm for the next one (resources.keep_warm_s, set
    by helpers.tiny_spec while this holds): a module of runs on one local Ray starts a worker
    process only where the run before had fewer, or other resources. Its first run, every run
    of the other modules and every `baton run` start theirs as a user's single run does."""
    import helpers
    from baton.workers import warm

    helpers.KEEP_WARM_S = 60.0
    yield
    helpers.KEEP_WARM_S = 0.0
    warm.drain()


@pytest.fixture(autouse=True)
def _no_leftover_runs():
    yield
    from helpers import kill_leftovers

    kill_leftovers()


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's standalone S3 server on 127.0.0.1: a real endpoint that pyarrow talks HTTP to.
    Keys are set for the module (moto accepts any; unsigned requests fail), no EC2 metadata."""
    from helpers import free_ports

    keys = {"AWS_ACCESS_KEY_ID": "baton-tests", "AWS_SECRET_ACCESS_KEY": "baton-tests",
            "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(keys)

    port = free_ports(1)[0]
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "w")
    # this Python's own moto (a bare `moto_server` on PATH may be another installation's: a
    # pyenv shim's moto failed every multipart upload here when the venv was not activated)
    server = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(server) if server.exists() else shutil.which("moto_server"),
                             "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "moto_server did not start"
            time.sleep(0.2)
    yield f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    proc.terminate()
    proc.wait(timeout=10)
    log.close()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_runtest_logreport(report):
    """A GPU test's failure printed as it happens: a lent GPU machine's time limit can end
    pytest before its summary (on an H200, 2026-11-27: `....F`, then the step's limit, and the
    failure's text was lost)."""
    if report.failed and "gpu" in report.keywords:
        sys.stderr.write(f"\n{report.nodeid} failed ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()


_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The test process ends without the C-level part of its exit. The project's CI and one of
    two full runs here (2026-11-27/28) ended in a segmentation fault after pytest's summary
    (522 passed): after Python's own end, since `faulthandler`, on through the atexit
    handlers, printed nothing (docs/tests.md). What is left then is the libraries' C and
    C++ static destructors, run while their threads (Ray's and gRPC's, gloo's, Arrow's and
    the AWS SDK's, all started in this one process) may still be running. So, as the
    interpreter exits: its threads joined and its atexit handlers run as always (Ray's
    shutdown, pyarrow's S3 finalisation, tempfile's clean-up), then the process ends with
    pytest's exit status (`os._exit`), skipping the destructors. No test's outcome passes
    through here: the status is pytest's own. A crash in an atexit handler still prints
    every thread's Python stack."""
    if _STATUS not in config.stash:
        return  # pytest stopped before its session: the ordinary exit
    status = config.stash[_STATUS]

    def end() -> None:
        faulthandler.enable(sys.__stderr__, all_threads=True)
        atexit.unregister(end)
        atexit._run_exitfuncs()  # the others, in their usual order
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(status)

    atexit.register(end)  # the last registered: the first to run
