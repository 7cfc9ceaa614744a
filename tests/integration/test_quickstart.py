"""The README's quick-start job, run exactly as the README runs it, end to end on a local Ray."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import yaml
from mlflow.tracking import MlflowClient

from conftest import REPO


def test_quickstart_as_the_readme_runs_it(tmp_path):
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")  # a clean working directory
    steps = yaml.safe_load((REPO / "jobs" / "quickstart.yaml").read_text())["train"]["steps"]
    baton = shutil.which("baton")
    assert baton, "the baton console script is installed"
    proc = subprocess.run([baton, "run", "jobs/quickstart.yaml"], cwd=tmp_path, env=os.environ,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preparing the built-in corpus" in proc.stdout
    assert f"step {steps}/{steps}" in proc.stderr  # the progress line
    final = re.search(r"finished at step (\d+), loss ([\d.]+)", proc.stdout)
    assert final and int(final.group(1)) == steps
    assert float(final.group(2)) < 2.5  # a uniform byte model scores ln 256 = 5.55

    assert (tmp_path / "checkpoints" / "quickstart" / f"step_{steps:08d}" / "COMMITTED").exists()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("baton").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["parallel.dp"] == "2"
    loss = [m.value for m in sorted(client.get_metric_history(run.info.run_id, "loss"),
                                    key=lambda m: m.step)]
    assert len(loss) == steps
    assert sum(loss[:10]) / 10 > sum(loss[-10:]) / 10 + 2.0  # it learned
