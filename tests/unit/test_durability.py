"""Checkpoints that never lose work: commits that list and check their parts, verification
on load with a fall-back to the previous checkpoint, and one writer per job (the lease), on a
local disk and on a real S3 endpoint (moto's server)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pyarrow.fs as pafs
import pytest
import torch

from baton import storage
from baton.checkpoint import CheckpointStore
from baton.checkpoint.lease import Lease
from baton.errors import CheckpointError, StoreUnavailable


def _write(store, step, pp=1, value=0.0):
    store.begin(step)
    return [store.write_tensors(step, f"{kind}-{i:04d}.pt", {"w": torch.full((64,), value + i)})
            for i in range(pp) for kind in ("model", "optim")]


def _meta(step, pp=1):
    return {"step": step, "layout": {"dp": 1, "pp": pp}}


def test_a_commit_names_every_part_and_refuses_one_missing(tmp_path):
    store = CheckpointStore(str(tmp_path / "job"))
    store.begin(1)
    with pytest.raises(CheckpointError, match="checkpoint 1 not committed: no parts were written"):
        store.commit(1, _meta(1), keep=1, parts=[])
    parts = _write(store, 2, pp=2)
    with pytest.raises(CheckpointError, match="part optim-0001.pt is missing"):  # the layout needs it
        store.commit(2, _meta(2, pp=2), keep=1, parts=parts[:3])
    (tmp_path / "job" / "step_00000002" / "model-0001.pt").unlink()  # listed, but gone
    with pytest.raises(CheckpointError, match="part model-0001.pt is missing"):
        store.commit(2, _meta(2, pp=2), keep=1, parts=parts)
    parts = _write(store, 3)
    with open(tmp_path / "job" / "step_00000003" / "optim-0000.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointError, match=r"part optim-0000.pt is \d+ bytes, \d+ when written"):
        store.commit(3, _meta(3), keep=1, parts=parts)
    assert store.latest() is None  # nothing was committed
    parts = _write(store, 4)
    store.commit(4, _meta(4), keep=1, parts=parts)
    recorded = store.read_meta(4)["parts"]
    assert sorted(recorded) == ["model-0000.pt", "optim-0000.pt"]
    assert recorded["model-0000.pt"]["size"] == os.path.getsize(
        tmp_path / "job" / "step_00000004" / "model-0000.pt")
    assert not [p for p in (tmp_path / "job" / "step_00000004").iterdir() if ".tmp" in p.name]


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,why", [
    (lambda d: os.truncate(d / "model-0000.pt", 100), r"part model-0000.pt is 100 bytes, \d+ when written"),
    (lambda d: _flip(d / "optim-0000.pt"), "part optim-0000.pt does not match its checksum"),
    (lambda d: (d / "model-0000.pt").unlink(), "part model-0000.pt is missing"),
    (lambda d: (d / "meta.json").write_text("{not json"), "JSONDecodeError"),
])
def test_a_damaged_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, why):
    store = CheckpointStore(str(tmp_path / "job"))
    for step in (5, 10):
        store.commit(step, _meta(step), keep=2, parts=_write(store, step, value=step))
    damage(tmp_path / "job" / "step_00000010")
    step, failed = store.latest_verified()
    assert step == 5 and len(failed) == 1 and failed[0][0] == 10
    assert re.search(why, failed[0][1]), failed[0][1]
    store.reject(10, failed[0][1])
    assert store.committed_steps() == [5] and store.latest() == 5
    assert torch.equal(store.read_tensors(5, "model-0000.pt")["w"], torch.full((64,), 5.0))
    # training reaches step 10 again: the rejected folder is replaced by a whole checkpoint
    store.commit(10, _meta(10), keep=2, parts=_write(store, 10, value=10))
    assert store.latest_verified() == (10, [])


def test_parts_recorded_with_sha256_by_older_versions_still_verify(tmp_path):
    """New parts carry CRC-32; a checkpoint whose meta.json records SHA-256 (baton before the
    change) verifies with SHA-256, and a flipped byte still fails it."""
    import hashlib

    store = CheckpointStore(str(tmp_path / "job"))
    parts = _write(store, 5)
    assert all(sorted(p) == ["crc32", "name", "size"] for p in parts)
    step_dir = tmp_path / "job" / "step_00000005"
    for p in parts:  # as an older writer recorded them
        del p["crc32"]
        p["sha256"] = hashlib.sha256((step_dir / p["name"]).read_bytes()).hexdigest()
    store.commit(5, _meta(5), keep=1, parts=parts)
    assert store.latest_verified() == (5, [])
    _flip(step_dir / "model-0000.pt")
    assert store.latest_verified() == (None, [(5, "part model-0000.pt does not match its checksum")])


def test_parts_skip_the_zip_checksum_torch_save_computes_and_still_load(tmp_path):
    """torch.save's zip computes a CRC-32 of every tensor's bytes, which torch.load never
    reads: a part carries its own checksum, so baton's writes switch torch's off (process-wide
    in torch) and put it back after."""
    import zipfile

    store = CheckpointStore(str(tmp_path / "job"))
    parts = _write(store, 5, value=3.0)
    with zipfile.ZipFile(tmp_path / "job" / "step_00000005" / "model-0000.pt") as z:
        assert [i.CRC for i in z.infolist() if i.filename.endswith("/data/0")] == [0]
    assert torch.serialization.get_crc32_options() is True
    store.commit(5, _meta(5), keep=1, parts=parts)
    assert torch.equal(store.read_tensors(5, "model-0000.pt")["w"], torch.full((64,), 3.0))


def _save_sharded(store: CheckpointStore, step: int, state: dict) -> list[dict]:
    """Begin checkpoint `step` and write `state` into it through DCP, in a world of one;
    returns the records of the files written (not committed)."""
    import torch.distributed as dist

    from baton.checkpoint import sharded

    store.begin(step)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return sharded.save(state, store.shards(step))
    finally:
        dist.destroy_process_group()


def test_a_sharded_checkpoint_records_its_files_as_dcp_writes_them(tmp_path):
    """DCP's files (each worker's shards and the index) are counted and checksummed on their
    way to the disk, not read back: every record matches the file, none is missing, and a
    flipped byte in a shard fails verification."""
    store = CheckpointStore(str(tmp_path / "job"))
    records = _save_sharded(store, 3, {"model": {"w": torch.randn(1000), "b": torch.arange(7.0)}})
    shards = tmp_path / "job" / "step_00000003" / "shards"
    assert sorted(r["name"] for r in records) == sorted(f"shards/{f.name}" for f in shards.iterdir())
    for r in records:
        assert r == {"name": r["name"], **storage.file_record(store.fs, f"{store.step_dir(3)}/{r['name']}")}
    store.commit(3, {"step": 3, "layout": {"dp": 1, "pp": 1, "shard": "full"}}, keep=1, parts=records)
    assert store.latest_verified() == (3, [])
    _flip(next(f for f in shards.iterdir() if f.suffix == ".distcp"))
    assert store.latest_verified()[0] is None


def test_keep_1_never_deletes_the_only_good_checkpoint(tmp_path):
    """v0.5 committed a checkpoint with no parts and, at keep 1, deleted the good one."""
    store = CheckpointStore(str(tmp_path / "job"))
    store.commit(5, _meta(5), keep=1, parts=_write(store, 5))
    store.begin(10)
    with pytest.raises(CheckpointError):
        store.commit(10, _meta(10), keep=1, parts=[])
    assert store.latest_verified() == (5, [])


class _Outage(pafs.FileSystemHandler):
    """This machine's disk, whose reads of a file's bytes fail (an OSError, as an object
    store's outage or a lost mount makes them) while `failures` is above 0, one per read:
    the opening of a stream, or a read from a file open for random access (as an object
    store drops a connection halfway through a shard)."""

    def __init__(self):
        self.disk, self.failures, self.reads = pafs.LocalFileSystem(), 0, 0

    def fail(self, path):
        self.reads += 1  # each a request of its own on an object store
        if self.failures:
            self.failures -= 1
            raise OSError(f"When reading {path}: connection reset by peer")

    def open_input_stream(self, path):
        self.fail(path)
        return self.disk.open_input_stream(path)

    def open_input_file(self, path):
        import pyarrow as pa

        outage, disk = self, open(path, "rb")

        class Dropping:  # a file whose reads fail while the outage lasts
            closed = False

            def read(self, n=-1):
                outage.fail(path)
                return disk.read(n)

            def seek(self, offset, whence=0):
                return disk.seek(offset, whence)

            def tell(self):
                return disk.tell()

            def close(self):
                disk.close()
                self.closed = True

        return pa.PythonFile(Dropping(), mode="r")

    def get_type_name(self): return "outage"
    def normalize_path(self, path): return path
    def equals(self, other): return other is self
    def get_file_info(self, paths): return self.disk.get_file_info(paths)
    def get_file_info_selector(self, selector): return self.disk.get_file_info(selector)
    def create_dir(self, path, recursive): self.disk.create_dir(path, recursive=recursive)
    def delete_dir(self, path): self.disk.delete_dir(path)
    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.disk.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)
    def delete_root_dir_contents(self): raise OSError("not here")
    def delete_file(self, path): self.disk.delete_file(path)
    def move(self, src, dest): self.disk.move(src, dest)
    def copy_file(self, src, dest): self.disk.copy_file(src, dest)
    def open_output_stream(self, path, metadata): return self.disk.open_output_stream(path)
    def open_append_stream(self, path, metadata): return self.disk.open_append_stream(path)


def test_a_failed_read_is_tried_again_and_an_outage_sets_no_checkpoint_aside(tmp_path, monkeypatch):
    """A checkpoint is set aside (REJECTED, never loaded again) only for what was read from
    it. A read the store failed is tried again (`storage.retried`); when the store stays away,
    the verification stops with `StoreUnavailable` and judges nothing."""
    monkeypatch.setattr(storage, "READ_FIRST_WAIT_S", 0.01)
    store = CheckpointStore(str(tmp_path / "job"))
    for step in (5, 10):
        store.commit(step, _meta(step), keep=2, parts=_write(store, step))
    outage = _Outage()
    store.fs = pafs.PyFileSystem(outage)
    outage.failures = 3  # meta.json's read fails three times, the fourth try reads it
    assert store.latest_verified() == (10, []) and outage.failures == 0
    parts = store.recorded_parts(10)
    outage.failures = 3  # a worker's share: the first part, likewise
    assert store.check_sums(10, parts) is None and outage.failures == 0

    outage.failures = 10**6  # the store is gone
    with pytest.raises(StoreUnavailable, match=r"could not read .*step_00000010/meta.json \(4 tries\): "
                                               r"OSError: .*connection reset by peer"):
        store.latest_verified()
    with pytest.raises(StoreUnavailable, match=r"could not read .*step_00000010/model-0000.pt"):
        store.check_sums(10, parts)
    outage.failures = 0  # back: nothing was set aside, checkpoint 10 is still the latest
    assert not (tmp_path / "job" / "step_00000010" / "REJECTED").exists()
    assert store.latest_verified() == (10, [])


def test_a_sharded_load_reads_an_object_store_in_few_requests(tmp_path):
    """DCP reads each tensor with `torch.load` on a view of its file, a zip archive read in
    small pieces; on an object store each piece was a request (8,528 GETs to resume a 2-layer
    GPT's checkpoint from moto's S3 server: 64 s for a run of one step, 12.6 s now). Through
    storage.RetryingInput's window, 60 small tensors and a large one in a file of 1.5 MB are
    a handful of reads (measured: 7, the index twice and the shards' file 5 times; 1,291 read
    piece by piece)."""
    store = CheckpointStore(str(tmp_path / "job"))
    state = {"model": {f"w{i}": torch.randn(8, 100) for i in range(60)}}
    state["model"]["big"] = torch.randn(300_000)  # 1.2 MB: read in a request of its own
    records = _save_sharded(store, 2, state)
    store.commit(2, {"step": 2, "layout": {"dp": 1, "pp": 1, "shard": "full"}}, keep=1, parts=records)
    counted = _Outage()
    store.fs = pafs.PyFileSystem(counted)
    got = store.read_model(2)
    assert all(torch.equal(got[k], v) for k, v in state["model"].items()) and len(got) == 61
    assert counted.reads <= 8, counted.reads


def test_random_reads_through_the_window_return_the_files_bytes(tmp_path, monkeypatch):
    """storage.RetryingInput against the file itself, with a 64-byte window so that reads fall
    inside it, across its edge, past it (a request of their own) and past the end; a store
    failing on and off underneath changes nothing."""
    import random

    monkeypatch.setattr(storage, "READ_WINDOW_BYTES", 64)
    monkeypatch.setattr(storage, "READ_FIRST_WAIT_S", 0.001)
    data = random.Random(0).randbytes(1000)
    (tmp_path / "f").write_bytes(data)
    outage = _Outage()
    f = storage.RetryingInput(pafs.PyFileSystem(outage), str(tmp_path / "f"))
    rng = random.Random(1)
    for i in range(300):
        outage.failures = i % 3  # a request may fail twice and succeed on its third try
        at, n = rng.randrange(1100), rng.choice([1, 7, 40, 63, 64, 65, 200])
        whence = rng.choice([os.SEEK_SET, os.SEEK_END])
        f.seek(at - 1000 if whence == os.SEEK_END else at, whence)
        assert f.tell() == at
        if i % 2:
            got = f.read(n)
        else:
            buf = bytearray(n)
            got = bytes(buf[:f.readinto(buf)])
        assert got == data[at:at + n] and f.tell() == at + len(got), (at, n)
    f.seek(10)
    assert f.read() == data[10:] and f.read() == b""
    with pytest.raises(ValueError, match="negative seek position"):
        f.seek(-1)
    f.close()


def test_a_load_tries_a_failed_read_again(tmp_path, monkeypatch):
    """Loading reads as verification does: a read the store failed is tried again, for the
    per-stage files (each read whole) and for a sharded checkpoint's index and shards (DCP
    seeks and reads in them: the file is opened again and read on from where it failed)."""
    monkeypatch.setattr(storage, "READ_FIRST_WAIT_S", 0.01)
    store = CheckpointStore(str(tmp_path / "job"))
    store.commit(5, _meta(5), keep=2, parts=_write(store, 5, value=5.0))
    state = {"model": {"w": torch.randn(1000), "b": torch.arange(7.0)}}
    records = _save_sharded(store, 6, state)
    store.commit(6, {"step": 6, "layout": {"dp": 1, "pp": 1, "shard": "full"}}, keep=2, parts=records)
    outage = _Outage()
    store.fs = pafs.PyFileSystem(outage)

    outage.failures = 3  # the whole read of model-0000.pt fails three times
    assert torch.equal(store.read_model(5, 1)["w"], torch.full((64,), 5.0)) and outage.failures == 0
    outage.failures = 3
    assert store.read_meta(5)["step"] == 5 and outage.failures == 0
    for failures in (1, 2, 3):  # reads inside the index and the shards, failing on and off
        outage.failures = failures
        got = store.read_model(6)
        assert torch.equal(got["w"], state["model"]["w"]) and torch.equal(got["b"], state["model"]["b"])
        assert outage.failures == 0
    outage.failures = 10**6  # the store is gone: named, not a verdict on the checkpoint
    with pytest.raises(StoreUnavailable, match=r"could not read .*step_00000006/shards/.* \(4 tries\)"):
        store.read_model(6)


def test_resume_goes_back_past_damage_and_refuses_when_nothing_verifies(tmp_path):
    from baton.api import plan_resume
    from baton.spec import spec_from_dict
    from helpers import tiny_spec

    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path, train={"steps": 20}))
    store = CheckpointStore(spec.checkpoint_dir)
    for step in (4, 8):
        meta = {"job": "tiny", "step": step, "fingerprint": spec.fingerprint(), "layout": {"pp": 1}}
        store.commit(step, meta, keep=2, parts=_write(store, step))
    os.truncate(f"{store.step_dir(8)}/optim-0000.pt", 10)
    meta, failed = plan_resume(spec, "job.yaml", None)
    assert meta["step"] == 4 and [s for s, _ in failed] == [8]
    os.truncate(f"{store.step_dir(4)}/optim-0000.pt", 10)
    with pytest.raises(CheckpointError, match=r"job.yaml: no checkpoint in .* verifies \(checkpoint 8: "
                                              r"part optim-0000.pt is 10 bytes.*checkpoint 4: .*move the "
                                              r"folder aside to start over"):
        plan_resume(spec, "job.yaml", None)


# -- one writer per job ---------------------------------------------------------------------

_HOLD = """
import sys, time
from baton.checkpoint.lease import Lease
lease = Lease(sys.argv[1], settle_s=0.2, heartbeat_s=0.2)
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(root):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, root], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_naming_the_holder_until_it_dies(tmp_path):
    root = str(tmp_path / "job")
    proc = _holder(root)
    try:
        t0 = time.monotonic()
        with pytest.raises(CheckpointError) as e:
            Lease(root).acquire()
        assert time.monotonic() - t0 < 1  # refused at once, not after a wait
        assert f"host {socket.gethostname()}, pid {proc.pid}, since 20" in str(e.value)
        assert "in use by another run of this job" in str(e.value) and "\n" not in str(e.value)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with Lease(root) as lease:  # the kernel dropped the dead holder's lock: free at once
        assert json.loads((tmp_path / "job" / "LEASE").read_text())["pid"] == os.getpid()
        with pytest.raises(CheckpointError):
            Lease(root).acquire()
        lease.check()
    assert not (tmp_path / "job" / "LEASE").exists()  # released
    lease = Lease(str(tmp_path / "fresh" / "job"))
    lease.acquire()
    lease.release()
    assert not (tmp_path / "fresh").exists()  # folders it created, left empty, go too


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(tmp_path):
    """checkpoint.path under a file (or anywhere the run may not write) used to end `baton
    run` in pyarrow's traceback from the lease; now it is one line, and nothing is made."""
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match=r"^checkpoint.path: cannot make .*a-file/ckpt/job "
                                              r"\(\w+Error: .*\); give a folder this run may write$"):
        Lease(str(tmp_path / "a-file" / "ckpt" / "job")).acquire()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_an_object_store_that_does_not_answer_is_one_line_before_ray(tmp_path):
    """checkpoint.path or data.path on an S3 endpoint nobody listens on (a wrong address, a
    proxy down) ended `baton run` in pyarrow's traceback from the first listing; now each is
    one line naming the key and the store, before Ray starts. The credentials in the URI are
    not in it."""
    from baton import api
    from baton.data.source import preflight
    from baton.errors import SpecError
    from baton.spec import spec_from_dict
    from helpers import free_ports, tiny_spec, write_dataset

    [port] = free_ports(1)  # closed: connections to it are refused at once
    store = f"s3://user:s3cr3t@nowhere/x?endpoint_override=127.0.0.1:{port}&scheme=http"
    data = write_dataset(tmp_path / "data", 16, 8)
    spec = spec_from_dict(tiny_spec(tmp_path, data, checkpoint={"path": store}))
    with pytest.raises(CheckpointError, match=r"^job.yaml: checkpoint.path: cannot read s3://\*\*\*@"
                                              r"nowhere/x/tiny\?\S+ \(OSError: .+\); check its "
                                              r"address and credentials$") as e:
        api.plan_resume(spec, "job.yaml", None)
    assert "s3cr3t" not in str(e.value)
    spec = spec_from_dict(tiny_spec(tmp_path, data, data={"path": store}))
    with pytest.raises(SpecError, match=r"^job.yaml: data.path: cannot read 's3://\*\*\*@nowhere/x"
                                        r"\?\S+' \(OSError: .+\); check its address and "
                                        r"credentials$") as e:
        preflight(spec, "job.yaml")
    assert "s3cr3t" not in str(e.value) and "\n" not in str(e.value)


def test_the_lease_on_object_storage(tmp_path, s3_endpoint):
    """On a real S3 endpoint: a second writer is refused; a holder that stops renewing is taken
    over after ttl_s, with a warning; the old holder then finds it has lost the lease and
    refuses to commit."""
    fs, _ = pafs.FileSystem.from_uri(f"s3://leases?{s3_endpoint}&allow_bucket_creation=true")
    fs.create_dir("leases")
    root = f"s3://leases/job?{s3_endpoint}"
    first = Lease(root, ttl_s=1.5, heartbeat_s=0.2, settle_s=0.2)
    first.acquire()
    with pytest.raises(CheckpointError, match=f"in use by another run of this job .*pid {os.getpid()}"):
        Lease(root, settle_s=0.2).acquire()
    first.stop.set()  # the holder freezes: no more heartbeats
    first.beat.join()
    time.sleep(1.6)
    warnings = []
    second = Lease(root, ttl_s=1.5, heartbeat_s=0.2, settle_s=0.2, warn=warnings.append)
    second.acquire()
    assert len(warnings) == 1 and "taking over the lease" in warnings[0] and "no heartbeat for" in warnings[0]
    assert first.renew() is False  # the frozen holder wakes: its heartbeat finds the new holder
    with pytest.raises(CheckpointError, match="lost the lease on .* to host"):
        first.check()
    second.release()
    assert not any(i.base_name == "LEASE" for i in fs.get_file_info(pafs.FileSelector("leases/job")))


def test_the_rendezvous_port_is_held_from_its_choice_to_the_group_forming(tmp_path):
    """Rank 0 used to bind port 0, close it and hand the number on: another process could take
    the port before the group formed. Now the group's store holds it from the start."""
    from datetime import timedelta

    import torch.distributed as dist

    from baton.spec import spec_from_dict
    from baton.workers.worker import Worker
    from helpers import tiny_spec, write_dataset

    spec = spec_from_dict(tiny_spec(tmp_path, write_dataset(tmp_path / "data", 8, 32)))
    worker = Worker(spec, spec.dims(), 0)
    ip, port = worker.rendezvous_address()
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind((ip, port))  # what a process racing for the port would do
    # rank 1 joins through it, as Worker.setup does (setup itself needs a Ray actor)
    peer = dist.TCPStore(ip, port, 2, is_master=False, timeout=timedelta(seconds=10))
    peer.set("joined", "1")
    assert worker.master_store.get("joined") == b"1"
