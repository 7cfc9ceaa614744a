"""Low-rank adapters (`model.lora`, models/lora.py): the model they start as, what trains, the
same adapters however the model is built, the merge `baton export` writes, and the job file's
checks; and parameters frozen without adapters (`model.frozen`, models/frozen.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.errors import SpecError
from baton.models import _on_meta, build_lazily, build_model
from baton.models.frozen import counts
from baton.models.lora import adapted_layers, merged
from baton.spec import LoRASpec, ModelSpec, spec_from_dict
from baton.training import make_optimizer
from helpers import commit_state, tiny_spec

GPT = ModelSpec(name="gpt", layers=2, width=32, heads=4, seq_len=16, vocab_size=64)
LORA = dataclasses.replace(GPT, lora=LoRASpec(rank=4, alpha=8.0, targets=["*.qkv", "*.proj", "*.lm"],
                                              whole=["*.ln1.*"]))
TOKENS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


def test_adapters_start_as_the_model_and_only_they_and_the_named_parameters_train(tmp_path):
    base, adapted = build_model(GPT, 3), build_model(LORA, 3)
    # B starts at zero: the adapted model computes the model's own numbers, bit for bit, and
    # its own weights are those it has without adapters (A is drawn from a stream of its own)
    assert torch.equal(base(TOKENS), adapted(TOKENS))
    mine = adapted.state_dict()
    assert all(torch.equal(t, mine[n]) for n, t in base.state_dict().items())
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trained == {f"{i}.{layer}.{part}" for i in (1, 2) for layer in ("qkv", "proj")
                       for part in ("lora_a", "lora_b")} | {
                      "3.lm.lora_a", "3.lm.lora_b", "1.ln1.weight", "1.ln1.bias",
                      "2.ln1.weight", "2.ln1.bias"}
    assert adapted[1].qkv.lora_a.shape == (4, 32) and adapted[1].qkv.lora_b.shape == (96, 4)
    # the optimizer holds what trains, and nothing else: its state is the adapters'
    train = spec_from_dict(tiny_spec(tmp_path, tmp_path)).train
    held = {id(p) for g in make_optimizer(adapted, train).param_groups for p in g["params"]}
    assert held == {id(p) for p in adapted.parameters() if p.requires_grad}
    assert counts(adapted)[0] == sum(p.numel() for n, p in adapted.named_parameters() if n in trained)
    # rank 4 x (in + out) for each adapter (qkv 32 -> 96, proj 32 -> 32, two blocks; the
    # head 32 -> 64) and the two layer norms' gains and biases (32 each)
    adapters = 2 * 4 * (128 + 64) + 4 * 96
    assert counts(adapted) == (adapters + 2 * 64, sum(p.numel() for p in base.parameters()) + adapters)


def test_a_model_built_layer_by_layer_gets_the_adapters_of_the_whole():
    """A sharded worker or a pipeline stage builds its layers one at a time from the recipe
    (models/layers.py): the adapters and what is frozen are those of the model built whole."""
    whole = build_model(LORA, 5)
    lazy, fill = build_lazily(LORA, 5)
    fill(list(lazy))
    a, b = whole.state_dict(), lazy.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert ([n for n, p in whole.named_parameters() if p.requires_grad]
            == [n for n, p in lazy.named_parameters() if p.requires_grad])
    with torch.no_grad():
        lazy[1].qkv.lora_b.fill_(0.5)
    assert not torch.equal(lazy(TOKENS), build_model(GPT, 5)(TOKENS))  # the hook is on the layer


@pytest.mark.parametrize("order", ["names", "stage"])
def test_the_export_merges_each_adapter_into_its_weight(order):
    """`merged` over a checkpoint's tensors in name order (DCP shards) or a stage's own order
    (weight first): the model without adapters, given the merged weights, computes what the
    adapted one does."""
    adapted = build_model(LORA, 1)
    with torch.no_grad():  # adapters as training leaves them: B no longer zero
        for n, p in adapted.named_parameters():
            if n.endswith("lora_b"):
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    state = adapted.state_dict()
    items = sorted(state.items()) if order == "names" else list(state.items())
    layers = adapted_layers(_on_meta(LORA), LORA)
    assert layers == {name: False for name in ("1.qkv", "1.proj", "2.qkv", "2.proj", "3.lm")}
    out = dict(merged(iter(items), LORA.lora, layers))
    assert not any("lora" in n for n in out)
    plain = build_model(GPT, 1)
    plain.load_state_dict(out)
    # measured: 7.2e-6 at most, in either order (float32 rounding: the merged weight is
    # computed in float64 and rounded once; the adapted model adds its two products apart)
    torch.testing.assert_close(plain(TOKENS), adapted(TOKENS), rtol=0, atol=5e-5)
    with pytest.raises(ValueError, match="lacks parts of the adapted layers"):
        list(merged(iter([(n, t) for n, t in items if n != "1.qkv.lora_b"]), LORA.lora, layers))


def _check(tmp_path, **model):
    spec_from_dict(tiny_spec(tmp_path, tmp_path, model={**dataclasses.asdict(GPT), **model}))


def test_the_job_files_lora_is_checked_before_anything_starts(tmp_path):
    _check(tmp_path, lora={"rank": 2})  # every linear layer ("*")
    with pytest.raises(SpecError, match=r"model.lora.targets: \['\*.attn'\] is invalid; targets "
                                        r"\['\*.attn'\] match no linear layer .*the model's: 1.qkv, 1.proj"):
        _check(tmp_path, lora={"targets": ["*.attn"]})
    with pytest.raises(SpecError, match="model.lora.rank: 0 is invalid"):
        _check(tmp_path, lora={"rank": 0})
    with pytest.raises(SpecError, match="model.lora.alpha: -1.0 is invalid"):
        _check(tmp_path, lora={"alpha": -1})
    with pytest.raises(SpecError, match=r"model.lora.dropout: 1.0 is invalid; must be in \[0, 1\)"):
        _check(tmp_path, lora={"dropout": 1.0})
    with pytest.raises(SpecError, match="model.lora.ranks: unknown key; did you mean 'rank'"):
        _check(tmp_path, lora={"ranks": 2})
    # a linear layer trained whole is not adapted too: a new head takes no adapter
    with pytest.raises(SpecError, match="match no linear layer"):
        _check(tmp_path, lora={"targets": ["*.lm"], "whole": ["*.lm.*"]})
    # adapters on layers split over tp workers: split with them (test_tensor_parallel.py)
    spec_from_dict(tiny_spec(tmp_path, tmp_path, model={**dataclasses.asdict(GPT), "lora": {}},
                             parallel={"dp": 1, "tp": 2}))


def test_a_recipe_without_adapters_keeps_its_fingerprint(tmp_path):
    """A checkpoint written before model.lora existed resumes: the recipe names lora only where
    set, and a run with adapters is another recipe (its checkpoints are not the model's)."""
    raw = tiny_spec(tmp_path, tmp_path)
    plain = spec_from_dict(raw)
    assert "lora" not in plain.recipe()["model"]
    adapted = spec_from_dict({**raw, "model": {**raw["model"], "lora": {"rank": 2}}})
    assert adapted.recipe()["model"]["lora"]["rank"] == 2
    assert "dropout" not in adapted.recipe()["model"]["lora"]  # (0: as before it existed)
    assert adapted.fingerprint() != plain.fingerprint()


def test_an_adapter_on_a_tied_weight_is_refused(tmp_path):
    """GPT-2's head is its token embedding under a second name: merged at export, an adapter
    would change the embedding too (or, re-tied by transformers, be lost)."""
    config = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32, "vocab_size": 256}
    with pytest.raises(SpecError, match=r"lm_head.weight is tied to .*wte.weight"):
        _check(tmp_path, name="hf:gpt2", config=config, lora={"targets": ["*lm_head"]})


def test_gpt2s_conv1d_layers_take_adapters_merged_transposed(tmp_path):
    """transformers' Conv1D (GPT-2's attention and MLP) holds its weight as (in, out): its
    adapter computes what a linear layer's does, and its merge is transposed."""
    config = {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32, "vocab_size": 64}
    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path, model={
        "name": "hf:gpt2", "config": config, "lora": {"rank": 2, "targets": ["*.c_attn", "*.c_fc"]}}))
    adapted = build_model(spec.model, 0).eval()  # (GPT-2's configuration has dropout)
    layers = adapted_layers(_on_meta(spec.model), spec.model)
    assert len(layers) == 2 and all(layers.values())  # (in, out) weights, both
    tokens = TOKENS[:, :8]
    before = adapted(tokens)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if n.endswith("lora_b"):
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    after = adapted(tokens)
    assert not torch.equal(before, after)
    plain = build_model(dataclasses.replace(spec.model, lora=None), 0).eval()
    plain.load_state_dict(dict(merged(iter(adapted.state_dict().items()), spec.model.lora, layers)))
    # measured: 1.6e-7 (float32 rounding, as for nn.Linear's merge above); a tenfold margin
    torch.testing.assert_close(plain(tokens), after, rtol=0, atol=2e-6)


def test_frozen_parameters_get_no_gradient_and_stay_frozen_when_split_over_tp(tmp_path):
    """model.frozen: ["*"] with init_fresh on the head (a new head on a frozen backbone): only
    the head trains, built whole or layer by layer, and a tensor-parallel worker's shares of
    the frozen layers stay frozen."""
    from baton.parallel.tensor import split_layers

    probe = dataclasses.replace(GPT, frozen=["*"], init_fresh=["3.*"])
    for model in (build_model(probe, 0), _filled(probe)):
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            "3.ln.weight", "3.ln.bias", "3.lm.weight"}
    partial = dataclasses.replace(GPT, frozen=["0.*", "1.*"])
    share = build_model(partial, 0)
    split = split_layers(share, 0, 2, None)
    assert "1.qkv.weight" in split and "2.qkv.weight" in split
    trained = {n for n, p in share.named_parameters() if p.requires_grad}
    assert trained and not any(n.startswith(("0.", "1.")) for n in trained)
    assert all(n in trained for n, _ in share.named_parameters() if n.startswith(("2.", "3.")))


def _filled(model):
    lazy, fill = build_lazily(model, 0)
    fill(list(lazy))
    return lazy


def test_the_job_files_frozen_is_checked_before_anything_starts(tmp_path):
    _check(tmp_path, frozen=["0.*", "1.*"])
    with pytest.raises(SpecError, match=r"model.frozen: \['9.\*'\] is invalid; '9.\*' names no "
                                        r"parameter; the model's: 0.tok.weight"):
        _check(tmp_path, frozen=["9.*"])
    with pytest.raises(SpecError, match="freezes every parameter: nothing would train"):
        _check(tmp_path, frozen=["*"])
    with pytest.raises(SpecError, match="model.lora freezes every parameter but model.lora.whole's"):
        _check(tmp_path, frozen=["0.*"], lora={"rank": 2})


def test_an_adapted_layer_called_with_its_input_by_name_adds_its_adapter():
    adapted = build_model(LORA, 2)
    layer = adapted[1].qkv
    with torch.no_grad():
        layer.lora_b.fill_(0.1)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(input=x), layer(x), rtol=0, atol=0)
    assert not torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


HF_GPT2 = {"name": "hf:gpt2", "config": {"n_layer": 1, "n_embd": 16, "n_head": 2, "n_positions": 32,
                                         "vocab_size": 64}}


@pytest.mark.parametrize("form", ["baton", "gpt2", "transformers", "llama"])
def test_the_adapters_alone_are_a_peft_folder_for_the_model_the_job_started_from(tmp_path, form):
    """`baton export --adapters`: the adapters of a job that fine-tuned an export, as PEFT's
    LoRA folder (the GPT-2 form's rank-stabilised: scaled by alpha / sqrt(rank)). PEFT puts them on that export, loaded as its form loads (baton's own model;
    GPT-2's from `--hf`, whose Conv1D layers PEFT adapts with fan_in_fan_out; Llama's from
    `--hf` for the built-in llama; an `hf:` model's),
    and computes what the job's adapted model computes. A job that trains more than its
    adapters, and an adapter folder given as a model, are refused in one line."""
    import peft  # (the test extra installs it)
    import transformers

    import baton
    from baton import api
    from baton.errors import CheckpointError

    model = (HF_GPT2 if form == "transformers" else
             {**GPT.__dict__, "lora": None, "name": "llama", "options": {"kv_heads": 2}}
             if form == "llama" else {**GPT.__dict__, "lora": None})
    targets = (["*.c_attn", "*.c_fc"] if form == "transformers" else
               ["*.q", "*.v", "*.down", "*.lm"] if form == "llama" else ["*.qkv", "*.fc", "*.lm"])
    hf = form in ("gpt2", "llama")  # (the built-in model exported --hf: GPT-2's, Llama's)

    base = spec_from_dict(tiny_spec(tmp_path / "base", tmp_path, name="base", model=model))
    commit_state(base, build_model(base.model, 3).state_dict())
    baton.export(base, str(tmp_path / "base-export"), hf=hf)
    tuned = spec_from_dict(tiny_spec(tmp_path / "tuned", tmp_path, name="tuned", model={
        **model, "init_from": str(tmp_path / "base-export"),
        "lora": {"rank": 4, "targets": targets, "dropout": 0.25, "rslora": form == "gpt2"}}))
    adapted = build_model(tuned.model, 0).eval()
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if n.endswith("lora_b"):  # (zeros as built: the adapters would change nothing)
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    commit_state(tuned, adapted.state_dict())
    about = baton.export(tuned, str(tmp_path / "adapters"), adapters=True, hf=hf)
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "baton.json"]
    assert about["parameters"] == sum(p.numel() for n, p in adapted.named_parameters() if ".lora_" in n)

    tokens = TOKENS[:, :8] % 64
    if form == "baton":  # (PEFT adapts the model it is given, in place)
        start = baton.load_model(str(tmp_path / "base-export"))
        run = lambda m: m(tokens)  # noqa: E731
    else:
        start = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base-export")).eval()
        run = lambda m: m(input_ids=tokens).logits  # noqa: E731
    with torch.no_grad():
        plain, want = run(start), adapted(tokens)
        theirs = peft.PeftModel.from_pretrained(start, str(tmp_path / "adapters")).eval()
        got = run(theirs)
    assert not torch.equal(got, plain)
    print(form, float((got - want).abs().max()))
    # measured: 0 in each form (PEFT computes the same two products); the bound leaves room
    # for another order of them in float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if form == "baton":  # in training, the adapters' dropout (0.25) draws the masks PEFT's does
        torch.manual_seed(7)
        dropped = adapted.train()(tokens)
        torch.manual_seed(7)
        torch.testing.assert_close(theirs.train()(tokens), dropped, rtol=0, atol=1e-5)  # measured: 0
        assert not torch.allclose(dropped, want, atol=1e-3)
        adapted.eval(), theirs.eval()

    # and back: a job that starts from the adapters (model.lora.init_from), baton's folder or
    # the one PEFT itself saves, built whole or layer by layer, is the adapted model, bit for bit
    theirs.save_pretrained(str(tmp_path / "peft-saved"))
    for folder in ("adapters", "peft-saved"):
        again = dataclasses.replace(tuned.model, lora=dataclasses.replace(
            tuned.model.lora, init_from=str(tmp_path / folder)))
        built, (lazy, fill) = build_model(again, 5).eval(), build_lazily(again, 5)
        fill(list(lazy.children()))
        for m in (built, lazy.eval()):
            assert all(torch.equal(t, adapted.state_dict()[n]) for n, t in m.state_dict().items()), folder
    wrong = {**tuned.to_dict()["model"], "lora": {"rank": 2, "targets": targets,
                                                  "init_from": str(tmp_path / "adapters")}}
    with pytest.raises(SpecError, match="model.lora.init_from: .*: its r is 4 and this job's is 2"):
        api.check_init_from(spec_from_dict({**tuned.to_dict(), "model": wrong}), "<spec>")
    wrong["lora"] = {**wrong["lora"], "rank": 4, "rslora": form != "gpt2"}
    with pytest.raises(SpecError, match=r"its use_rslora is .* \(set model.lora.rslora to it\)"):
        api.check_init_from(spec_from_dict({**tuned.to_dict(), "model": wrong}), "<spec>")

    with pytest.raises(CheckpointError, match="holds low-rank adapters alone"):
        baton.load_model(str(tmp_path / "adapters"))
    whole = spec_from_dict({**tuned.to_dict(), "model": {**tuned.to_dict()["model"],
                                                        "lora": {"rank": 4, "targets": targets,
                                                                 "whole": ["*norm*" if form == "llama" else "*ln*"]}}})
    with pytest.raises(CheckpointError, match="also trains .* parameters whole"):
        baton.export(whole, str(tmp_path / "refused"), adapters=True)


def test_a_checkpoint_leaves_out_the_frozen_weights_and_names_their_export(tmp_path):
    """A job started from an export that freezes part of it (model.lora, model.frozen): its
    checkpoints leave the frozen parameters out and record where they are (checkpoint/frozen.py).
    A resume or export takes them from there again, and refuses another export, a changed one
    or one it cannot read, in one line. A job that trains everything, or starts from its
    seed, leaves nothing out (an hf: model's save_pretrained folder: the test below)."""
    import baton
    from baton.checkpoint import frozen
    from baton.cli.validate import _frozen_line
    from baton.models.frozen import from_start

    base = spec_from_dict(tiny_spec(tmp_path / "base", tmp_path, name="base",
                                    model={**GPT.__dict__, "lora": None}))
    state = build_model(base.model, 3).state_dict()
    commit_state(base, state)
    baton.export(base, str(tmp_path / "export"))
    export = str(tmp_path / "export")
    adapted = dataclasses.replace(LORA, init_from=export)
    record = frozen.record(adapted)
    # every parameter of the model but the two layer norms LORA trains whole
    assert record["names"] == sorted(n for n in state if ".ln1." not in n or n.startswith("3."))
    assert record["from"] == export
    meta = {"step": 7, "frozen": record}
    assert frozen.problem(meta, adapted) is None
    job = spec_from_dict(tiny_spec(tmp_path / "job", tmp_path, name="job",
                                   model=dataclasses.asdict(adapted)))
    count = sum(t.numel() for n, t in state.items() if n in record["names"])
    assert _frozen_line(job).endswith(f"; its checkpoints leave out the {count:,} frozen ones "
                                      f"(they stay in {export})")  # (baton validate)
    got = dict(frozen.read(meta, adapted, ["1.qkv.weight"]))
    assert torch.equal(got["1.qkv.weight"], state["1.qkv.weight"])
    assert "set model.init_from to that folder" in frozen.problem(
        meta, dataclasses.replace(adapted, init_from=str(tmp_path / "other")))
    about = tmp_path / "export" / "baton.json"
    text = about.read_text()
    about.write_text(text.replace('"step": 1', '"step": 2'))
    assert "has changed since checkpoint 7 was written" in frozen.problem(meta, adapted)
    about.unlink()
    assert "baton.json cannot be read" in frozen.problem(meta, adapted)
    assert from_start(dataclasses.replace(GPT, init_from=export)) == []  # trains everything
    assert from_start(LORA) == []  # from its seed: nothing to take them from
    assert from_start(dataclasses.replace(GPT, frozen=["1.*"], init_from=export)) == sorted(
        n for n in state if n.startswith("1."))


def test_an_hf_models_checkpoint_leaves_out_the_weights_of_its_pretrained_folder(tmp_path):
    """An hf: model started from a save_pretrained folder (no baton.json: the form a model
    comes in) with model.lora: its checkpoints leave the frozen weights out too, read back
    from the folder's safetensors by name. The digest sees weights trained further (same
    shapes, other values) and not a copy of the same bytes; a folder whose weights are a
    pickle keeps full checkpoints."""
    import os
    import shutil

    from baton.checkpoint import frozen
    from baton.models.frozen import from_start

    folder = tmp_path / "pretrained"
    model = build_model(ModelSpec(**{**HF_GPT2, "seq_len": 16, "vocab_size": 64}), 0)
    model.model.save_pretrained(folder)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors"]
    adapted = ModelSpec(**{**HF_GPT2, "seq_len": 16, "vocab_size": 64}, init_from=str(folder),
                        lora=LoRASpec(rank=2, targets=["*.c_attn"]))
    record = frozen.record(adapted)
    state = model.state_dict()  # the head, tied to the embedding, under both names
    assert record["names"] == sorted(state) and "model.lm_head.weight" in record["names"]
    meta = {"step": 3, "frozen": record}
    got = dict(frozen.read(meta, adapted, record["names"]))  # the head: the embedding's
    assert all(torch.equal(got[n], state[n]) for n in state)
    os.utime(folder / "model.safetensors", (1, 1))
    shutil.copytree(folder, tmp_path / "copy")
    assert frozen.problem(meta, dataclasses.replace(adapted, init_from=str(tmp_path / "copy"))
                          ).endswith("set model.init_from to that folder")  # another folder
    shutil.rmtree(folder)
    shutil.copytree(tmp_path / "copy", folder)
    assert frozen.problem(meta, adapted) is None  # the same bytes
    with torch.no_grad():
        model.model.transformer.h[0].mlp.c_fc.weight.add_(1e-3)  # trained further
    model.model.save_pretrained(folder)
    assert "has changed since checkpoint 3 was written (its weights are others)" in frozen.problem(
        meta, adapted)
    sharded = tmp_path / "sharded"  # several files, named by model.safetensors.index.json
    model.model.save_pretrained(sharded, max_shard_size=4000)  # bytes: the model is ~20 KB
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    in_shards = dataclasses.replace(adapted, init_from=str(sharded))
    record = frozen.record(in_shards)
    assert record["names"] == sorted(state)
    got = dict(frozen.read({"step": 4, "frozen": record}, in_shards, record["names"]))
    assert all(torch.equal(got[n], model.state_dict()[n]) for n in state)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")  # (not read: a name)
    assert from_start(adapted) == []
