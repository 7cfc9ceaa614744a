"""An elastic job on a cluster that Ray's own autoscaler grows: the job asks for room for
max_dp replicas, the autoscaler adds a node, and the job grows onto it at its next rescale
check. The cluster is Ray's fake multi-node provider (the autoscaler KubeRay runs, adding local
"nodes" instead of pods), started with `ray start --head --block` in its own session and
stopped by that session's process ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray
import torch

from baton import api
from helpers import free_ports, reference_run, stop_session, write_dataset
from test_elastic import NUM_SAMPLES, STEPS, _assert_exactly_once, _final_params, _spec

pytestmark = pytest.mark.faults
BIN = Path(sys.executable).parent


def _autoscaler_config(gcs: str) -> dict:
    """One node type of 1 CPU, 1 to 4 nodes; the head has no CPU for training."""
    return {
        "cluster_name": "baton-test", "max_workers": 4, "upscaling_speed": 100,
        "idle_timeout_minutes": 1,
        "provider": {"type": "external", "gcs_address": gcs, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True,
                     "module": "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"},
        "auth": {"ssh_user": "ray"}, "docker": {}, "head_node_type": "ray.head.default",
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "cpu_node": {"resources": {"CPU": 1}, "node_config": {}, "min_workers": 1, "max_workers": 4},
        },
        **{key: [] for key in ("cluster_synced_files", "rsync_exclude", "rsync_filter",
                                "initialization_commands", "setup_commands", "head_setup_commands",
                                "worker_setup_commands", "head_start_ray_commands",
                                "worker_start_ray_commands")},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }


@pytest.fixture(scope="module")
def autoscaling():
    root = Path(tempfile.mkdtemp(prefix="ba-", dir="/tmp"))  # short: Ray's socket paths
    [port] = free_ports(1)
    gcs = f"127.0.0.1:{port}"
    (root / "autoscaler.json").write_text(json.dumps(_autoscaler_config(gcs)))
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with open(root / "head.log", "w") as log:
        proc = subprocess.Popen(
            [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
             f"--temp-dir={root / 'ray'}", f"--autoscaling-config={root / 'autoscaler.json'}",
             "--disable-usage-stats"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)
    try:
        deadline = time.time() + 120
        while True:  # the autoscaler starts min_workers = 1 node
            assert proc.poll() is None, (root / "head.log").read_text()[-3000:]
            try:
                if not ray.is_initialized():
                    ray.init(address=gcs, logging_level="WARNING")
                if ray.cluster_resources().get("CPU", 0) >= 1:
                    break
            except ConnectionError:
                pass
            assert time.time() < deadline, "the autoscaler started no node in 120 s"
            time.sleep(1)
        ray.data.DataContext.get_current().enable_progress_bars = False
        yield gcs
    finally:
        ray.shutdown()
        stop_session(proc)
        shutil.rmtree(root, ignore_errors=True)


def test_the_job_asks_the_autoscaler_for_room_and_grows_onto_the_new_nodes(tmp_path, autoscaling):
    """Ray Data's read tasks may make the autoscaler add a node of its own accord, so the job
    may start at dp 1 or 2. It counts the room there is before it asks for max_dp = 4 (asking
    first once let it start at 4 when the nodes came quickly), so it starts small and only its
    request brings the other nodes."""
    data = write_dataset(tmp_path / "data", NUM_SAMPLES, 32)
    spec = _spec(tmp_path, data, "autoscaled", elastic={"min_dp": 1, "max_dp": 4})

    def slow_while_small(c):  # steps take 1 s below dp 4, so the run outlasts nodes starting
        if c.dims.dp < 4:
            time.sleep(1)

    started = time.time()
    result = api.run(spec, record_samples=True, show_progress=False, on_step=slow_while_small)
    dps = [dp for _, dp in result.dp_history]
    assert dps[0] < 4 and dps[-1] == 4, dps
    assert result.events and {e["kind"] for e in result.events} == {"rescale"}
    for event in result.events:
        assert event["from_dp"] < event["dp"]
    assert result.events[-1]["wall_time"] - started < 90
    assert ray.cluster_resources().get("CPU", 0) == 4  # the nodes the autoscaler added
    _assert_exactly_once(result)
    want, _, _ = reference_run(spec, data, steps=STEPS)
    got = _final_params(spec)
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5, msg=name)
