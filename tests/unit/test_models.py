"""Models: shapes, causality, the registry, and the learning-rate schedule."""

from __future__ import annotations

import pytest
import torch

from baton.models import build_model, check_model_name
from baton.spec import ModelSpec, TrainSpec


@pytest.mark.parametrize("name", ["gpt", "llama", "mlp"])
def test_causal_language_model(name):
    spec = ModelSpec(name=name, layers=2, width=32, heads=2, seq_len=16, context=4)
    model = build_model(spec, seed=0).eval()
    x = torch.randint(0, 256, (2, 16))
    y = model(x)
    assert y.shape == (2, 16, 256)
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256  # change the future ...
    assert torch.allclose(model(x2)[:, :10], y[:, :10], atol=1e-6)  # ... the past is unchanged
    assert not torch.allclose(model(x2)[:, 10:], y[:, 10:])


def test_same_seed_same_parameters():
    spec = ModelSpec(layers=1, width=16, heads=2, seq_len=8)
    a, b, c = build_model(spec, 3), build_model(spec, 3), build_model(spec, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


def test_a_builder_that_cannot_build_on_meta_has_no_flops_and_its_steps_no_mfu():
    """The driver counts FLOPs on the meta device; a user's builder that needs real tensors
    there used to end the run in its traceback before any worker started. Now the run goes on
    without MFU (the workers build it on their devices)."""
    from baton.coordinator.steps import StepStats
    from baton.models.flops import model_flops_per_token
    from baton.spec import spec_from_dict

    spec = spec_from_dict({"name": "t", "model": {"name": "helpers:not_on_meta", "layers": 1,
                                                   "width": 16, "heads": 2, "seq_len": 8},
                           "tracking": {"cpu_peak_tflops": 0.05}})
    assert model_flops_per_token(spec.model) is None
    build_model(spec.model, 0)  # on the CPU it builds
    stats = StepStats(spec)
    stats.world([{"device_name": "cpu"}], spec)
    assert stats.peak_flops
    dims = type("Dims", (), {"world_size": 1, "dp": 1, "pp": 1})()
    metrics = stats.measure(1, [{"tokens": 8, "loss_sum": 8.0, "grad_norm": 1.0}], 0.1, 1,
                            1e-3, 0, dims)
    assert "mfu" not in metrics and metrics["loss"] == 1.0


def test_registry_names():
    assert all(check_model_name(name) is None for name in ("gpt", "llama", "mlp"))
    assert check_model_name("baton.models.gpt:build_gpt") is None
    assert "use one of" in check_model_name("resnet")
    assert "module 'baton.models.gpt' has no 'nope'" == check_model_name("baton.models.gpt:nope")


def test_lr_schedule_warms_up_then_decays_to_min():
    t = TrainSpec(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    lrs = [t.lr_at(s) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[99] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    const = TrainSpec(steps=100, lr=0.5, warmup_steps=0, schedule="constant")
    assert {const.lr_at(s) for s in range(100)} == {0.5}
    linear = [TrainSpec(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10, schedule="linear").lr_at(s)
              for s in range(100)]
    assert linear[:10] == pytest.approx(lrs[:10]) and linear[99] == pytest.approx(0.1)
    assert linear[10:] == pytest.approx([1.0 - 0.9 * k / 89 for k in range(90)])


def test_wsd_holds_the_rate_then_decays_as_one_minus_the_square_root(tmp_path):
    """warmup-stable-decay: the warm-up, lr until the last `decay_steps`, then 1 - sqrt of
    the decay's progress down to min_lr at the last step; raising train.steps (a run trained
    on) before the decay starts changes none of the rates already used."""
    t = TrainSpec(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd", decay_steps=20)
    lrs = [t.lr_at(s) for s in range(100)]
    # (approx: pytest's default 1e-6 relative; the formulas are the same maths in another
    # order, which differed here by at most 1.7e-16, linear included)
    assert lrs[:10] == pytest.approx([0.1 * (s + 1) for s in range(10)])
    assert lrs[10:80] == [1.0] * 70
    assert lrs[80:] == pytest.approx([0.1 + 0.9 * (1 - (k / 19) ** 0.5) for k in range(20)])
    assert lrs[99] == pytest.approx(0.1) and all(a > b for a, b in zip(lrs[80:], lrs[81:]))
    longer = TrainSpec(steps=300, lr=1.0, min_lr=0.1, warmup_steps=10, schedule="wsd", decay_steps=20)
    assert [longer.lr_at(s) for s in range(80)] == lrs[:80] and longer.lr_at(279) == 1.0
    # without decay_steps the last fifth decays; the step count and decay length stay out of
    # the recipe, so either changes on resume
    assert TrainSpec(steps=100, schedule="wsd").wsd_decay_steps == 20
    from baton.spec import spec_from_dict
    from helpers import tiny_spec
    raw = tiny_spec(tmp_path, tmp_path / "data")
    wsd = {**raw, "train": {**raw["train"], "schedule": "wsd"}}
    assert (spec_from_dict(wsd).fingerprint()
            == spec_from_dict({**wsd, "train": {**wsd["train"], "decay_steps": 7, "steps": 70}}).fingerprint())
    assert spec_from_dict(raw).fingerprint() != spec_from_dict(wsd).fingerprint()


def test_the_attention_key_bias_changes_no_output():
    """Why parameter comparisons leave the key bias out (`helpers.assert_params_close`): it
    adds q.b to every key's score alike, and softmax is invariant to that. The query bias,
    beside it, does change the output."""
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="gpt", layers=2, width=32, heads=2, seq_len=32), seed=0)
    x = torch.randint(0, 256, (4, 32))
    before = model(x)
    with torch.no_grad():
        for block in model[1:-1]:
            w = block.qkv.bias.numel() // 3
            block.qkv.bias[w:2 * w] += torch.randn(w)
        keys_moved = model(x)
        model[1].qkv.bias[:4] += 1.0
    # measured over 5 seeds: 1.5e-7 at most (float32 rounding of the shifted scores); moving
    # 4 query biases by 1 moved the logits by 2.1e-3 to 4.4e-3
    torch.testing.assert_close(keys_moved, before, rtol=0, atol=1e-6)
    assert (model(x) - before).abs().max() > 1e-3


def test_fsdp_units_group_small_blocks_and_leave_large_ones_alone():
    """parallel.shard_unit_mib: consecutive blocks are gathered together until they hold that
    many MiB of fp32 parameters (fewer collectives for a small model: 0.61x -> 0.69x DDP's
    tokens/s for ZeRO-3 at dp 2 in benchmarks/sharding.py); 0 keeps every block alone."""
    from baton.models.gpt import build_gpt
    from baton.parallel.sharding import blocks, units

    gpt = build_gpt(layers=4, width=256, heads=4, seq_len=128, vocab_size=256)
    mib = [sum(p.numel() for p in b.parameters()) * 4 / 2**20 for b in blocks(gpt)]
    assert len(mib) == 6 and 3.0 < mib[1] < 3.1  # embedding, 4 blocks of 3.0 MiB, head
    assert [len(g) for g in units(gpt, 0)] == [1] * 6
    assert [len(g) for g in units(gpt, 16)] == [6]  # 12.7 MiB in all: one unit
    assert [len(g) for g in units(gpt, 5)] == [3, 2, 1]  # closed once it holds 5 MiB
    assert [m for g in units(gpt, 5) for m in g] == blocks(gpt)  # in order, each once


@pytest.mark.parametrize("level,pipeline_stage", [("full", False), ("full", True), ("grads", False)])
def test_zero3_keeps_the_last_unit_whole_for_the_backward_that_follows(level, pipeline_stage):
    """Under ZeRO-3 every FSDP unit frees its gathered parameters after its forward, except
    the last one of a data-parallel replica: its backward comes at once and would gather them
    again (0.69x -> see benchmarks/sharding.py). A pipeline stage's backward comes
    micro-batches later, so there every unit frees them; ZeRO-2 keeps them all."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from baton.models.gpt import build_gpt
    from baton.parallel.mesh import ParallelDims
    from baton.parallel.sharding import WRAPPINGS, blocks, shard_stages

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ParallelDims(dp=1).device_mesh("cpu", timeout_s=60)
        gpt = build_gpt(layers=3, width=32, heads=2, seq_len=8, vocab_size=256)
        if pipeline_stage:
            shard_stages([gpt], mesh, TrainSpec(), reshard_after_forward=True, unit_mib=0)
        else:
            WRAPPINGS[level](gpt, mesh, TrainSpec(), torch.device("cpu"), unit_mib=0)
        gpt(torch.randint(0, 256, (2, 8)))
        whole = [not isinstance(next(b.parameters()), DTensor) for b in blocks(gpt)]
        assert len(whole) == 5  # embedding, 3 blocks, head: a unit each
        expected = {("full", False): [False] * 4 + [True], ("full", True): [False] * 5,
                    ("grads", False): [True] * 5}[level, pipeline_stage]
        assert whole == expected
    finally:
        dist.destroy_process_group()


def test_zero3_keeps_the_first_unit_whole_between_accumulated_micro_batches():
    """The mirror of the last unit: a micro-batch's backward ends with the first unit, and the
    next micro-batch's forward begins with it, so while gradients accumulate (no_sync) ZeRO-3
    keeps the first unit whole; every other unit frees its parameters after its backward, and
    after the step's last backward all are free (with 8 micro-batches a replica at dp 2:
    0.69x -> 0.89x of DDP's tokens/s, docs/benchmarks.md)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from baton.models import loss_sum
    from baton.models.gpt import build_gpt
    from baton.parallel.mesh import ParallelDims
    from baton.parallel.sharding import WRAPPINGS, blocks

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ParallelDims(dp=1).device_mesh("cpu", timeout_s=60)
        gpt = build_gpt(layers=3, width=32, heads=2, seq_len=8, vocab_size=256)
        replica = WRAPPINGS["full"](gpt, mesh, TrainSpec(), torch.device("cpu"), unit_mib=0)
        batch = torch.randint(0, 256, (2, 9))

        def whole() -> list[bool]:
            return [not isinstance(next(b.parameters()), DTensor) for b in blocks(gpt)]
        with replica.no_sync():
            loss_sum(gpt(batch[:, :-1]), batch[:, 1:]).backward()
        assert whole() == [True] + [False] * 4  # embedding kept; 3 blocks and head freed
        loss_sum(gpt(batch[:, :-1]), batch[:, 1:]).backward()
        assert whole() == [False] * 5
    finally:
        dist.destroy_process_group()


def test_compiling_on_a_cpu_node_without_a_cxx_compiler_is_one_clear_error(monkeypatch):
    """Inductor builds C++ at the first step on CPU: without a compiler that fails deep in
    torch, so the worker says what is missing before the world trains."""
    from baton.errors import WorkerError
    from baton.models.gpt import build_gpt
    from baton.parallel import compiled

    gpt = build_gpt(layers=2, width=16, heads=2, seq_len=8, vocab_size=256)
    assert compiled.compile_blocks(gpt, False) == 0
    monkeypatch.setattr(compiled, "CXX", ("baton-no-such-compiler",))
    assert compiled.compile_blocks(gpt, "auto", device="cpu") == 0  # auto: off on CPU, no C++ asked
    with pytest.raises(WorkerError, match="apt-get install g\\+\\+"):
        compiled.compile_blocks(gpt, True, device="cpu")
    assert compiled.compile_blocks(gpt, "auto", device="cuda") == 4  # embedding, 2 blocks, head
    monkeypatch.setattr(compiled, "CC", ("baton-no-such-compiler",))  # a slim CUDA image
    assert compiled.compile_blocks(gpt, "auto", device="cuda") == 0  # eager, with a warning
    with pytest.raises(WorkerError, match="apt-get install gcc"):
        compiled.compile_blocks(gpt, True, device="cuda")


def test_a_fused_projection_splits_part_by_part_and_joins_back():
    """parallel/tensor.py's Split: the GPT's qkv (q, k, v stacked) split over 2 workers gives
    each its heads' rows of q, of k and of v; joined back, the tensor is the same."""
    from baton.parallel.tensor import Split

    q, k, v = (torch.arange(8.0).reshape(4, 2) + 100 * i for i in range(3))
    qkv = torch.cat([q, k, v])
    split = Split(0, parts=3)
    pieces = [split.take(qkv, r, 2) for r in range(2)]
    assert torch.equal(pieces[1], torch.cat([q[2:], k[2:], v[2:]]))
    assert torch.equal(split.join(pieces), qkv)
    rows = Split(1)  # a row-parallel weight: input features
    assert torch.equal(rows.join([rows.take(q, r, 2) for r in range(2)]), q)
    assert rows.whole_shape(rows.take(q, 0, 2).shape, 2) == [4, 2]


@pytest.mark.parametrize("split,shape", [(("column", 3), (12, 5)), (("row", 1), (4, 6))])
def test_each_piece_a_worker_holds_lies_where_it_is_in_the_whole(split, shape):
    """Split.pieces: what a checkpoint says of a worker's share, and of FSDP's shard of it (a
    run of rows, torch.chunk's split over 2, here 3 of a share's 6 rows, or all 4 of a row
    weight's): each piece, at its offsets in the whole tensor, is the whole's values there,
    and the pieces of every worker and shard cover the whole once."""
    from baton.parallel.tensor import Split

    style, parts = split
    rule = Split(0, parts) if style == "column" else Split(1)
    whole = torch.arange(float(shape[0] * shape[1])).reshape(shape)
    covered = torch.zeros(shape)
    for rank in range(2):
        share = rule.take(whole, rank, 2)
        start = 0
        for box in share.chunk(2):  # FSDP's two shards of the share, along dim 0
            for offsets, piece in rule.pieces(box, [start, 0], share.shape[rule.dim], rank, 2):
                at = tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))
                assert torch.equal(whole[at], piece)
                covered[at] += 1
            start += len(box)
    assert torch.equal(covered, torch.ones(shape))


def test_a_model_split_as_it_is_built_holds_the_shares_of_the_whole_one():
    """split_layers with `fill` (a tp worker's build: each layer of the meta-device model
    given its values just before it is split): bit for bit the shares of the model built
    whole and then split, every parameter real, each layer filled in the model's order."""
    from baton.models import build_lazily
    from baton.parallel.tensor import split_layers

    spec = ModelSpec(name="gpt", layers=2, width=16, heads=4, seq_len=8)
    for rank in range(2):
        whole = build_model(spec, 3)
        want = split_layers(whole, rank, 2, None)
        lazy, fill = build_lazily(spec, 3)
        order = []
        got = split_layers(lazy, rank, 2, None,
                           lambda layers: [order.append(id(x)) or fill([x]) for x in layers])
        assert got == want and order == [id(layer) for layer in lazy]
        mine, theirs = dict(lazy.named_parameters()), dict(whole.named_parameters())
        assert mine.keys() == theirs.keys()
        for name, q in mine.items():
            assert not q.is_meta and torch.equal(q, theirs[name]), name


def test_a_split_gpt_block_computes_what_the_whole_one_does():
    """A block's two shares, each computing on its own parameters in one process, with the
    row layers' partial products summed by hand where the all-reduce would sum them: the
    whole block's output (the collectives themselves run in tests/integration/test_tensor.py)."""
    import torch.nn.functional as F

    from baton.parallel.tensor import split_layers

    spec = ModelSpec(name="gpt", layers=1, width=16, heads=4, seq_len=8)
    block = build_model(spec, 0)[1]
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    shares = []
    for rank in range(2):
        model = build_model(spec, 0)
        split_layers(model, rank, 2, None)
        shares.append(model[1])
    attention = []
    for b in shares:
        q, k, v = F.linear(block.ln1(x), b.qkv.weight, b.qkv.bias).chunk(3, dim=2)
        heads = q.shape[-1] // b.head_width
        assert heads == 2  # of the 4
        q, k, v = (t.view(2, 8, heads, b.head_width).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attention.append(F.linear(y.transpose(1, 2).reshape(2, 8, heads * b.head_width), b.proj.weight))
    h = x + sum(attention) + shares[0].proj.bias
    mlp = sum(F.linear(F.gelu(F.linear(block.ln2(h), b.fc.weight, b.fc.bias)), b.out.weight)
              for b in shares) + shares[0].out.bias
    # measured: 1.5e-8 at most (the same sums in another order)
    torch.testing.assert_close(h + mlp, block(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("plan,problem", [
    ({"fc": "diagonal"}, "m's 0 plans fc as 'diagonal', which is none of column, row, gather, vocab"),
    ({"fc": "vocab"}, "m's 0.fc is not an nn.Embedding: its tp_plan cannot split it vocab"),
    ({"emb": "column"}, "m's 0.emb is not an nn.Linear: its tp_plan cannot split it column"),
    ({"emb": "vocab"}, "m's 0.emb has 9 rows (its vocabulary), which do not split into 1 x 2 "
                       "equal pieces; make the vocabulary a multiple of that"),
])
def test_a_user_tp_plan_that_cannot_split_is_named(plan, problem):
    """parallel/tensor.py's plan_problem on a user's layer: each mistake one line (the start
    of it checked: the vocabulary's hint goes on)."""
    from torch import nn

    from baton.parallel.tensor import plan_problem

    class Layer(nn.Module):
        tp_plan = plan

        def __init__(self):
            super().__init__()
            self.fc, self.emb = nn.Linear(4, 4), nn.Embedding(9, 4)

    assert plan_problem(nn.Sequential(Layer()), "m", 2).startswith(problem)


def test_a_mixture_of_experts_routes_each_token_to_its_top_experts_and_every_expert_has_a_gradient():
    """The llama's mixture (models/llama.py's MoEBlock) against the plainest form of it, token
    by token: each token's top-2 experts by the router's softmax, their outputs summed weighted
    by those probabilities renormalised. Experts no token chose still get a gradient (zeros),
    as DDP's reducer and FSDP need of every parameter each step."""
    from baton.models.llama import Mixture, MoEBlock, Rope

    torch.manual_seed(0)
    block = MoEBlock(16, 2, 2, 24, Rope(), 0.0, mixture=Mixture(experts=4, per_token=2))
    h = torch.randn(2, 5, 16)
    want = []
    for token in h.reshape(-1, 16):
        p = torch.softmax(block.router(token), -1)
        top = p.topk(2)
        want.append(sum(w / top.values.sum() * block.experts[int(e)](token)
                        for w, e in zip(top.values, top.indices)))
    # measured: 6.0e-8 apart on outputs of 0.5 (the same sums; the weights divided first here)
    torch.testing.assert_close(block.mlp(h), torch.stack(want).view(2, 5, 16), rtol=0, atol=1e-6)
    with torch.no_grad():  # every token to experts 0 and 1: 2 and 3 get none
        block.router.weight[2:] = 0
        block.router.weight[:2] = 0
        block.router.weight[0, 0], block.router.weight[1, 0] = 50, 49
    h = h.abs()  # (so that feature 0 puts experts 0 and 1 first for every token)
    block.mlp(h).sum().backward()
    for e, expert in enumerate(block.experts):
        grads = [p.grad for p in expert.parameters()]
        assert all(g is not None for g in grads), e
        assert all(bool(g.abs().sum() > 0) == (e < 2) for g in grads), e
    block.balance(torch.tensor([True, False]), 1.0)  # (the second row padding)
    block.mlp(h)
    assert block.load.tolist() == [5, 5, 0, 0]  # the first row's 5 tokens, 2 choices each


@pytest.mark.parametrize("option", ["router_aux_loss", "router_z_loss"])
def test_a_load_balancing_loss_over_micro_batches_is_the_whole_batch_s(option):
    """model.options.router_aux_loss (and router_z_loss): each sequence's loss its own,
    weighted as the task's loss sums are (models.balanced's `balance`), so that gradients
    summed over micro-batches of 2 rows are the whole batch's (in float64: rounding alone
    apart); and the loss pulls the router (its gradient differs from the run without it)."""
    from baton.models import loss_sum, routed
    from baton.models.llama import llama_layers

    x = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    count = x[:, 1:].numel()
    grads = {}
    for aux, rows in ((0.5, 8), (0.5, 2), (0.0, 8)):
        torch.manual_seed(0)
        model = llama_layers(layers=2, width=32, heads=4, seq_len=16, vocab_size=256, hidden=32, experts=4,
                             **{option: aux}).build().double().train()
        for i in range(0, 8, rows):
            part = x[i:i + rows]
            for layer in routed(model):
                layer.balance(torch.ones(rows, dtype=torch.bool), 16 / count)
            (loss_sum(model(part[:, :-1]), part[:, 1:]) / count).backward()
        grads[aux, rows] = {n: p.grad for n, p in model.named_parameters()}
    assert not any(layer.balances for layer in routed(model)) and grads[0.5, 8].keys() == grads[0.0, 8].keys()
    for name, whole in grads[0.5, 8].items():
        # measured: 2.4e-17 apart at most, 7.3e-16 of the largest (float64); the z-loss 4.2e-17
        torch.testing.assert_close(grads[0.5, 2][name], whole, rtol=1e-12, atol=1e-14)
    router = "1.router.weight"
    # (measured: the load-balancing loss's 64 times as large as the largest of its gradient
    # without it, at this start; the z-loss's (at 0.5) 392 times)
    assert (grads[0.5, 8][router] - grads[0.0, 8][router]).abs().max() > grads[0.0, 8][router].abs().max()


def test_the_router_z_loss_is_the_mean_square_of_the_logits_log_sum_exp():
    """model.options.router_z_loss: ST-MoE's z-loss, each token's log of the sum of exp of
    its router logits, squared, summed over a row's tokens and the rows that count (the
    padding row left out), as the block reports it (train_router_z_loss's sums)."""
    from baton.models.llama import Mixture, MoEBlock, Rope

    torch.manual_seed(0)
    block = MoEBlock(16, 2, 2, 24, Rope(), 0.0, mixture=Mixture(experts=4, z=0.01)).train()
    h = torch.randn(3, 5, 16)
    block.balance(torch.tensor([True, True, False]), 1.0)
    block.mlp(h)
    want = sum(torch.logsumexp(block.router(token), -1) ** 2 for token in h[:2].reshape(-1, 16)) / 5
    assert set(block.losses) == {"router_z_loss"}
    # measured: 0 apart on 3.34 (float32 sums in another order could differ in the last bits)
    torch.testing.assert_close(block.losses["router_z_loss"], want.detach(), rtol=1e-6, atol=0)
