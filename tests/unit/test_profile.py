"""How much of a step's gradient communication ran beside its compute (baton.tracking.profile),
read from Chrome traces shaped as torch.profiler writes them."""

from __future__ import annotations

import pytest

from baton.tracking.profile import comm_overlap


def _x(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}


def test_cpu_all_reduce_half_inside_the_backward():
    trace = {"traceEvents": [
        _x("autograd::engine::evaluate_function: AddmmBackward0", 0, 60),
        _x("autograd::engine::evaluate_function: AddmmBackward0", 50, 50),  # nested/overlapping: one interval
        _x("gloo:all_reduce", 80, 40, tid=2),  # 20 of its 40 us inside [0, 100]
        _x("DistributedDataParallel.forward", -200, 150),  # the forward is not the backward
        _x("gloo:broadcast", 0, 500, tid=2),  # not gradient communication
    ]}
    assert comm_overlap(trace) == pytest.approx(0.5)


def test_gpu_nccl_kernels_against_the_other_kernels():
    trace = {"traceEvents": [
        _x("ampere_sgemm_128x64_nn", 0, 100, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 10, 20, cat="kernel"),  # all inside
        _x("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 150, 50, cat="kernel"),  # none
        _x("autograd::engine::evaluate_function: MmBackward0", 150, 50),  # host side: not compute on a GPU
    ]}
    assert comm_overlap(trace) == pytest.approx(20 / 70)


def test_a_world_of_one_has_no_overlap_to_report():
    assert comm_overlap({"traceEvents": [_x("autograd::engine::evaluate_function: X", 0, 10)]}) is None
    assert comm_overlap({}) is None
