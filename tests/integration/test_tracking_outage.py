"""Tracking never stops training: a real MLflow tracking server (`mlflow server`, its own
process) is killed mid-run and started again on the same database a few steps later. The run
goes on, commits its checkpoints meanwhile, and every step's metrics reach the run once."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from baton import api
from baton.checkpoint import CheckpointStore
from baton.spec import spec_from_dict
from helpers import TrackingServer, free_ports, tiny_spec, write_dataset


@pytest.fixture
def server(tmp_path):
    with open(tmp_path / "mlflow-server.log", "w") as log:
        s = TrackingServer(str(tmp_path / "tracking.db"), free_ports(1)[0], log)
        s.start()
        yield s
        if s.proc.poll() is None:
            s.kill()


def test_a_tracking_server_that_goes_away_and_returns_loses_no_step(tmp_path, local_ray, server,
                                                                      capfd):
    data = write_dataset(tmp_path / "data", num_samples=96, seq_len=32)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="outage", parallel={"dp": 1},
        train={"steps": 12, "global_batch": 4, "micro_batch": 4},
        checkpoint={"every_steps": 2},
        tracking={"uri": f"http://127.0.0.1:{server.port}", "experiment": "outage", "flush_every_s": 0.01}))
    seen: dict[int, tuple] = {}

    def outage(c) -> None:
        if c.step == 3:
            server.kill()
        if 3 <= c.step < 8:
            time.sleep(0.7)  # the outage spans seconds, as a real one does: retries fail
        if c.step in (5, 7):  # the store is away: checkpoints are committed all the same
            seen[c.step] = (c.status()["tracking"], c.store.latest())
        if c.step == 8:
            server.start()  # on the same database
    result = api.run(spec, show_progress=False, on_step=outage)

    assert result.state == "finished" and result.step == 12
    assert seen[5][0].startswith("degraded since ")  # what `baton status` shows
    assert (seen[5][1], seen[7][1]) == (4, 6)
    err = capfd.readouterr().err
    with capfd.disabled():  # `pytest -s` shows what the user saw
        print("\n".join(line for line in err.splitlines() if "MLflow store" in line))
    assert err.count("baton: warning: the MLflow store at http://127.0.0.1") == 1, err
    assert "training goes on, and metrics wait in memory until it is back" in err
    assert err.count("baton: the MLflow store is back after") == 1, err
    assert CheckpointStore(spec.checkpoint_dir).latest_verified() == (12, [])
    client = MlflowClient(f"http://127.0.0.1:{server.port}")
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(result.run_id, "loss"))
    assert steps == list(range(1, 13))  # every step once: none lost, none twice
    assert run.data.tags["checkpoint.latest"].endswith("step_00000012")
