"""The GPU path: NCCL process groups and CUDA tensors. Skipped where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from baton import api
from baton.checkpoint import CheckpointStore
from baton.spec import spec_from_dict
from helpers import reference_run, tiny_spec, write_dataset

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("local_ray")]


def _gpu_spec(tmp_path, data, **train):
    dp = min(2, torch.cuda.device_count())  # NCCL needs a device per rank
    return spec_from_dict(tiny_spec(
        tmp_path, data, name=f"gpu-{train.get('precision', 'fp32')}",
        parallel={"dp": dp}, resources={"cpus_per_worker": 1, "gpus_per_worker": 1},
        train={"global_batch": 8, "micro_batch": 8 // (2 * dp) or 1, **train}))


def test_nccl_on_cuda_matches_the_cpu_reference(tmp_path):
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = _gpu_spec(tmp_path, data, steps=3)
    result = api.run(spec, show_progress=False)
    assert {w["backend"] for w in result.workers} == {"nccl"}
    assert all(w["device"].startswith("cuda") for w in result.workers)
    assert len(set(result.replica_digests)) == 1
    got = CheckpointStore(spec.checkpoint_dir).read_model(3)
    want, _, _ = reference_run(spec, data, steps=3)
    for name, ref in want.items():  # CUDA kernels sum in another order than the CPU's
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-4, msg=name)


def test_bf16_training_learns(tmp_path):
    data = write_dataset(tmp_path / "data", 512, 32)
    spec = _gpu_spec(tmp_path, data, steps=40, precision="bf16", lr=3e-3, min_lr=3e-3)
    result = api.run(spec, show_progress=False)
    assert result.state == "finished" and result.loss < 4.0  # from ln 256 = 5.55


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a pipeline over NCCL needs 2 GPUs")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_pipeline_over_nccl_matches_the_cpu_reference(tmp_path, schedule):
    data = write_dataset(tmp_path / "data", 64, 32)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name=f"gpu-pp-{schedule}",
        parallel={"dp": 1, "pp": 2, "schedule": schedule, "microbatches": 4},
        resources={"cpus_per_worker": 1, "gpus_per_worker": 1},
        train={"global_batch": 8, "micro_batch": None}))
    result = api.run(spec, show_progress=False)
    assert {w["backend"] for w in result.workers} == {"nccl"}
    got = CheckpointStore(spec.checkpoint_dir).read_model(3)
    want, _, _ = reference_run(spec, data, steps=3)
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-4, msg=name)
