"""Resume is invisible: 10 steps straight equal 5 steps, a SIGKILL, and 5 resumed steps, bitwise,
in one MLflow run, with checkpoints written in the background (checkpoint.async); and so is a
fork (`baton fork`) of the straight run's step 5. Runs the real `baton run` command in its own
process group."""

from __future__ import annotations

import os
import signal
import time

import torch
from mlflow.tracking import MlflowClient

from baton.checkpoint import CheckpointStore
from helpers import FAST, SLOW_MODEL, start_baton, tiny_spec, write_dataset, write_spec

def test_killed_and_resumed_equals_straight(tmp_path):
    (tmp_path / "slowgpt.py").write_text(SLOW_MODEL)  # in the working directory, as a user would
    data = write_dataset(tmp_path / "data", num_samples=200, seq_len=32)
    specs = {}
    for name in ("straight", "killed"):
        spec = tiny_spec(tmp_path, data, name=name,
                         model={"name": "slowgpt:build", "dropout": 0.1},  # RNG state matters
                         train={"steps": 10, "global_batch": 8, "micro_batch": 4},
                         # the killed run writes its checkpoints in the background: the
                         # same result, bitwise (checkpointing is not part of the recipe)
                         checkpoint={"every_steps": 5, "keep": 3, "async": name == "killed"},
                         tracking={"flush_every_s": 3600})  # flush only at commits and the end
        specs[name] = write_spec(tmp_path / f"{name}.yaml", spec)

    fast = dict(os.environ, **FAST)  # only the killed run needs the sleep
    straight = start_baton(["run", str(specs["straight"]), "--quiet"], tmp_path, env=fast)
    out, _ = straight.communicate(timeout=300)
    assert straight.returncode == 0, out

    killed = start_baton(["run", str(specs["killed"]), "--quiet"], tmp_path)
    marker = tmp_path / "ckpt" / "killed" / "step_00000005" / "COMMITTED"
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert killed.poll() is None, killed.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint at step 5"
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait(timeout=30)
    assert killed.returncode == -signal.SIGKILL
    store = CheckpointStore(str(tmp_path / "ckpt" / "killed"))
    assert store.latest() == 5  # killed before it could finish

    resumed = start_baton(["run", str(specs["killed"]), "--quiet"], tmp_path, env=fast)
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert "resuming killed from step 5" in out

    want = CheckpointStore(str(tmp_path / "ckpt" / "straight"))
    for part in ("model-0000.pt", "optim-0000.pt"):
        a, b = want.read_tensors(10, part), store.read_tensors(10, part)
        flat_a, flat_b = _tensors(a), _tensors(b)
        assert flat_a.keys() == flat_b.keys() and flat_a
        for key in flat_a:
            assert torch.equal(flat_a[key], flat_b[key]), f"{part}: {key} differs"

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("tests")
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'killed'")
    assert len(runs) == 1  # the resumed job continued its run
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["resumed_from_step"] == "5"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(steps) == list(range(1, 11))  # ten steps, each once
    ref = {m.step: m.value for m in client.get_metric_history(
        client.search_runs([exp.experiment_id], "attributes.run_name = 'straight'")[0].info.run_id, "loss")}
    got = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert got == ref

    # `baton fork`: a job of another name started at the straight run's step 5 (weights,
    # optimizer, RNG states, data cursor) trains steps 6-10 as the straight run did, bitwise,
    # in an MLflow run of its own
    forked = tmp_path / "forked.yaml"
    forked.write_text(specs["straight"].read_text().replace("name: straight", "name: forked"))
    fork = start_baton(["fork", str(forked), "--from", str(specs["straight"]), "--step", "5"],
                       tmp_path, env=fast)
    out, _ = fork.communicate(timeout=120)
    assert fork.returncode == 0 and "forked starts at step 5 of straight" in out, out
    run = start_baton(["run", str(forked), "--quiet"], tmp_path, env=fast)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == 0 and "resuming forked from step 5" in out and "forked from straight" in out, out
    mine = CheckpointStore(str(tmp_path / "ckpt" / "forked"))
    for part in ("model-0000.pt", "optim-0000.pt"):
        flat_a, flat_b = _tensors(want.read_tensors(10, part)), _tensors(mine.read_tensors(10, part))
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a)
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'forked'")
    assert len(runs) == 1 and runs[0].data.tags["forked_from"] == "straight step 5"
    got = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, "loss")}
    assert got == {s: v for s, v in ref.items() if s > 5}


def _tensors(tree, prefix="") -> dict[str, torch.Tensor]:
    out = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out
