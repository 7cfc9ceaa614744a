"""Pipeline parallelism on a local Ray with gloo: gradients, training and checkpoints match one
process, for every schedule, uneven stages and micro-batch counts, and dp x pp meshes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient

from baton import api
from baton.checkpoint import CheckpointStore
from baton.data import Cursor
from baton.parallel import ParallelDims
from baton.models import build_model
from baton.parallel.partition import plan_stages
from baton.parallel.tensor import split_layers
from baton.spec import spec_from_dict
from baton.workers import WorkerGroup
from baton.parallel.mesh import split_micro
from helpers import (assert_like_one_process, assert_params_close, batch_in_store, job_order, read_table,
                     reference_grads, reference_run, tiny_spec, write_dataset)

pytestmark = pytest.mark.usefixtures("local_ray", "warm_workers")

GPT = {"name": "gpt", "layers": 2, "width": 32, "heads": 2, "seq_len": 32}  # 4 layers


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("pp") / "data", num_samples=64, seq_len=32)


# (schedule, dp, pp, microbatches per replica, global batch, model, chunks[, partition])
CASES = [
    ("gpipe", 1, 2, 4, 8, GPT, None),
    ("1f1b", 1, 2, 3, 6, GPT, None),  # m not a multiple of p
    ("1f1b", 1, 3, 4, 8, {**GPT, "layers": 5}, None),  # 7 layers on 3 stages: 2, 2, 3
    ("1f1b", 1, 3, 4, 8, {**GPT, "layers": 5}, None, [3, 1, 3]),  # an explicit cut
    ("gpipe", 1, 4, 5, 10, GPT, None),
    ("1f1b", 1, 4, 6, 6, GPT, None),
    ("interleaved-1f1b", 1, 2, 4, 8, GPT, 2),
    ("interleaved-1f1b", 1, 2, 3, 6, {**GPT, "layers": 4}, 2),  # m odd, 6 layers on 4 chunks
    ("interleaved-1f1b", 1, 3, 4, 8, {**GPT, "layers": 4}, 2),
    ("1f1b", 2, 2, 2, 8, GPT, None),  # dp x pp = 2 x 2
    ("interleaved-1f1b", 2, 2, 2, 8, GPT, 2),
    ("1f1b", 1, 2, 4, 8, {"name": "mlp", "layers": 3, "width": 64, "context": 4, "seq_len": 32}, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-dp{c[1]}-pp{c[2]}-m{c[3]}-{c[5]['name']}{c[5]['layers']}" + (f"-{c[7]}" if len(c) > 7 else ""))
def test_gradients_match_single_process(tmp_path, data, case):
    schedule, dp, pp, m, global_batch, model, chunks, *partition = case
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="grads", model=model,
        train={"global_batch": global_batch, "micro_batch": None},
        parallel={"dp": dp, "pp": pp, "schedule": schedule, "microbatches": m,
                  "chunks": chunks, "timeout_s": 60, "partition": (partition or ["params"])[0]},
        resources={"cpus_per_worker": 0.25}))
    ids, tokens = read_table(data)
    batch = job_order(spec, data).next_batch(Cursor(), global_batch)
    group, results = WorkerGroup(spec, ParallelDims(dp, pp)), None
    try:
        group.place()
        stage_layers = plan_stages(spec, lambda: group.call_one(0, "profile_layers"))
        group.setup(False, stage_layers)
        results = group.call("gradients", batch_in_store(ids, tokens, batch))
    finally:
        group.shutdown(finished=results is not None)  # warm for the next case (warm_workers)
    want, want_loss = reference_grads(spec, tokens, batch)
    dims = ParallelDims(dp, pp)
    for d in range(dp):  # every replica of every stage holds the whole batch's gradient
        got = {}
        for rank in dims.pp_group(d):
            assert not set(got) & set(results[rank]["grads"])  # stages do not overlap
            got.update(results[rank]["grads"])
        assert got.keys() == want.keys()
        for name, ref in want.items():
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=4e-5, msg=name)
    loss = sum(r["loss_sum"] for r in results) / sum(r["tokens"] for r in results)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert sum(ref.abs().sum().item() > 0 for ref in want.values()) == len(want)  # all nonzero


def test_pp2_trains_like_one_process_and_records_its_timeline(tmp_path, data):
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="pp2", train={"steps": 3, "global_batch": 8, "micro_batch": None},
        parallel={"dp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 4},
        tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tests",
                  "trace_step": 2}))
    result = api.run(spec, show_progress=False)
    assert result.state == "finished" and result.stage_layers == [2, 2]
    assert_like_one_process(spec, data, result, steps=3)
    client = MlflowClient(spec.tracking.uri)
    bubbles = [m.value for m in client.get_metric_history(result.run_id, "pipeline_bubble")]
    assert len(bubbles) == 3 and all(0 < b < 1 for b in bubbles)
    # the traced step: every forward and backward of every micro-batch on both stages
    assert result.trace["step"] == 2
    for dp_rank, pp_rank, events in result.trace["lanes"]:
        compute = sorted((k, mb) for k, mb, *_ in events if k in "FB")
        assert compute == sorted((k, mb) for k in "FB" for mb in range(4))
        assert all(t1 >= t0 for k, _, _, t0, t1 in events if t1 is not None)
    arts = {a.path for a in client.list_artifacts(result.run_id, "pipeline/step_000002")}
    assert arts == {"pipeline/step_000002/trace.json", "pipeline/step_000002/swimlane.png"}
    png = client.download_artifacts(result.run_id, "pipeline/step_000002/swimlane.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_documents_kept_apart_train_as_one_process_in_ddp_and_through_pipeline_stages(tmp_path, data):
    """data.document_mask, a line of the stdlib rows a document (eod_token 10, a newline:
    about one a row of 32 tokens): the GPT at dp 2 under DDP, then the llama at pp 2 (1F1B
    over 4 micro-batches, its blocks checkpointed: stage 0 recomputes micro-batch 0's forward
    in its backward after micro-batch 1's forward; stage 1's blocks see no tokens and turn
    each position by its place in its line): one process's numbers, and not those of the
    same job unmasked."""
    import dataclasses

    llama = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
             "options": {"kv_heads": 2}}
    for name, model, parallel, train in (
            ("docs-dp", GPT, {"dp": 2}, {"micro_batch": 2}),
            ("docs-pp", llama, {"dp": 1, "pp": 2, "schedule": "1f1b", "microbatches": 4},
             {"micro_batch": None, "activation_checkpointing": "blocks"})):
        spec = spec_from_dict(tiny_spec(
            tmp_path, data, name=name, model=model, data={"document_mask": True, "eod_token": 10},
            train={"steps": 2, "global_batch": 8, **train}, parallel={**parallel, "timeout_s": 60}))
        result = api.run(spec, show_progress=False)
        assert result.state == "finished"
        # measured: 3.0e-7 (DDP) and 1.3e-6 (pp 2) at most; the default bound holds
        got, want = assert_like_one_process(spec, data, result, steps=2)
        unmasked = dataclasses.replace(spec, data=dataclasses.replace(
            spec.data, document_mask=False, eod_token=None))
        other, _, _ = reference_run(unmasked, data, 2)
        assert max(float((got[k] - other[k]).abs().max()) for k in got) > 1e-3


def test_checkpoint_moves_between_layouts(tmp_path, data):
    """Written at (dp 1, pp 2), loaded at (dp 2, pp 1), then at (dp 1, pp 4): the same
    parameters as four uninterrupted steps of one process. (Four, not more: the attention
    key bias has an exactly zero gradient, so AdamW turns rounding noise into lr-sized
    steps there, and even two single-process runs that sum in another order drift past the
    tolerance by step 6.)"""
    base = tiny_spec(tmp_path, data, name="relayout",  # constant lr: steps may grow per phase
                     train={"steps": 2, "global_batch": 8, "micro_batch": None,
                            "schedule": "constant"},
                     parallel={"dp": 1, "pp": 2, "microbatches": 4},
                     checkpoint={"path": str(tmp_path / "ckpt"), "every_steps": 1, "keep": 3})
    layouts = [({"dp": 1, "pp": 2, "microbatches": 4}, 2),
               ({"dp": 2, "pp": 1, "microbatches": 2}, 3),
               ({"dp": 1, "pp": 4, "microbatches": 4, "schedule": "gpipe"}, 4)]
    resumed = [None, 2, 3]
    for (parallel, steps), resumed_from in zip(layouts, resumed):
        spec = spec_from_dict({**base, "parallel": {**parallel, "timeout_s": 60},
                               "train": {**base["train"], "steps": steps}})
        result = api.run(spec, show_progress=False)
        assert result.step == steps and result.resumed_from == resumed_from
    store = CheckpointStore(spec.checkpoint_dir)
    assert [store.read_meta(s)["layout"]["pp"] for s in (2, 3, 4)] == [2, 1, 4]
    got = store.read_model(4)
    want, _, _ = reference_run(spec, data, steps=4)
    assert_params_close(got, want, rtol=1e-5, atol=4e-5)


def test_every_sample_once_through_a_pipeline(tmp_path):
    # 37 samples, batches of 8: the last batch of the epoch has 5, split 3 + 2 across the
    # replicas and padded inside fixed-size micro-batches
    data = write_dataset(tmp_path / "data", num_samples=37, seq_len=32)
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="pp-ledger", train={"steps": 6, "global_batch": 8, "micro_batch": None},
        parallel={"dp": 2, "pp": 2, "microbatches": 2, "schedule": "gpipe", "partition": "time"},
        resources={"cpus_per_worker": 0.25}, checkpoint={"every_steps": 100}))
    result = api.run(spec, record_samples=True, show_progress=False)
    # cut by measured time (at this size, microseconds: the cut itself is noise, its shape not)
    assert len(result.stage_layers) == 2 and sum(result.stage_layers) == 4
    assert min(result.stage_layers) >= 1
    epoch0 = Counter(i for step, _, ids in result.ledger if step < 5 for i in ids)
    assert sorted(epoch0) == list(range(1000, 1037)) and set(epoch0.values()) == {1}
    assert {rank for _, rank, _ in result.ledger} == {0, 1}  # the first stage of each replica
    assert np.isfinite(result.loss)


# parallel.grad_comm: bf16 through each path that reduces gradients: DDP's communication hook,
# the pipeline's own all-reduce, FSDP2's reduce dtype; under tensor parallelism over the
# workers holding one share (each tp worker's gradients joined into the whole here)
@pytest.mark.parametrize("dp,pp,shard,tp", [(2, 1, "none", 1), (2, 2, "none", 1), (2, 1, "full", 1),
                                            (2, 1, "none", 2)],
                         ids=["ddp", "pipeline", "zero3", "ddp-tp2"])
def test_bf16_gradient_communication_is_within_bf16_rounding(tmp_path, data, dp, pp, shard, tp):
    spec = spec_from_dict(tiny_spec(
        tmp_path, data, name="bf16-comm", model=GPT, train={"global_batch": 8, "micro_batch": None},
        parallel={"dp": dp, "pp": pp, "tp": tp, "microbatches": 2, "shard": shard,
                  "grad_comm": "bf16", "timeout_s": 60}, resources={"cpus_per_worker": 0.25}))
    ids, tokens = read_table(data)
    batch = job_order(spec, data).next_batch(Cursor(), 8)
    group, results = WorkerGroup(spec, spec.dims()), None
    try:
        group.place()
        group.setup(False, plan_stages(spec, lambda: group.call_one(0, "profile_layers")))
        results = group.call("gradients", batch_in_store(ids, tokens, batch))
    finally:
        group.shutdown(finished=results is not None)  # warm for the next case (warm_workers)
    want, _ = reference_grads(spec, tokens, batch)
    dims = spec.dims()
    # each micro-batch's part of the gradient, in fp32
    parts = []
    for d in range(dp):
        for rows in split_micro(dims.replica_part(batch, d), 2):
            part, _ = reference_grads(spec, tokens, rows)
            parts.append({n: g * len(rows) / len(batch) for n, g in part.items()})
    got = {}
    for rank in dims.pp_group(0):
        got.update(results[rank]["grads"])
    if tp > 1:  # the split parameters' whole gradients, from replica 0's tp workers' shares
        splits = split_layers(build_model(spec.model, 0), 0, tp, None)
        for name, split in splits.items():
            got[name] = split.join([results[r]["grads"][name] for r in dims.tp_group(0)])
    worst, moved = 0.0, 0
    for name, ref in want.items():
        # bf16 keeps 8 significant bits (unit roundoff u = 2^-8). Each rounding adds at most u
        # of what is summed so far: a replica's part rounded, the parts' sum rounded (DDP's hook,
        # the pipeline's all-reduce), and under FSDP2 the micro-batches' sum too (it keeps an
        # accumulated gradient in the reduce dtype): at most 3 roundings, so |got - sum| <=
        # 3.01 u (the micro-batch parts' absolute sum); plus 1e-6 of it for fp32's own order.
        # Measured: at most 1.85 u (DDP), 1.85 u (pipeline), 2.03 u (ZeRO-3), 1.82 u (DDP
        # under tp 2) of that size, where it is above 1e-6 (printed with pytest -s)
        size = sum(p[name].abs() for p in parts)
        err = (got[name] - ref).abs()
        big = size > 1e-6
        ratio = float((err[big] / size[big]).max()) / 2 ** -8 if big.any() else 0.0
        worst, moved = max(worst, ratio), moved + bool((err > 0).any())
        assert bool((err <= (3.01 * 2 ** -8 + 1e-6) * size + 1e-9).all()), (name, ratio)
    print(f"largest bf16 communication error: {worst:.3g} u of the parts' size (bound 3.01 u)")
    assert moved > len(want) // 2  # bf16 really was on the wire
