"""Shared test set-up. Ray is told its auth mode explicitly and gets a private HOME and temp
dir, so tests neither read nor write the user's ~/.ray and never join another Ray on the host."""

from __future__ import annotations

import os
import sys
import tempfile
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
    """One local Ray per test module: 2 CPUs, no dashboard."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _no_leftover_runs():
    yield
    from helpers import kill_leftovers

    kill_leftovers()
