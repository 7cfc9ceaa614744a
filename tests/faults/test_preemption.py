"""A node's `ray start --block` gets SIGTERM, as a Kubernetes pod's main process does when the
pod is deleted (a spot VM preempted, a node drained for maintenance): Ray marks the node as
draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S and stops it once nothing runs there. The
cluster here is real Ray processes, not a simulation: a head with no CPUs and three worker
nodes of one CPU, each its own `ray start --block` in a session of its own, all on this
machine; this module stops them by their sessions' process ids."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from baton import api, ray_settings
from baton.spec import spec_from_dict
from helpers import (assert_like_one_process, free_ports, hold_until_moving, stop_session, tiny_spec,
                     write_dataset)

pytestmark = pytest.mark.faults
BIN = Path(sys.executable).parent
DRAIN_S = 30  # Ray's default, said here so that the test does not depend on it
NUM_SAMPLES, STEPS = 40, 8


@pytest.fixture(scope="module")
def nodes():
    root = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))  # short: Ray's socket paths
    (root / "home").mkdir()
    env = {**os.environ, **ray_settings.ray_env(), "RAY_AUTH_MODE": "disabled",
           "HOME": str(root / "home"), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": str(DRAIN_S),
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *args: str) -> None:
        agent, agent_grpc, runtime_env, metrics = free_ports(4)
        with open(root / f"{name}.log", "w") as out:
            procs[name] = subprocess.Popen(
                [str(BIN / "ray"), "start", "--block", "--node-ip-address=127.0.0.1",
                 f"--node-name={name}", f"--dashboard-agent-listen-port={agent}",
                 f"--dashboard-agent-grpc-port={agent_grpc}",
                 f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}",
                 "--disable-usage-stats", *args],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=root)

    [gcs] = free_ports(1)
    address = f"127.0.0.1:{gcs}"
    try:
        start("head", "--head", f"--port={gcs}", "--num-cpus=0", "--include-dashboard=false",
              f"--temp-dir={root / 'ray'}")
        _wait_for(lambda: (root / "ray" / "session_latest").exists(), procs, root)
        os.environ["RAY_AUTH_MODE"] = "disabled"  # this driver's, as the nodes'
        # the nodes listen on 127.0.0.1: so does this driver's connection to its node's raylet
        ray.init(address=address, logging_level="WARNING", _node_ip_address="127.0.0.1")
        ray.data.DataContext.get_current().enable_progress_bars = False
        for i in range(3):  # one after the other: three at once on 2 cores timed out starting
            start(f"worker-{i}", f"--address={address}", "--num-cpus=1")
            _wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == i + 2, procs, root)
        yield procs
    finally:
        ray.shutdown()
        for proc in procs.values():  # idle now: a node drains in about a second
            stop_session(proc, grace_s=2)
        shutil.rmtree(root, ignore_errors=True)


def _wait_for(ready, procs: dict, root: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited: {(root / f'{name}.log').read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the nodes did not come up"
        time.sleep(1)


def test_sigterm_to_a_nodes_ray_start_moves_its_workers_with_nothing_lost(tmp_path, nodes):
    """SIGTERM to the `ray start` of rank 0's node after step 3: Ray drains the node for 30 s,
    the job moves that worker to the third node at a step boundary (no failure, every sample
    once, the model of one process at the bound the elastic tests measured), and the node's
    `ray start` exits once the job has let its worker go, well before the 30 s are up."""
    data = write_dataset(tmp_path / "data", NUM_SAMPLES, 32)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="preempted", train={"steps": STEPS, "global_batch": 8, "micro_batch": None},
        parallel={"dp": 2, "timeout_s": 30}, resources={"cpus_per_worker": 1},
        checkpoint={"every_steps": 2, "keep": 10},
        elastic={"max_failures": 3, "hang_timeout_s": 4, "rescale_check_s": 1}))
    names = {n["NodeID"]: n["NodeName"] for n in ray.nodes()}
    signalled = {}

    def preempt(c):
        if c.step == 3 and not signalled:
            name = names[c.workers[0]["node"]]
            signalled.update(name=name, at=time.monotonic())
            nodes[name].send_signal(signal.SIGTERM)  # what the kubelet sends a pod's PID 1
        elif signalled and not c.events:
            hold_until_moving(c)
    result = api.run(spec, record_samples=True, show_progress=False, on_step=preempt)

    assert result.state == "finished" and result.step == STEPS
    assert [e["kind"] for e in result.events] == ["drain", "move"], result.events
    notice, move = result.events
    assert notice["moved"] and notice["ranks"] == [0]
    assert 0 < notice["deadline_in_s"] <= DRAIN_S
    assert move["dp"] == 2 and move["resumed_from_step"] == notice["step"]
    assert {names[w["node"]] for w in result.workers} == {"worker-0", "worker-1", "worker-2"} - {signalled["name"]}
    ids = [i for step, _, part in result.ledger for i in part if step < NUM_SAMPLES // 8]
    assert sorted(ids) == list(range(1000, 1000 + NUM_SAMPLES))  # epoch 0: every sample once
    assert_like_one_process(spec, data, result, STEPS)  # measured: 1.2e-7 at most, the bound 1e-5 + 4e-5
    # the node went once nothing of the job was left on it, not at its deadline
    nodes[signalled["name"]].wait(timeout=DRAIN_S + 30)
    gone_s = time.monotonic() - signalled["at"]
    print(f"{signalled['name']}'s ray start exited {gone_s:.1f} s after its SIGTERM; "
          f"the move stopped training {move['total_s']} s: {move['phases_s']}")
    assert gone_s < DRAIN_S
