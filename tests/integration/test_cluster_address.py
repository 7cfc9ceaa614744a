"""`baton run --address` joins a running Ray cluster (a simulated one, started and stopped by
this test) instead of starting its own, and checks the layout against that cluster."""

from __future__ import annotations

import pytest
from ray.cluster_utils import Cluster

from helpers import start_baton, tiny_spec, write_dataset, write_spec


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)  # a second node: the two workers may land apart
    c.wait_for_nodes()
    yield c
    c.shutdown()


def test_run_joins_the_cluster(tmp_path, cluster):
    """The job's relative checkpoint folder is the driver's (its working folder), not the one
    the cluster's nodes were started in, which the workers wrote to before (and the run
    failed at its first save: the driver had made the step's folder in its own)."""
    data = write_dataset(tmp_path / "data", 64, 32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="joined",
                                                      checkpoint={"path": "ckpt"}))
    proc = start_baton(["run", str(job), "--address", cluster.address, "--quiet"], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "joined: finished at step 3" in out
    assert sorted(p.name for p in (tmp_path / "ckpt" / "joined").glob("step_*")) == [
        "step_00000002", "step_00000003"]


def test_a_layout_the_cluster_cannot_place_is_refused(tmp_path, cluster):
    data = write_dataset(tmp_path / "data", 64, 32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="toobig"))
    proc = start_baton(["run", str(job), "--address", cluster.address,
                        "--set", "parallel.dp=8", "--set", "train.global_batch=16",
                        "--set", "resources.cpus_per_worker=1"], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2
    assert out.strip().splitlines()[-1] == (
        f"baton: error: {job}: parallel.dp: 8 is invalid; 8 workers x resources.cpus_per_worker "
        f"1.0 need 8 CPUs but the cluster at {cluster.address} has 2; use dp <= 2 or lower "
        "cpus_per_worker")
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "mlflow.db").exists()


def test_an_address_where_nothing_answers_is_one_line_in_seconds(tmp_path, monkeypatch, capsys):
    """A mistyped --address (or a head that is down) kept `baton run` in Ray's connect loop,
    20 tries of about 41 s each with a warning every 5 s (measured: still at it after 5.5
    minutes); now it is one line once nothing has answered for `api.PROBE_S` (10 s; 1 s
    here), with nothing written. The command in this process: it fails before Ray starts."""
    import time

    from baton import api, cli
    from helpers import free_ports

    monkeypatch.setattr(api, "PROBE_S", 1.0)
    monkeypatch.chdir(tmp_path)
    [port] = free_ports(1)  # nothing listens there
    data = write_dataset(tmp_path / "data", 64, 32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="nowhere"))
    t0 = time.monotonic()
    assert cli.main(["run", str(job), "--address", f"127.0.0.1:{port}"]) == 2
    assert time.monotonic() - t0 < 10
    out = capsys.readouterr()
    assert (out.out + out.err).strip().splitlines() == [
        f"baton: error: cannot reach the Ray cluster at 127.0.0.1:{port}: nothing answered there "
        "in 1 s (ConnectionRefusedError: [Errno 111] Connection refused); is its head running "
        "(`ray start --head` prints its address), and its port open to this machine?"], out
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "mlflow.db").exists()
