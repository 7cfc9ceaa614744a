"""`baton export`: a committed checkpoint, whatever wrote it (a file per pipeline stage, DCP
shards, a tensor-parallel worker's pieces), as safetensors files in Hugging Face's layout, and
`baton.load_model` building the model back. The checkpoints are written here as the workers
write them, without Ray."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

import baton
from baton import cli
from baton.checkpoint import CheckpointStore
from baton.checkpoint import sharded
from baton.errors import CheckpointError
from baton.models import build_model
from baton.spec import spec_from_dict
from helpers import tiny_spec, write_dataset, write_spec

GPT = {"name": "gpt", "layers": 2, "width": 32, "heads": 4, "seq_len": 32}


def _job(tmp_path, model=GPT):
    raw = tiny_spec(tmp_path, tmp_path / "data", name="exp", model=model)
    return spec_from_dict(raw), write_spec(tmp_path / "job.yaml", raw)


def _stages(store: CheckpointStore, step: int, state: dict, cut: str = "2.",
            evaluated: dict | None = None, recipe: dict | None = None,
            optim: dict | None = None) -> None:
    """A checkpoint as two pipeline stages write it: the model's names up to `cut` in the
    first file, the rest in the second; `evaluated`: its held-out metrics; `optim`: each
    parameter's optimizer state (none by default)."""
    names = list(state)
    first = names[:next(i for i, n in enumerate(names) if n.startswith(cut))]
    store.begin(step)
    parts = []
    for i, part in enumerate(({n: state[n] for n in first},
                              {n: state[n] for n in names if n not in first})):
        parts.append(store.write_tensors(step, f"model-{i:04d}.pt", part))
        parts.append(store.write_tensors(step, f"optim-{i:04d}.pt", {
            "state": {n: s for n, s in (optim or {}).items() if n in part}, "param_groups": []}))
    store.commit(step, {"step": step, "layout": {"pp": 2}, **({"eval": evaluated} if evaluated else {}),
                        **({"recipe": recipe} if recipe else {})}, keep=5, parts=parts)


def test_a_pipelines_checkpoint_exports_whole_and_loads_back(tmp_path, capsys):
    spec, job = _job(tmp_path)
    state = build_model(spec.model, 3).state_dict()
    store = CheckpointStore(spec.checkpoint_dir)
    _stages(store, 4, {n: t + 1 for n, t in state.items()})
    _stages(store, 6, state)

    assert cli.main(["export", str(job), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    total = sum(t.numel() for t in state.values())
    assert printed.startswith(f"exported step 6 of exp: {total:,} parameters (")
    assert f'load it: baton.load_model("{tmp_path / "out"}")' in printed
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["baton.json", "model.safetensors"]  # and nothing half-written beside it
    (tmp_path / "probe").write_text("")  # its mode: as any file this process writes (safetensors': 0600)
    assert ((tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777
            == (tmp_path / "probe").stat().st_mode & 0o777)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == state.keys() and all(torch.equal(written[n], state[n]) for n in state)
    about = json.loads((tmp_path / "out" / "baton.json").read_text())
    assert about["step"] == 6 and about["model"]["width"] == 32 and about["parameters"] == total

    model = baton.load_model(str(tmp_path / "out"))
    assert not model.training
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    want = build_model(spec.model, 3).eval()
    assert torch.equal(model(tokens), want(tokens))

    # an older step, in files of at most 20 kB: Hugging Face's sharded layout with its index
    baton.export(spec, str(tmp_path / "older"), step=4, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "older" / "model.safetensors.index.json").read_text())
    names = sorted(set(index["weight_map"].values()))
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    assert index["metadata"]["total_size"] == total * 4
    got = {}
    for name in names:
        part = load_file(str(tmp_path / "older" / name))
        assert sum(t.numel() * 4 for t in part.values()) <= 20_000 or len(part) == 1
        assert all(index["weight_map"][n] == name for n in part)
        got.update(part)
    assert all(torch.equal(got[n], state[n] + 1) for n in state)


def test_a_tensor_parallel_workers_pieces_export_as_whole_tensors(tmp_path):
    """Two workers' pieces of one tensor, each holding rows that are not adjacent (a share of
    a fused projection: its heads' rows of q and of k), written through DCP's two rounds as a
    survivors' save writes them, and a tensor both hold whole (written once)."""
    spec, _ = _job(tmp_path)
    store = CheckpointStore(spec.checkpoint_dir)
    qkv, norm = torch.arange(24.0).reshape(8, 3), torch.tensor([1.0, 2.0])
    store.begin(5)
    where = store.shards(5)
    saves = [sharded.PlannedSave({"model": {"1.qkv.weight": sharded.Pieces(
        [8, 3], [([4 * part + 2 * w, 0], qkv[4 * part + 2 * w:4 * part + 2 * w + 2]) for part in (0, 1)]),
        "1.ln.weight": norm}}, where) for w in (0, 1)]
    plans, finish = sharded.plan_globally(where, [s.plan() for s in saves])
    written = [s.write(p) for s, p in zip(saves, plans)]
    parts = [p for _, records in written for p in records] + finish([r for r, _ in written])
    store.commit(5, {"step": 5, "layout": {"pp": 1, "tp": 2}}, keep=5, parts=parts)
    assert sharded.tensor_sizes(where, "model") == {"1.qkv.weight": 96, "1.ln.weight": 8}
    assert list(sharded.read_some(where, "model", ["1.ln.weight"])) == ["1.ln.weight"]

    about = baton.export(spec, str(tmp_path / "out"), max_shard_bytes=50)
    assert about["files"] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    got = {**load_file(str(tmp_path / "out" / about["files"][0])),
           **load_file(str(tmp_path / "out" / about["files"][1]))}
    assert torch.equal(got["1.qkv.weight"], qkv) and torch.equal(got["1.ln.weight"], norm)


def test_a_hugging_face_models_export_is_a_save_pretrained_folder(tmp_path):
    """An hf: model's export loads with transformers' own from_pretrained (its names, its
    config.json), the tied head included, and computes what the trained model does."""
    transformers = pytest.importorskip("transformers")
    model = {"name": "hf:gpt2", "seq_len": 32, "vocab_size": 256,
             "config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}}
    spec, _ = _job(tmp_path, model)
    trained = build_model(spec.model, 5).eval()
    store = CheckpointStore(spec.checkpoint_dir)
    store.begin(2)
    # as a worker writes it: the tied head and embedding are one tensor in one file
    parts = [store.write_tensors(2, "model-0000.pt", trained.state_dict()),
             store.write_tensors(2, "optim-0000.pt", {"state": {}, "param_groups": []})]
    store.commit(2, {"step": 2, "layout": {"pp": 1}}, keep=5, parts=parts)

    baton.export(spec, str(tmp_path / "out"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), local_files_only=True).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(hf(input_ids=tokens).logits, trained(tokens))
        assert torch.equal(baton.load_model(str(tmp_path / "out"))(tokens), trained(tokens))


def test_what_cannot_be_exported_is_one_line_and_writes_nothing(tmp_path, capsys):
    spec, job = _job(tmp_path)
    out = tmp_path / "out"

    def fails(*extra: str) -> str:
        assert cli.main(["export", str(job), "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not out.exists()
        return err
    assert "holds no committed checkpoint; train the job first" in fails()
    store = CheckpointStore(spec.checkpoint_dir)
    state = build_model(spec.model, 0).state_dict()
    _stages(store, 2, state)
    _stages(store, 4, state)
    assert "has no committed checkpoint 3; it has 2, 4" in fails("--step", "3")
    assert "--max-file-mb must be at least 1" in fails("--max-file-mb", "0")
    # a truncated part: named, and not exported; without --step the one before it is
    part = f"{store.step_dir(4)}/model-0001.pt"
    with open(part, "r+b") as f:
        f.truncate(100)
    err = fails("--step", "4")
    assert "checkpoint 4 in" in err and "does not verify: part model-0001.pt" in err, err
    assert cli.main(["export", str(job), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("baton: checkpoint 4 does not verify (part model-0001.pt")
    assert captured.out.startswith("exported step 2 of exp")
    before = sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir())
    assert cli.main(["export", str(job), "--out", str(out)]) == 2
    assert "already exists; choose a new --out" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in out.iterdir()) == before


def test_best_exports_the_checkpoint_of_the_best_held_out_evaluation(tmp_path, capsys):
    spec, job = _job(tmp_path)
    store = CheckpointStore(spec.checkpoint_dir)
    states = {s: build_model(spec.model, s).state_dict() for s in (2, 4, 6)}
    _stages(store, 2, states[2], evaluated={"eval_loss": 3.0})
    _stages(store, 4, states[4], evaluated={"eval_loss": 2.0})
    _stages(store, 6, states[6], evaluated={"eval_loss": 2.5})
    out = tmp_path / "best"
    args = ["export", str(job), "--out", str(out), "--best"]
    assert cli.main(args) == 2
    assert "--best: job 'exp' sets no checkpoint.best" in capsys.readouterr().err
    args += ["--set", "checkpoint.best=eval_loss", "--set", "eval.fraction=0.1",
             "--set", "eval.every_steps=1"]
    assert cli.main(args) == 0 and capsys.readouterr().out.startswith("exported step 4 of exp")
    got = baton.load_model(str(out)).state_dict()
    assert all(torch.equal(got[n], states[4][n]) for n in states[4])
    maxed = [*args[:-6], "--set", "checkpoint.best=eval_loss", "--set", "checkpoint.best_mode=max",
             "--set", "eval.fraction=0.1", "--set", "eval.every_steps=1"]
    maxed[3] = str(tmp_path / "worst")
    assert cli.main(maxed) == 0 and capsys.readouterr().out.startswith("exported step 2 of exp")
    accuracy = [*args[:-6], "--set", "checkpoint.best=eval_accuracy", "--set",
                "checkpoint.best_mode=max", "--set", "eval.fraction=0.1", "--set", "eval.every_steps=1"]
    assert cli.main(accuracy) == 2  # a language model reports no accuracy
    assert "checkpoint.best: 'eval_accuracy' is invalid" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one or the other
        cli.main([*args[:4], "--step", "2", "--best"])
    assert "not allowed with argument --step" in capsys.readouterr().err
    # checkpoints written before checkpoint.best was set record no evaluation
    bare = CheckpointStore(str(tmp_path / "bare" / "exp"))
    _stages(bare, 2, states[2])
    args[3] = str(tmp_path / "bare-out")
    assert cli.main([*args, "--set", f"checkpoint.path={tmp_path / 'bare'}"]) == 2
    assert "--best: no checkpoint in" in capsys.readouterr().err


def test_what_baton_eval_cannot_evaluate_is_one_line_before_ray_starts(tmp_path, capsys):
    spec, job = _job(tmp_path)
    state = build_model(spec.model, 0).state_dict()
    for step in (2, 4):
        _stages(CheckpointStore(spec.checkpoint_dir), step, state, recipe=spec.recipe())
    held = ["--set", "eval.fraction=0.1"]
    for argv, message in (
            ([], "holds out no data to evaluate on: set eval.fraction or eval.path"),
            ([*held, "--step", "3"], "has no committed checkpoint 3; it has 2, 4"),
            ([*held, "--set", "model.width=64"], "holds another model or task (model.width 32 -> 64)"),
            ([*held, "--best"], "--best: job 'exp' sets no checkpoint.best")):
        assert cli.main(["eval", str(job), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("baton: error: ") and message in err and err.count("\n") == 1, err
    import ray

    assert not ray.is_initialized()


class _Counting(torch.nn.Module):
    """A language model that always makes the next token the last one plus 1 (mod 8)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot((ids + 1) % 8, 8).float() * 10


def test_generation_draws_from_the_last_positions_logits_and_stops_at_the_documents_end():
    from baton.sample import generate

    assert generate(_Counting(), [5], 4, seq_len=4, temperature=0) == [6, 7, 0, 1]
    assert generate(_Counting(), [5], 4, seq_len=4, temperature=0, stop=0) == [6, 7]
    # top_k 1 is the likeliest whatever the temperature; a seed repeats a draw
    assert generate(_Counting(), [2], 3, seq_len=4, temperature=5.0, top_k=1) == [3, 4, 5]
    flat = torch.nn.Module()
    flat.forward = lambda ids: torch.zeros(1, ids.shape[1], 8)
    draws = [generate(flat, [0], 12, seq_len=4, seed=s) for s in (1, 1, 2)]
    assert draws[0] == draws[1] != draws[2] and set(draws[0]) <= set(range(8))


def test_the_gpts_cached_decoding_gives_the_logits_of_the_whole_window():
    """The built-in GPT a position at a time on its cached keys and values: every position's
    logits those of one forward pass over the whole sequence; generation the same tokens with
    and without the cache, before and past the window (seq_len 16, 40 tokens)."""
    from baton.models.gpt import build_gpt
    from baton.sample import generate

    torch.manual_seed(0)
    model = build_gpt(layers=3, width=32, heads=4, seq_len=16, vocab_size=64).eval()
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        whole = model(ids)[0]
        caches, rows, x = [{} for _ in model], [], ids[:, :5]  # a prompt of 5, then one by one
        for t in [0, *range(5, 16)]:
            x = ids[:, t:t + 1] if t else x
            for layer, cache in zip(model, caches):
                x = layer.decode(x, cache, t)
            rows.append(x[0])
    assert caches[1]["k"].shape == (1, 4, 16, 8)
    # 2.7e-7 at most over 5 seeds of a 4 x 64 GPT (logits up to 0.67): float32 rounding of
    # matrix products of other shapes; 1e-5 is ~40x that
    torch.testing.assert_close(torch.cat(rows), whole, rtol=0, atol=1e-5)
    assert generate(model, [1, 2, 3], 40, 16, temperature=0) == \
        generate(model, [1, 2, 3], 40, 16, temperature=0, cache=False)


def test_sample_writes_text_after_the_prompt_with_the_corpus_tokenizer(tmp_path, capsys):
    spec, job = _job(tmp_path)
    _stages(CheckpointStore(spec.checkpoint_dir), 2, build_model(spec.model, 0).state_dict())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "_corpus.json").write_text(json.dumps({"tokenizer": "bytes", "eod_token": 0}))
    assert cli.main(["export", str(job), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    args = ["sample", str(tmp_path / "out"), "--prompt", "def ", "--tokens", "40", "--seed", "3"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.encode()) > 4
    assert cli.main(args) == 0 and capsys.readouterr().out == text  # the seed's draw
    assert cli.main([*args[:-1], "4"]) == 0 and capsys.readouterr().out != text

    for argv, message in (
            (["sample", str(tmp_path), "--prompt", "x"], f"{tmp_path} is not a folder baton export wrote"),
            ([*args, "--tokens", "0"], "--tokens must be at least 1"),
            (["sample", str(tmp_path / "out"), "--prompt", ""], "--prompt: give at least one character")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("baton: error: ") and message in err and err.count("\n") == 1, err


LLAMA = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
         "options": {"kv_heads": 2, "hidden": 48}}


@pytest.mark.parametrize("model,theirs", [(GPT, "GPT2LMHeadModel"), (LLAMA, "LlamaForCausalLM")],
                         ids=["gpt", "llama"])
def test_a_built_in_model_exports_as_hugging_faces(tmp_path, capsys, model, theirs):
    """`--hf`: the built-in GPT under GPT2LMHeadModel's names (its linear weights transposed to
    GPT-2's Conv1D), the built-in llama (4 heads on 2 key-value heads) under
    LlamaForCausalLM's (renamed, nothing transposed or permuted), each with a config.json:
    transformers loads it and computes the same logits; baton.load_model reads it back to the
    same parameters, and a job's `init_from` starts from them."""
    transformers = pytest.importorskip("transformers")
    spec, job = _job(tmp_path, model)
    trained = build_model(spec.model, 4).eval()
    _stages(CheckpointStore(spec.checkpoint_dir), 2, trained.state_dict())
    assert cli.main(["export", str(job), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    assert f'from_pretrained("{tmp_path / "hf"}")' in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert type(hf).__name__ == theirs
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = hf(input_ids=tokens).logits, trained(tokens)
    # the same maths through transformers' code: measured 0 for both here and on the
    # quick-start models (their attention is torch's SDPA too); the bound leaves room for
    # another attention kernel (transformers' eager one sums in another order), logits up to
    # 0.47 in size here
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
    back = baton.load_model(str(tmp_path / "hf")).state_dict()
    assert all(torch.equal(back[n], q) for n, q in trained.state_dict().items())
    started = build_model(dataclasses.replace(spec.model, init_from=str(tmp_path / "hf")), 0)
    assert all(torch.equal(started.state_dict()[n], q) for n, q in trained.state_dict().items())


def test_a_model_with_no_hugging_face_form_says_so(tmp_path, capsys):
    mlp, mlp_job = _job(tmp_path, {"name": "mlp", "layers": 2, "width": 16, "seq_len": 32})
    _stages(CheckpointStore(mlp.checkpoint_dir), 2, build_model(mlp.model, 0).state_dict(), cut="1.")
    assert cli.main(["export", str(mlp_job), "--out", str(tmp_path / "no"), "--hf"]) == 2
    assert "--hf: model 'mlp' has no Hugging Face form" in capsys.readouterr().err
    both = {**LLAMA, "options": {"qkv_bias": True, "qk_norm": True}}  # (Qwen2's and Qwen3's)
    (tmp_path / "both").mkdir()
    llama, llama_job = _job(tmp_path / "both", both)
    _stages(CheckpointStore(llama.checkpoint_dir), 2, build_model(llama.model, 0).state_dict())
    assert cli.main(["export", str(llama_job), "--out", str(tmp_path / "both" / "no"), "--hf"]) == 2
    assert ("--hf: no transformers model has both biases on q, k and v alone and normed "
            "queries and keys") in capsys.readouterr().err
    assert not (tmp_path / "both" / "no").exists()


def test_the_built_in_llama_starts_from_a_llama_save_pretrained_folder(tmp_path):
    """`model.init_from` for the built-in llama: a LlamaForCausalLM `save_pretrained` folder
    (no baton.json: the form such models come in), its safetensors read by name. The job's
    model is that one (0 apart), built whole or layer by layer; a LoRA job's checkpoints
    leave its weights out, read back from the folder. A head tied to the embedding starts as
    it (untied). A job whose settings are not the folder's, and a Llama the built-in model
    does not compute (another norm epsilon), are one line each."""
    import json

    transformers = pytest.importorskip("transformers")
    from baton.api import check_init_from
    from baton.checkpoint import frozen
    from baton.errors import SpecError
    from baton.models import build_lazily
    from baton.spec import LoRASpec

    config = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=500_000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval()
    theirs.save_pretrained(tmp_path / "llama")
    llama = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 64,
             "options": {"kv_heads": 2, "hidden": 48, "rope_theta": 500_000},
             "init_from": str(tmp_path / "llama")}
    spec, _ = _job(tmp_path, llama)
    check_init_from(spec, "job.yaml")
    mine = build_model(spec.model, 0).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(mine(tokens), theirs(input_ids=tokens).logits)  # measured: 0 apart
    lazy, fill = build_lazily(spec.model, 0)
    fill(list(lazy))
    assert all(torch.equal(lazy.state_dict()[n], t) for n, t in mine.state_dict().items())
    adapted = dataclasses.replace(spec.model, lora=LoRASpec(rank=2, targets=["*.q", "*.v"]))
    record = frozen.record(adapted)  # every weight of the folder's left out of checkpoints
    assert record["names"] == sorted(mine.state_dict())
    got = dict(frozen.read({"step": 1, "frozen": record}, adapted, record["names"]))
    assert all(torch.equal(got[n], t) for n, t in mine.state_dict().items())
    for change, message in (
            ({"options": {"kv_heads": 2, "hidden": 48}},  # rope_theta left at its default
             "its model has rope_theta 500000 (its config.json), and this job's model.options "
             "says rope_theta 10000: set rope_theta: 500000"),
            ({"options": {"kv_heads": 4, "hidden": 48, "rope_theta": 500_000}}, "1.k.weight")):
        other, _ = _job(tmp_path, {**llama, **change})
        with pytest.raises(SpecError, match="job.yaml: model.init_from: ") as e:
            check_init_from(other, "job.yaml")
        assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    # a head tied to the token embedding (one tensor in the folder, under the embedding's
    # name): the built-in model's untied head starts as the embedding, the same logits
    tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "tie_word_embeddings": True})).eval()
    tied.save_pretrained(tmp_path / "tied")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "tied" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    untied = build_model(dataclasses.replace(spec.model, init_from=str(tmp_path / "tied")), 0).eval()
    assert torch.equal(untied[3].lm.weight, untied[0].tok.weight)
    assert untied[3].lm.weight.data_ptr() != untied[0].tok.weight.data_ptr()  # (they train apart)
    with torch.no_grad():
        assert torch.equal(untied(tokens), tied(input_ids=tokens).logits)  # measured: 0 apart
    folder = tmp_path / "other"  # a Llama the built-in model does not compute
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, "attention_bias": True})).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    other, _ = _job(tmp_path, {**llama, "init_from": str(folder)})
    with pytest.raises(SpecError) as e:
        check_init_from(other, "job.yaml")
    assert str(e.value) == (f"job.yaml: model.init_from: {folder} is a save_pretrained folder of "
                            "a llama model, and the built-in llama does not compute this model: "
                            "its attention's layers have biases (o_proj's too)")


# other models of Llama's kind, as transformers makes them: (its class, its config, the job's
# model.options that are that model, a job's change the folder refuses, the refusal)
FAMILIES = {
    # Llama 3.1's and 3.2's: a scaled rotary embedding (head width 8, theta 5e5: wavelengths
    # 6.3, 167, 4,450 and 118,000 positions against 256 / 4 and 256: one of each kind kept,
    # interpolated, divided), a head tied to the embedding
    "llama-3.1": ("LlamaForCausalLM", "LlamaConfig",
                  dict(rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=2048,
                       rope_parameters=dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0,
                                            low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=256)),
                  {"rope_theta": 500_000, "rope_factor": 8, "rope_original_seq_len": 256},
                  {"rope_factor": 4}, "model.options says rope_factor 4: set rope_factor: 8"),
    # Qwen2's and 2.5's: biases on q, k and v, another epsilon and base, a tied head
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(rope_theta=1e6, tie_word_embeddings=True),
              {"rope_theta": 1_000_000, "norm_eps": 1e-6, "qkv_bias": True},
              {"qkv_bias": False}, "model.options says qkv_bias false: set qkv_bias: true"),
    # Mistral's: attention within a sliding window of 16 positions, which the job's 32 pass
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=16),
                {"norm_eps": 1e-6, "sliding_window": 16}, {"sliding_window": 8},
                "its model attends within a sliding window of 16 positions (its config.json's "
                "sliding_window), and this job's model.options.sliding_window is 8: set "
                "model.options.sliding_window: 16 (or model.seq_len to at most 16)"),
    # Qwen2's with its window on in every layer (max_window_layers 0)
    "qwen2-window": ("Qwen2ForCausalLM", "Qwen2Config",
                     dict(rope_theta=1e6, use_sliding_window=True, sliding_window=12, max_window_layers=0),
                     {"rope_theta": 1_000_000, "norm_eps": 1e-6, "qkv_bias": True, "sliding_window": 12},
                     {"seq_len": 12}, None),
    # Qwen3's: each head's query and key normed, heads wider than width / heads (16, not 8)
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(rope_theta=1e6, head_dim=16, tie_word_embeddings=True),
              {"rope_theta": 1_000_000, "norm_eps": 1e-6, "qk_norm": True, "head_dim": 16},
              {"qk_norm": False}, "model.options says qk_norm false: set qk_norm: true"),
    # Mixtral's: each block's MLP a mixture of 4 experts, 2 a token, their weights renormalised
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2),
                {"rope_theta": 1_000_000, "experts": 4, "experts_per_token": 2},
                {"experts_per_token": 1}, "model.options says experts_per_token 1: set experts_per_token: 2"),
    # Qwen3-MoE's: Qwen3's attention, a mixture whose weights are not renormalised (its default)
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, head_dim=16),
                  {"norm_eps": 1e-6, "qk_norm": True, "head_dim": 16, "experts": 4, "norm_topk": False},
                  {"norm_topk": True}, "model.options says norm_topk true: set norm_topk: false"),
    # Qwen2-MoE's (Qwen1.5-MoE's): Qwen2's attention, a mixture not renormalised and a shared
    # expert of its own width beside it, gated
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=40, rope_theta=1e6),
                  {"rope_theta": 1_000_000, "norm_eps": 1e-6, "qkv_bias": True, "experts": 4,
                   "norm_topk": False, "shared_expert": 40},
                  {"shared_expert": 48}, "model.options says shared_expert 48: set shared_expert: 40"),
}
EXPORTED = {"qwen2": "Qwen2ForCausalLM", "qwen2-window": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
            "qwen3-moe": "Qwen3MoeForCausalLM", "qwen2-moe": "Qwen2MoeForCausalLM"}  # (the rest: LlamaForCausalLM)
# how far the built-in llama's logits lie from transformers' (0: equal), measured with these
# folders: a mixture's experts 6e-8 (Mixtral's, Qwen2-MoE's) and 1.8e-7 (Qwen3-MoE's) apart,
# in float32, as transformers multiplies gate and up as one matrix (gate_up_proj) where baton
# has two
APART = {"mixtral": 1e-6, "qwen3-moe": 1e-6, "qwen2-moe": 1e-6}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_built_in_llama_computes_llama_31_qwen2_qwen3_mistral_and_the_mixtures(tmp_path, capsys, family):
    """A `save_pretrained` folder of each of the other models of Llama's kind the built-in
    llama computes, made by transformers with its own classes: the job whose options say
    that model starts from it with the same logits (0 apart), and `baton export --hf` gives
    transformers back the same logits (Qwen2's as a Qwen2ForCausalLM: LlamaConfig's
    attention_bias puts one on o_proj too; Qwen3's as a Qwen3ForCausalLM). A job whose
    settings are not the folder's model is one line naming the setting."""
    transformers = pytest.importorskip("transformers")
    from baton.api import check_init_from
    from baton.errors import SpecError

    cls, config_cls, extra, options, change, message = FAMILIES[family]
    config = {**dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), **extra}
    torch.manual_seed(0)
    theirs = getattr(transformers, cls)(getattr(transformers, config_cls)(**config)).eval()
    with torch.no_grad():  # (biases and norms away from their zeros and ones)
        for name, p in theirs.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.1)
            elif name.endswith((".gate.weight", "shared_expert_gate.weight")):  # (a mixture's
                p.normal_(0, 0.5)  # router: experts chosen by margins; a shared expert's gate)
    theirs.save_pretrained(tmp_path / "folder")
    model = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
             "options": {"kv_heads": 2, "hidden": 48, **options}, "init_from": str(tmp_path / "folder")}
    spec, job = _job(tmp_path, model)
    check_init_from(spec, "job.yaml")
    mine = build_model(spec.model, 0).eval()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(input_ids=tokens).logits
        # measured: 0 apart for each but the mixtures (APART's bounds)
        torch.testing.assert_close(mine(tokens), want, rtol=0, atol=APART.get(family, 0))
    _stages(CheckpointStore(spec.checkpoint_dir), 2, mine.state_dict())
    assert cli.main(["export", str(job), "--out", str(tmp_path / "hf"), "--hf"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    assert type(back).__name__ == EXPORTED.get(family, "LlamaForCausalLM")
    with torch.no_grad():
        assert torch.equal(back(input_ids=tokens).logits, want)  # measured: 0 apart
    wrong = {**model, **change} if "seq_len" in change else {**model, "options": {**model["options"], **change}}
    other, _ = _job(tmp_path, wrong)
    if message is None:  # (a change the folder takes: a sequence its window covers)
        check_init_from(other, "job.yaml")
        return
    with pytest.raises(SpecError, match="job.yaml: model.init_from: ") as e:
        check_init_from(other, "job.yaml")
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_folder_whose_layers_slide_in_part_is_refused_past_its_window(tmp_path):
    """Qwen2's window on from its layer max_window_layers on (transformers' rule), the
    layers before attending over the whole sequence: the built-in llama keeps a window in
    every layer or none, so a job whose sequence the window covers takes the folder, and a
    longer one is one line."""
    transformers = pytest.importorskip("transformers")
    from baton.api import check_init_from
    from baton.errors import SpecError

    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=1,
    )).save_pretrained(tmp_path / "folder")
    model = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 16, "init_from": str(tmp_path / "folder"),
             "options": {"kv_heads": 2, "hidden": 48, "qkv_bias": True, "norm_eps": 1e-6, "rope_theta": 10_000}}
    check_init_from(_job(tmp_path, model)[0], "job.yaml")
    with pytest.raises(SpecError) as e:
        check_init_from(_job(tmp_path, {**model, "seq_len": 17})[0], "job.yaml")
    assert str(e.value).endswith(
        "its layers from 1 on attend within a sliding window of 16 positions and those before over "
        "the whole sequence (its config.json), and the built-in llama keeps to a window in every "
        "layer or in none: set model.seq_len to at most 16, not 17"), str(e.value)


@pytest.mark.parametrize("sliding", [None, 6], ids=["whole", "sliding-window"])
def test_the_llamas_cached_decoding_gives_the_logits_of_the_whole_window(sliding):
    """The Llama-style model a position at a time on its cached (turned) keys and values:
    every position's logits those of one forward pass; generation the same with and without
    the cache, before and past the window. With a sliding window of attention (Mistral's)
    shorter than the sequence, the cache's positions past it too."""
    from baton.models.llama import llama_layers
    from baton.sample import generate

    torch.manual_seed(0)
    model = llama_layers(layers=3, width=32, heads=4, kv_heads=2, seq_len=16, vocab_size=64,
                         sliding_window=sliding).build().eval()
    ids = torch.randint(0, 64, (1, 16))
    with torch.no_grad():
        whole = model(ids)[0]
        caches, rows, x = [{} for _ in model], [], ids[:, :5]
        for t in [0, *range(5, 16)]:
            x = ids[:, t:t + 1] if t else x
            for layer, cache in zip(model, caches):
                x = layer.decode(x, cache, t)
            rows.append(x[0])
    assert caches[1]["k"].shape == (1, 2, 16, 8)  # the key-value heads only
    # 8.9e-8 at most over 5 seeds (logits up to 0.45), 6e-8 with the window: float32 rounding
    # of products of other shapes; 1e-5 as the GPT's
    torch.testing.assert_close(torch.cat(rows), whole, rtol=0, atol=1e-5)
    assert generate(model, [1, 2, 3], 40, 16, temperature=0) == \
        generate(model, [1, 2, 3], 40, 16, temperature=0, cache=False)


def _trained_export(tmp_path, hf: bool = False) -> tuple:
    """The test job, its model's parameters from seed 9 committed as step 2, and that
    checkpoint exported to tmp_path/out."""
    spec, _ = _job(tmp_path)
    trained = build_model(spec.model, 9).state_dict()
    _stages(CheckpointStore(spec.checkpoint_dir), 2, trained)
    baton.export(spec, str(tmp_path / "out"), hf=hf)
    return spec, trained


def _both_builds(model) -> tuple[dict, dict]:
    """The parameters `model` (a ModelSpec) starts with in the whole build (DDP's) and in the
    layer-by-layer one (sharded, pipeline and tp workers)."""
    from baton.models import build_lazily

    lazy, fill = build_lazily(model, 0)
    fill(list(lazy))
    return build_model(model, 0).state_dict(), lazy.state_dict()


@pytest.mark.parametrize("hf", [False, True], ids=["baton-names", "gpt2-names"])
def test_a_job_starts_from_an_exports_weights_however_its_model_is_built(tmp_path, hf):
    """`model.init_from: EXPORT` for the built-in GPT: the whole build (DDP's) and the
    layer-by-layer one (sharded workers, pipeline stages, tp workers: each layer filled from
    the export as it is made) both start at the exported parameters, from either form of the
    export; a job whose model does not match is one line at validation."""
    from baton import api
    from baton.errors import SpecError

    spec, trained = _trained_export(tmp_path, hf)
    tuned = baton.load({**spec.to_dict(), "model": {**GPT, "init_from": str(tmp_path / "out")}})
    for got in _both_builds(tuned.model):
        assert got.keys() == trained.keys()
        assert all(torch.equal(got[n], trained[n]) for n in trained)

    raw = tiny_spec(tmp_path, tmp_path / "data", name="other",
                    model={**GPT, "width": 64, "init_from": str(tmp_path / "out")})
    with pytest.raises(SpecError, match=r"model.init_from: .*out holds 0.tok.weight of shape "
                                        r"\[256, 32\], this model's is \[256, 64\]"):
        api.validate(write_spec(tmp_path / "other.yaml", raw))
    raw["model"]["init_from"] = str(tmp_path)
    with pytest.raises(SpecError, match="is not a folder baton export wrote"):
        api.validate(write_spec(tmp_path / "other.yaml", raw))
    # a baton.json or a file not as an export writes them: one line, not a traceback
    for about, data in (("[]", b""), ('{"model": {"name": "gpt"}, "files": ["x.safetensors"]}', b"junk")):
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "baton.json").write_text(about)
        (tmp_path / "bad" / "x.safetensors").write_bytes(data)
        raw["model"]["init_from"] = str(tmp_path / "bad")
        with pytest.raises(SpecError, match="is not an export baton can read"):
            api.validate(write_spec(tmp_path / "other.yaml", raw))


def test_init_fresh_keeps_the_models_own_values_of_the_parameters_it_names(tmp_path, capsys):
    """`model.init_fresh`: a pretrained backbone under a new vocabulary (embedding and head
    of another shape): the parameters it names keep the seed's values, every other one takes
    the export's, in the whole build and the layer-by-layer one; a pattern that names nothing,
    a mismatch it does not name and a pattern that names everything are one line each."""
    from baton import api
    from baton.errors import SpecError

    spec, trained = _trained_export(tmp_path)
    wide = {**GPT, "vocab_size": 512, "init_from": str(tmp_path / "out")}
    raw = tiny_spec(tmp_path, tmp_path / "data", name="tuned",
                    model={**wide, "init_fresh": ["0.tok.*", "*.lm.weight"]})
    tuned = baton.load(raw)
    own = build_model(spec_from_dict({**raw, "model": {**GPT, "vocab_size": 512}}).model, 0).state_dict()
    fresh = {"0.tok.weight", "3.lm.weight"}
    for got in _both_builds(tuned.model):
        assert got.keys() == own.keys()
        assert all(torch.equal(got[n], own[n] if n in fresh else trained[n]) for n in own)
    write_dataset(tmp_path / "data", num_samples=64, seq_len=GPT["seq_len"])
    assert cli.main(["validate", str(write_spec(tmp_path / "tuned.yaml", raw))]) == 0
    assert "fresh (its own initialization): 0.tok.weight, 3.lm.weight (32,768 values)" in \
        capsys.readouterr().out

    for model, message in (
            ({**wide, "init_fresh": ["0.tok.*", "9.*"]}, r"model.init_fresh: '9.\*' names no "
             r"parameter of this model \(its names: 0.tok.weight, 0.pos.weight, "),
            (wide, r"out holds 0.tok.weight of shape \[256, 32\], this model's is \[512, 32\]; "
             "model.init_fresh names those to keep the model's own values of"),
            ({**wide, "init_fresh": ["*"]}, "model.init_fresh names every parameter: nothing is taken"),
            ({**GPT, "init_fresh": ["3.*"]}, "model.init_fresh: \\['3.\\*'\\] is invalid; names "
             "parameters to leave out of model.init_from's, .*: set model.init_from")):
        with pytest.raises(SpecError, match=message):
            api.validate(write_spec(tmp_path / "tuned.yaml", {**raw, "model": model}))
    # a job that sets none keeps the fingerprint its checkpoints were written under
    assert "init_fresh" not in spec.recipe()["model"] and "init_fresh" in tuned.recipe()["model"]


def test_init_grow_fills_a_grown_vocabularys_first_rows_from_the_export(tmp_path, capsys):
    """`model.init_grow`: 4 tokens added at the end of a 256-token vocabulary: the embedding's
    and the head's first 256 rows are the export's, the 4 new ones the seed's, every other
    parameter the export's, in the whole build and the layer-by-layer one; what cannot grow
    is one line."""
    from baton import api
    from baton.errors import SpecError

    spec, trained = _trained_export(tmp_path)
    wide = {**GPT, "vocab_size": 260, "init_from": str(tmp_path / "out")}
    raw = tiny_spec(tmp_path, tmp_path / "data", name="grown",
                    model={**wide, "init_grow": ["0.tok.weight", "*.lm.weight"]})
    grown = baton.load(raw)
    own = build_model(spec_from_dict({**raw, "model": {**GPT, "vocab_size": 260}}).model, 0).state_dict()
    for got in _both_builds(grown.model):
        for n in own:
            if n in ("0.tok.weight", "3.lm.weight"):
                assert torch.equal(got[n][:256], trained[n]) and torch.equal(got[n][256:], own[n][256:]), n
            else:
                assert torch.equal(got[n], trained[n]), n
    write_dataset(tmp_path / "data", num_samples=64, seq_len=GPT["seq_len"])
    assert cli.main(["validate", str(write_spec(tmp_path / "grown.yaml", raw))]) == 0
    assert "grown (the export's rows first): 0.tok.weight (256 of 260 rows), 3.lm.weight (256 of " \
           "260 rows)" in capsys.readouterr().out

    for model, message in (
            ({**wide, "vocab_size": 128, "init_grow": ["0.tok.weight", "3.lm.weight"]},
             r"model.init_grow: .*out holds 0.tok.weight of shape \[256, 32\], which cannot fill "
             r"the first rows of this model's \[128, 32\]"),
            ({**wide, "width": 64, "heads": 4, "init_grow": ["0.tok.weight"]},
             r"cannot fill the first rows of this model's \[260, 64\]"),
            ({**wide, "init_grow": ["0.tok.weight", "3.lm.weight"], "init_fresh": ["3.*"]},
             "model.init_fresh and model.init_grow both name 3.lm.weight"),
            ({**wide, "init_grow": ["0.tok.weight", "7.*"]}, r"model.init_grow: '7.\*' names no parameter"),
            ({**GPT, "init_grow": ["0.*"]}, "model.init_grow: \\['0.\\*'\\] is invalid; .*: set model.init_from")):
        with pytest.raises(SpecError, match=message):
            api.validate(write_spec(tmp_path / "grown.yaml", {**raw, "model": model}))
    assert "init_grow" not in spec.recipe()["model"] and "init_grow" in grown.recipe()["model"]


def test_safetensors_files_written_and_read_here_are_the_formats(tmp_path):
    """tensorfile writes what the safetensors package reads, and reads what it writes: every
    dtype a model or its buffers hold, an empty tensor, a scalar, a transposed view, tensors
    sharing memory (a tied head); a file that is not one (or cut short) is one line."""
    import pyarrow.fs as pafs
    from safetensors import safe_open
    from safetensors.torch import save_file

    from baton.checkpoint import tensorfile

    g = torch.Generator().manual_seed(0)
    shared = torch.randn(4, 3, generator=g)
    tensors = {"f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(7, generator=g).bfloat16(),
               "f16": torch.randn(2, 2, generator=g).half(), "i64": torch.arange(6).reshape(2, 3),
               "u8": torch.arange(9, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5), "view": shared.t(),
               "tied": shared}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    with open(ours, "wb") as f:
        written = tensorfile.write(f, tensors, {"format": "pt"})
    assert written == ours.stat().st_size
    with safe_open(str(ours), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
        assert all(torch.equal(f.get_tensor(n), t) for n, t in tensors.items())
    save_file({n: t.clone().contiguous() for n, t in tensors.items()}, str(theirs), metadata={"format": "pt"})
    for path in (ours, theirs):
        with tensorfile.TensorFile(pafs.LocalFileSystem(), str(path)) as f:
            assert f.metadata == {"format": "pt"} and f.shape("view") == (3, 4)
            for n, t in tensors.items():
                got = f.get(n)
                assert got.dtype == t.dtype and torch.equal(got, t), n

    data = ours.read_bytes()
    for name, broken in (("short", data[:5]), ("huge-header", (10**12).to_bytes(8, "little") + data[8:]),
                         ("not-json", data[:8] + b"{" * (len(data) - 8)),
                         ("cut", data[:-4])):
        (tmp_path / name).write_bytes(broken)
        with pytest.raises(CheckpointError, match=f"{name} is not a safetensors file"):
            tensorfile.TensorFile(pafs.LocalFileSystem(), str(tmp_path / name))


def test_an_export_to_object_storage_loads_back_and_starts_jobs(tmp_path, s3_endpoint, capsys, monkeypatch):
    """`baton export --out s3://...` (moto's S3 server on 127.0.0.1): files of Hugging Face's
    sharded layout, nothing else left beside them; `load_model`, `baton sample`-style reading
    and `model.init_from` read it there, a layer at a time; `baton validate` checks a job
    against it from its headers; an export that fails leaves no files, and one that exists is
    not overwritten."""
    import pyarrow.fs as pafs

    from baton import api
    from baton.checkpoint import tensorfile
    from baton.errors import CheckpointError, SpecError

    fs, _ = pafs.FileSystem.from_uri(f"s3://exports?{s3_endpoint}&allow_bucket_creation=true")
    fs.create_dir("exports")
    spec, job = _job(tmp_path)
    trained = build_model(spec.model, 9).state_dict()
    _stages(CheckpointStore(spec.checkpoint_dir), 2, trained)
    uri = f"s3://exports/gpt?{s3_endpoint}"
    assert cli.main(["export", str(job), "--out", uri, "--max-file-mb", "1"]) == 0
    assert capsys.readouterr().out.startswith("exported step 2 of exp: ")
    listed = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("exports/gpt")))
    assert listed == ["baton.json", "model.safetensors"]
    small = baton.export(spec, f"s3://exports/small?{s3_endpoint}", max_shard_bytes=20_000)
    listed = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector("exports/small")))
    assert len(small["files"]) > 2 and listed == sorted(
        ["baton.json", "model.safetensors.index.json", *small["files"]])

    for where in (uri, f"s3://exports/small?{s3_endpoint}"):
        back = baton.load_model(where).state_dict()
        assert back.keys() == trained.keys() and all(torch.equal(back[n], trained[n]) for n in trained)
    tuned = baton.load({**spec.to_dict(), "model": {**GPT, "init_from": uri}})
    for got in _both_builds(tuned.model):
        assert all(torch.equal(got[n], trained[n]) for n in trained)
    raw = tiny_spec(tmp_path, tmp_path / "data", name="other", model={**GPT, "width": 64, "init_from": uri})
    with pytest.raises(SpecError, match=r"model.init_from: .* holds 0.tok.weight of shape \[256, 32\], "
                                        r"this model's is \[256, 64\]"):
        api.validate(write_spec(tmp_path / "other.yaml", raw))

    with pytest.raises(CheckpointError, match="exports/gpt.* already exists; choose a new --out"):
        baton.export(spec, uri)
    real, calls = tensorfile.write, []

    def fails_on_the_second_file(f, tensors, metadata=None):  # a store gone halfway through
        calls.append(1)
        if len(calls) == 2:
            raise OSError("the store went away")
        return real(f, tensors, metadata)
    with monkeypatch.context() as patched:
        patched.setattr(tensorfile, "write", fails_on_the_second_file)
        with pytest.raises(OSError, match="the store went away"):
            baton.export(spec, f"s3://exports/failed?{s3_endpoint}", max_shard_bytes=20_000)
    assert len(calls) == 2 and fs.get_file_info("exports/failed").type == pafs.FileType.NotFound
    with pytest.raises(CheckpointError, match="is not a folder baton export wrote"):
        baton.load_model(f"s3://exports/failed?{s3_endpoint}")

    # an hf: model's export there: transformers reads a local copy of it
    pytest.importorskip("transformers")
    hf_model = {"name": "hf:gpt2", "seq_len": 32, "vocab_size": 256,
                "config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 32}}
    (tmp_path / "hf").mkdir()
    hf_spec, _ = _job(tmp_path / "hf", hf_model)
    hf_trained = build_model(hf_spec.model, 5).state_dict()
    store = CheckpointStore(hf_spec.checkpoint_dir)
    store.begin(2)
    store.commit(2, {"step": 2, "layout": {"pp": 1}}, keep=5, parts=[
        store.write_tensors(2, "model-0000.pt", hf_trained),
        store.write_tensors(2, "optim-0000.pt", {"state": {}, "param_groups": []})])
    hf_uri = f"s3://exports/hf?{s3_endpoint}"
    baton.export(hf_spec, hf_uri)
    started = build_model(baton.load({**hf_spec.to_dict(), "model": {**hf_model, "init_from": hf_uri}}).model, 0)
    assert all(torch.equal(started.state_dict()[n], t) for n, t in hf_trained.items())


def test_a_fork_starts_a_new_job_at_another_jobs_checkpoint(tmp_path, capsys):
    """`baton fork NEW --from OLD`: the old job's checkpoint (its every part, byte for byte)
    becomes the new job's first, under the new job's name and recipe and with no MLflow run
    of the old one, so the new job resumes from it; its training settings may differ, its
    model, data and the rest of its recipe may not (one line naming what differs, nothing
    written); a job with checkpoints is never forked into."""
    from baton import api
    from baton.errors import CheckpointError
    from baton.storage import redact

    spec, job = _job(tmp_path)
    store = CheckpointStore(spec.checkpoint_dir)
    state = build_model(spec.model, 3).state_dict()
    for step in (4, 6):
        _stages(store, step, {n: t + step for n, t in state.items()}, recipe=redact(spec.recipe()))
    raw = tiny_spec(tmp_path, tmp_path / "data", name="branch", model=GPT,
                    train={"steps": 10, "lr": 3e-4, "min_lr": 3e-5, "schedule": "wsd", "grad_clip": 0.5})
    branch = write_spec(tmp_path / "branch.yaml", raw)
    assert cli.main(["fork", str(branch), "--from", str(job), "--step", "4"]) == 0
    assert capsys.readouterr().out.startswith("branch starts at step 4 of exp (its weights, optimizer state")
    new = CheckpointStore(spec_from_dict(raw).checkpoint_dir)
    assert new.committed_steps() == [4] and new.verify(4) is None
    meta = new.read_meta(4)
    assert meta["job"] == "branch" and meta["fingerprint"] == spec_from_dict(raw).fingerprint()
    assert meta["mlflow_run_id"] is None and meta["forked_from"]["job"] == "exp"
    for part in ("model-0000.pt", "model-0001.pt", "optim-0000.pt"):
        assert ((tmp_path / "ckpt" / "branch" / "step_00000004" / part).read_bytes()
                == (tmp_path / "ckpt" / "exp" / "step_00000004" / part).read_bytes())
    resumed, failed = api.plan_resume(spec_from_dict(raw), "branch.yaml", None)
    assert resumed["step"] == 4 and not failed

    with pytest.raises(CheckpointError, match="job 'branch' already has checkpoints in .*: a fork "
                                              "starts a new job"):
        baton.fork(str(branch), spec)
    with pytest.raises(CheckpointError, match="job 'exp' is job 'exp'"):
        baton.fork(spec, spec)
    with pytest.raises(CheckpointError, match="job 'short' would start finished: train.steps is 3, "
                                              "the checkpoint is at step 6"):
        baton.fork({**raw, "name": "short", "train": {**raw["train"], "steps": 3}}, spec)
    for name, section, changed, message in (
            ("wide", "model", {"width": 64}, "model.width 32 -> 64"),
            ("decay", "train", {"weight_decay": 0.0}, "train.weight_decay 0.1 -> 0.0"),
            ("seeded", "train", {"seed": 5}, "train.seed 7 -> 5")):
        other = tiny_spec(tmp_path, tmp_path / "data", name=name, model=GPT)
        other[section] = {**other[section], **changed}
        other["train"] = {**other["train"], "steps": 10}
        with pytest.raises(CheckpointError, match=f"checkpoint 6 of 'exp' is not a start for "
                                                  f"'{name}': {message} \\(a fork may change train.lr"):
            baton.fork(other, spec)
        assert not (tmp_path / "ckpt" / name).exists()


def test_the_average_of_the_weights_exports_from_a_file_per_stage(tmp_path):
    """`--ema` from a pipeline's checkpoint (a file per stage): each parameter's average in
    place of its weights, a parameter without one (frozen: no optimizer state) as it is; a
    checkpoint without averages is one line."""
    spec, job = _job(tmp_path)
    state = build_model(spec.model, 3).state_dict()
    averages = {n: {"step": torch.tensor(5.0), "ema": t * 2} for n, t in state.items()
                if n != "0.tok.weight"}
    store = CheckpointStore(spec.checkpoint_dir)
    _stages(store, 4, state)
    _stages(store, 6, state, optim=averages)
    baton.export(spec, str(tmp_path / "avg"), ema=True)
    got = load_file(str(tmp_path / "avg" / "model.safetensors"))
    assert got.keys() == state.keys()
    assert all(torch.equal(got[n], state[n] * (1 if n == "0.tok.weight" else 2)) for n in state)
    assert json.loads((tmp_path / "avg" / "baton.json").read_text())["weights"] == "ema"
    with pytest.raises(CheckpointError, match="checkpoint 4 .* holds no average of the weights"):
        baton.export(spec, str(tmp_path / "none"), step=4, ema=True)
