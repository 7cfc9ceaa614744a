"""Checkpoints: committed last, torn ones never loaded, retention, no unrestricted pickle."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from baton.checkpoint import CheckpointStore
from baton.errors import CheckpointError


def _save(store, step, keep=2, value=0.0):
    store.begin(step)
    parts = [store.write_tensors(step, "model-0000.pt", {"w": torch.full((3,), value)}),
             store.write_tensors(step, "optim-0000.pt", {"state": {}, "param_groups": []})]
    return store.commit(step, {"step": step}, keep=keep, parts=parts)


def test_commit_then_load(tmp_path):
    store = CheckpointStore(str(tmp_path / "job"))
    assert store.latest() is None
    path = _save(store, 5, value=1.5)
    assert path.endswith("step_00000005") and store.latest() == 5
    assert store.read_meta(5)["step"] == 5
    assert torch.equal(store.read_tensors(5, "model-0000.pt")["w"], torch.full((3,), 1.5))


def test_torn_checkpoint_is_never_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path / "job"))
    _save(store, 5)
    store.begin(10)  # a crash after writing part of step 10, before the marker
    store.write_tensors(10, "model-0000.pt", {"w": torch.zeros(3)})
    assert store.latest() == 5
    with pytest.raises(CheckpointError, match="not committed"):
        store.read_tensors(10, "model-0000.pt")
    _save(store, 10, value=2.0)  # a retry at the same step replaces the torn folder
    assert store.latest() == 10


def test_retention_keeps_the_newest_and_drops_older_torn(tmp_path):
    store = CheckpointStore(str(tmp_path / "job"))
    store.begin(1)  # torn, older than what follows
    for step in (2, 4, 6, 8):
        _save(store, step, keep=2)
    assert store.committed_steps() == [6, 8]
    store.settle()  # the folders are deleted on a thread of their own
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["step_00000006", "step_00000008"]


def test_retention_deletes_off_the_commit_and_the_old_folder_is_torn_at_once(tmp_path, monkeypatch):
    """A commit returns before the checkpoint it retires is deleted (a 1.37 GB folder took
    0.36 s to delete here, which held the coordinator while the workers ran out of queued
    steps); that checkpoint's marker goes first, so what is left meanwhile, or after a crash,
    is torn: never loaded, and dropped by the next commit."""
    import threading

    store = CheckpointStore(str(tmp_path / "job"))
    release, deleting = threading.Event(), threading.Event()
    delete, deleted = CheckpointStore._delete, []

    def held(self, d):
        deleted.append(d.rsplit("/", 1)[-1])
        deleting.set()
        assert release.wait(30)
        delete(self, d)
    monkeypatch.setattr(CheckpointStore, "_delete", held)
    _save(store, 1, keep=1)
    _save(store, 2, keep=1, value=2.0)  # retires 1
    assert deleting.wait(30)
    old = tmp_path / "job" / "step_00000001"
    assert old.exists() and not (old / "COMMITTED").exists()  # still there, and torn
    assert store.committed_steps() == [2] and store.latest_verified() == (2, [])
    _save(store, 3, keep=1, value=3.0)  # lists 1 again while it is being deleted: once only
    release.set()
    store.settle()
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["step_00000003"]
    assert deleted == ["step_00000001", "step_00000002"]  # each once


def test_a_deletion_that_fails_is_a_warning_and_the_next_commit_tries_again(tmp_path, capsys):
    import pyarrow.fs as pafs

    class Refusing(pafs.LocalFileSystem):
        def delete_dir(self, path):
            raise OSError("permission denied")

    store = CheckpointStore(str(tmp_path / "job"))
    _save(store, 1, keep=1)
    store.fs = Refusing()
    _save(store, 2, keep=1, value=2.0)
    store.settle()
    assert "could not delete the old checkpoint" in capsys.readouterr().out
    assert store.latest() == 2 and (tmp_path / "job" / "step_00000001").exists()
    store.fs = pafs.LocalFileSystem()
    _save(store, 3, keep=1, value=3.0)
    store.settle()
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == ["step_00000003"]


def test_loading_refuses_arbitrary_pickles(tmp_path):
    store = CheckpointStore(str(tmp_path / "job"))
    _save(store, 1)

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    buf = io.BytesIO()
    torch.save({"w": Evil()}, buf, pickle_protocol=pickle.DEFAULT_PROTOCOL)
    (tmp_path / "job" / "step_00000001" / "model-0000.pt").write_bytes(buf.getvalue())
    with pytest.raises(pickle.UnpicklingError):
        store.read_tensors(1, "model-0000.pt")


def test_resume_refuses_another_recipe_and_names_what_changed(tmp_path):
    from baton.api import plan_resume
    from baton.spec import spec_from_dict
    from helpers import tiny_spec

    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path, train={"steps": 10}))
    store = CheckpointStore(spec.checkpoint_dir)
    store.begin(4)
    parts = [store.write_tensors(4, f"{kind}-0000.pt", {}) for kind in ("model", "optim")]
    store.commit(4, {"job": "tiny", "step": 4, "fingerprint": spec.fingerprint(),
                     "recipe": spec.recipe()}, keep=2, parts=parts)
    assert plan_resume(spec, "job.yaml", None)[0]["step"] == 4
    longer = spec_from_dict(tiny_spec(tmp_path, tmp_path, train={"steps": 20}, parallel={"dp": 1}))
    assert plan_resume(longer, "job.yaml", None)[0]["step"] == 4  # steps and layout may change
    other = spec_from_dict(tiny_spec(tmp_path, tmp_path, model={"width": 64},
                                     train={"steps": 10, "lr": 0.02}))
    with pytest.raises(CheckpointError) as e:
        plan_resume(other, "job.yaml", None)
    assert "(model.width 32 -> 64, train.lr 0.01 -> 0.02)" in str(e.value)
    done = spec_from_dict(tiny_spec(tmp_path, tmp_path, train={"steps": 4}))
    with pytest.raises(CheckpointError, match="already finished"):
        plan_resume(done, "job.yaml", None)
    fresh = spec_from_dict(tiny_spec(tmp_path / "other", tmp_path))
    with pytest.raises(CheckpointError, match="--resume given but"):
        plan_resume(fresh, "job.yaml", True)


def test_a_sharded_checkpoint_index_is_unpickled_only_into_dcp_metadata(tmp_path):
    """DCP's .metadata is a pickle: baton's reader builds only DCP's metadata classes from it,
    so a crafted index cannot run code (here: create a file)."""
    import pickle

    import pyarrow.fs as pafs
    import torch.distributed.checkpoint as dcp

    from baton.checkpoint import sharded
    from baton.errors import CheckpointError

    where = sharded.Location(pafs.LocalFileSystem(), str(tmp_path / "ok"))

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"w": {"step": torch.tensor(3.0)}}}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "ok")), no_dist=True)
    assert torch.equal(sharded.read_full(where, "model")["w"], state["model"]["w"])
    assert sharded.has_optimizer_state(where)

    class Evil:
        def __reduce__(self):
            return (open, (str(tmp_path / "pwned"), "w"))

    (tmp_path / "ok" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(CheckpointError, match=r"\.metadata names io\.open, which a checkpoint "
                                              r"index never holds"):
        sharded.read_full(where, "model")
    assert not (tmp_path / "pwned").exists()


def test_every_dtensor_mesh_cache_is_found_and_emptied():
    """A worker leaving a world empties DTensor's mesh-keyed caches (`forget_meshes`): with the
    pinned torch (2.13) all five are found, so none is silently skipped; with any torch the
    call runs (it is in every recovery's path)."""
    from baton.checkpoint.sharded import forget_meshes, mesh_cache_clears

    if torch.__version__.startswith("2.13."):
        assert len(mesh_cache_clears()) == 5
    forget_meshes()


def _stepped_model():
    """A model with a buffer its forward changes (BatchNorm's running mean) and an AdamW with
    state, after one step."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _pointers(model) -> set[int]:
    return {q.data_ptr() for q in model.parameters()}


def test_buffers_allocated_ahead_are_the_ones_the_first_background_copy_fills():
    """A background save's host buffers are allocated after a world's first step, on the
    writing thread (`Worker._prestage`); the first save copies into them, not into new ones,
    and the second into the first's."""
    from baton.workers.saves import BackgroundSaves, empty_like

    model, opt = _stepped_model()
    saves = BackgroundSaves(torch.device("cpu"))
    state = (model.state_dict(), opt.state_dict())
    _, later = BackgroundSaves.split(state, _pointers(model))
    saves.prestage(lambda: ({}, empty_like(later, pin=False)))
    ahead = saves.prestaged.result()[1]
    filled = BackgroundSaves.landed(saves.copy(state, _pointers(model)))
    assert filled[0]["0.weight"].data_ptr() == ahead[0]["0.weight"].data_ptr()
    assert filled[1]["state"][0]["exp_avg"].data_ptr() == ahead[1]["state"][0]["exp_avg"].data_ptr()
    assert torch.equal(filled[0]["0.weight"], model[0].weight)
    assert torch.equal(filled[0]["1.running_mean"], model[1].running_mean)
    assert torch.equal(filled[1]["state"][0]["exp_avg_sq"], opt.state[model[0].weight]["exp_avg_sq"])
    assert filled[1]["param_groups"] == opt.state_dict()["param_groups"]
    again = BackgroundSaves.landed(saves.copy(state, _pointers(model)))
    assert again[0]["0.weight"].data_ptr() == ahead[0]["0.weight"].data_ptr()


def test_a_background_copy_holds_the_state_of_its_save_while_the_next_step_runs():
    """The copy of the parameters and the optimizer state runs beside the next step's forward
    and backward; the optimizer step waits for it (`fence`), and what a forward changes (a
    buffer) was copied at the save. The copying thread is held here until the next step is
    about to update, so the copy is certain to start after the forward: it must still hold the
    saved step's values, and the fence must wait for it."""
    import threading

    from baton.workers.saves import BackgroundSaves

    model, opt = _stepped_model()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_moment = opt.state[model[0].weight]["exp_avg"].clone()
    saves = BackgroundSaves(torch.device("cpu"))
    gate = threading.Event()
    saves.copier.submit(gate.wait)  # the copy below queues behind this
    copying = saves.copy((model.state_dict(), opt.state_dict()), _pointers(model))

    fenced = threading.Thread(target=saves.fence, daemon=True)
    try:
        model(torch.randn(5, 4)).sum().backward()  # the next step's forward changes the buffer
        assert not torch.equal(model[1].running_mean, saved["1.running_mean"])
        fenced.start()
        fenced.join(0.3)
        assert fenced.is_alive()  # the optimizer step may not start: the copy has not run
    finally:
        gate.set()  # (a failure above would otherwise leave the copying thread waiting)
    fenced.join(10)
    assert not fenced.is_alive() and copying.done()
    opt.step()  # after the fence, as train_step does
    model_state, optim_state = BackgroundSaves.landed(copying)
    for name, value in saved.items():
        assert torch.equal(model_state[name], value), name
    assert torch.equal(optim_state["state"][0]["exp_avg"], saved_moment)
    assert not torch.equal(model[0].weight, saved["0.weight"])  # the step did change them
    assert saves.stalls() >= 0.3 and saves.stalls() == 0.0  # the fence's wait, reported once


def test_the_writing_thread_runs_behind_training_in_a_worker_at_rays_priority():
    """Ray starts its workers at nice 15; the thread that writes background saves must come
    after the training thread that starts it, not before (it took a fixed nice 10, ahead of
    training wherever the process could raise a thread's priority, as root)."""
    import os
    import threading

    from baton.workers.saves import BackgroundSaves

    seen = {}

    def as_a_ray_worker():  # a thread at Ray's worker niceness starts the saves
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 15)
        seen["training"] = os.getpriority(os.PRIO_PROCESS, tid)
        saves = BackgroundSaves(torch.device("cpu"))
        seen["writer"] = saves.writer.submit(
            lambda: (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        ).result(10)
        saves.writer.shutdown()
    t = threading.Thread(target=as_a_ray_worker)
    t.start()
    t.join(20)
    policy, nice = seen["writer"]
    assert seen["training"] == 15
    assert policy == os.SCHED_IDLE or (policy == os.SCHED_OTHER and nice > 15), seen


def test_a_sharded_background_copy_is_planned_at_the_save_and_written_as_of_it(tmp_path):
    """The same for sharded state (FSDP2's DTensors, a world of one here): the copy's DCP plan
    is made at the save, before any value has landed; the parameters' and moments' shards are
    copied beside the next step (held here until it is about to update), the buffer its
    forward changes at the save; the checkpoint written from the plan holds the saved step."""
    import threading

    import pyarrow.fs as pafs
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from baton import storage
    from baton.checkpoint import sharded
    from baton.training import local
    from baton.workers.saves import BackgroundSaves, empty_shards

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
        mesh = init_device_mesh("cpu", (1,))
        for unit in (model[0], model[2], model):
            fully_shard(unit, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        model_state, optim_state = get_state_dict(model, opt)
        saved = {k: local(v).clone() for k, v in model_state.items()}
        saved_moment = local(optim_state["state"]["0.weight"]["exp_avg"]).clone()

        saves = BackgroundSaves(torch.device("cpu"))
        state = {"model": model_state, "optim": optim_state["state"]}
        saves.prestage(lambda: empty_shards(state, pin=False))  # as after a world's first step
        ahead = saves.prestaged.result()
        gate = threading.Event()
        saves.copier.submit(gate.wait)  # the copy below queues behind this
        params = {local(q).data_ptr() for q in model.parameters()}
        where = sharded.Location(pafs.LocalFileSystem(), str(tmp_path / "shards"))
        (copied, planned), copying = saves.copy_shards(
            state, params, lambda c: (c, sharded.PlannedSave(c, where)))
        plans, finish = sharded.plan_globally(where, [planned.plan()])  # nothing landed yet
        fenced = threading.Thread(target=saves.fence, daemon=True)
        try:
            model(torch.randn(5, 4)).sum().backward()  # the next step's forward and backward
            fenced.start()
            fenced.join(0.3)
            assert fenced.is_alive() and not copying.done()
        finally:
            gate.set()
        fenced.join(10)
        assert not fenced.is_alive()
        opt.step()
        assert not torch.equal(local(model[0].weight), saved["0.weight"])  # the step changed it
        for a, b in [(copied["model"]["0.weight"], ahead["model"]["0.weight"]),
                     (copied["optim"]["2.bias"]["exp_avg_sq"], ahead["optim"]["2.bias"]["exp_avg_sq"])]:
            assert local(a).data_ptr() == local(b).data_ptr()  # the buffers allocated ahead
        assert saves.buffers is copied  # kept for the next save
        BackgroundSaves.landed_copy(copying)
        results, records = planned.write(plans[0])
        records += finish([results])  # the index's record
        assert sorted(r["name"] for r in records) == sorted(f"shards/{f.name}" for f in (tmp_path / "shards").iterdir())
        for r in records:  # counted and checksummed as written, as a read-back finds them
            assert r == {"name": r["name"], **storage.file_record(where.fs, f"{tmp_path}/{r['name']}")}
        written = sharded.read_full(where, "model")
        for name, value in saved.items():
            assert torch.equal(written[name], value), name
        assert torch.equal(sharded.read_full(where, "optim")["0.weight"]["exp_avg"], saved_moment)
        model_state, optim_state = get_state_dict(model, opt)  # the next save: the same buffers
        again, copying = saves.copy_shards({"model": model_state, "optim": optim_state["state"]},
                                           params, lambda c: c)
        BackgroundSaves.landed_copy(copying)
        for a, b in [(again["model"]["0.weight"], copied["model"]["0.weight"]),
                     (again["optim"]["2.bias"]["exp_avg_sq"], copied["optim"]["2.bias"]["exp_avg_sq"])]:
            assert local(a).data_ptr() == local(b).data_ptr()
        assert torch.equal(local(again["model"]["0.weight"]), local(model[0].weight))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_device_checksums_see_one_changed_bit_and_two_swapped_elements(dtype):
    """What replicas' digests compare on a GPU (computed there): run here on CPU tensors."""
    from baton.training import device_checksums

    t = torch.rand(300, 7) > 0.5 if dtype == torch.bool else (torch.randn(300, 7) * 100).to(dtype)
    whole = device_checksums([t])
    assert torch.equal(device_checksums([t.clone()], chunk=64), whole)  # chunking changes nothing
    flipped = t.clone().view(-1)
    bits = flipped.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    for i in (1, 17, 1000):  # any bit of any element: each weight is odd, so nothing cancels
        for b in range(8 * t.element_size()):
            bits[i] ^= 1 << b if b < 8 * t.element_size() - 1 else -(1 << b)  # the sign bit too
            assert not torch.equal(device_checksums([flipped.view(300, 7)]), whole), (i, b)
            bits[i] ^= 1 << b if b < 8 * t.element_size() - 1 else -(1 << b)
    swapped = t.clone().view(-1)
    i, j = next((i, j) for i in range(swapped.numel()) for j in range(i + 1, swapped.numel())
                if swapped[i] != swapped[j])
    swapped[[i, j]] = swapped[[j, i]]
    assert not torch.equal(device_checksums([swapped.view(300, 7)]), whole)


def test_the_best_checkpoint_by_its_held_out_metric_outlives_newer_ones(tmp_path, capsys):
    """checkpoint.best: the newest `keep` and the best by the metric each checkpoint's
    evaluation recorded (the earliest of equals; one not evaluated, or not a number, is no
    candidate); a new run on the folder (a resume) finds the best so far in it."""
    from baton.coordinator.commits import Commits

    class Tags:
        def __init__(self):
            self.tags = {}

        def flush(self):
            pass

        def set_tags(self, tags):
            self.tags.update(tags)

    store = CheckpointStore(str(tmp_path / "job"))

    def save(commits, step, evaluated=None):
        store.begin(step)
        parts = [store.write_tensors(step, f"{k}-0000.pt", {}) for k in ("model", "optim")]
        commits._commit(step, {"step": step, **({"eval": evaluated} if evaluated else {})}, parts)
        store.settle()
        return sorted(store.committed_steps())

    tracker = Tags()
    commits = Commits(store, tracker, None, keep=1, best=("eval_loss", True))
    assert save(commits, 2, {"eval_loss": 3.0}) == [2]
    assert save(commits, 4, {"eval_loss": 2.0}) == [4]
    assert save(commits, 6, {"eval_loss": 2.5}) == [4, 6]
    assert save(commits, 8) == [4, 8]  # a survivors' checkpoint: not evaluated
    assert save(commits, 10, {"eval_loss": float("nan")}) == [4, 10]
    assert save(commits, 12, {"eval_loss": 2.0}) == [4, 12]  # equal: the earlier stays
    assert tracker.tags["checkpoint.best_step"] == "4"
    assert tracker.tags["checkpoint.best"].endswith("step_00000004")
    assert store.best("eval_loss", True) == (4, 2.0)
    resumed = Commits(store, Tags(), None, keep=1, best=("eval_loss", True))
    assert save(resumed, 14, {"eval_loss": 1.5}) == [14]
    assert save(resumed, 16, {"eval_loss": 1.7}) == [14, 16]

    # the best found broken by a recovery's load (newest_whole sets it aside; the workers'
    # checksums here say so of step 34): the best of those left is kept from then on
    class Group:
        def check_sums(self, root, step, parts):
            return "part model-0000.pt does not match its checksum" if step == 34 else None

    store = CheckpointStore(str(tmp_path / "broken"))
    commits = Commits(store, Tags(), None, keep=2, best=("eval_loss", True))
    assert save(commits, 30, {"eval_loss": 2.0}) == [30]
    assert save(commits, 32, {"eval_loss": 3.0}) == [30, 32]
    assert save(commits, 34, {"eval_loss": 1.0}) == [32, 34]
    meta, failed = commits.newest_whole(Group())
    assert meta["step"] == 32 and [s for s, _ in failed] == [34]
    assert save(commits, 34, {"eval_loss": 3.5}) == [32, 34]  # trained again, worse
    assert save(commits, 36, {"eval_loss": 4.0}) == [32, 34, 36]

    # highest first, and a metric the run does not report: one warning, the newest kept
    store = CheckpointStore(str(tmp_path / "other"))
    commits = Commits(store, Tags(), None, keep=1, best=("eval_accuracy", False))
    assert save(commits, 2, {"eval_accuracy": 0.5}) == [2]
    assert save(commits, 4, {"eval_accuracy": 0.4}) == [2, 4]
    assert save(commits, 6, {"eval_accuracy": 0.7}) == [6]
    capsys.readouterr()
    commits = Commits(CheckpointStore(str(tmp_path / "third")), Tags(), None, keep=1,
                      best=("eval_acc", False))
    store = commits.store
    assert save(commits, 2, {"eval_loss": 1.0, "eval_accuracy": 0.5}) == [2]
    assert save(commits, 4, {"eval_loss": 0.9, "eval_accuracy": 0.6}) == [4]
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(
        "baton: warning: checkpoint.best: eval_acc is not among this run's held-out metrics "
        "(eval_accuracy, eval_loss); only the newest checkpoints are kept")
