"""The job spec: every shipped job loads; bad input is refused with one clear line, before
anything is created."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from baton import cli
from baton.errors import SpecError
from baton.models import build_model
from baton.spec import JobSpec, load_spec, spec_from_dict
from conftest import REPO
from helpers import tiny_spec, write_dataset, write_spec

JOBS = sorted((REPO / "jobs").glob("*.yaml"))


def test_there_are_jobs():
    assert any(p.name == "quickstart.yaml" for p in JOBS)


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_job_file_loads(path):
    spec = load_spec(path)
    assert isinstance(spec, JobSpec) and spec.name


def test_overrides_and_flat_params(tmp_path):
    data = write_dataset(tmp_path / "d", 16, 32)
    path = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data))
    spec = load_spec(path, ["train.steps=42", "train.lr=3e-2", "parallel.dp=1"])
    assert (spec.train.steps, spec.train.lr, spec.parallel.dp) == (42, 3e-2, 1)
    flat = spec.flat()
    assert flat["train.steps"] == 42 and flat["model.name"] == "gpt"
    # an exponent without a dot is a number, as in YAML 1.2 (1.1 reads "1e-6" as text), where
    # no typed key turns it back into one: a model's options
    llama = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32}
    path = write_spec(tmp_path / "llama.yaml", tiny_spec(tmp_path, data, model=llama))
    (path.parent / "text.yaml").write_text(path.read_text().replace("name: llama", "name: llama\n  options: {norm_eps: 1e-6}"))
    for spec, want in ((load_spec(path, ["model.options.norm_eps=2E-6"]), 2e-6),
                       (load_spec(path.parent / "text.yaml"), 1e-6)):
        eps = spec.model.options["norm_eps"]
        assert type(eps) is float and eps == want


def test_micro_batching_resolves_from_either_key(tmp_path):
    base = tiny_spec(tmp_path, tmp_path)
    def spec(train, parallel):
        return spec_from_dict({**base, "train": {**base["train"], **train},
                               "parallel": {**base["parallel"], **parallel}})
    a = spec({"global_batch": 32, "micro_batch": None}, {"dp": 2, "microbatches": 8})
    b = spec({"global_batch": 32, "micro_batch": 2}, {"dp": 2})
    c = spec({"global_batch": 36, "micro_batch": None}, {"dp": 2})  # 18 per replica: 6 x 3
    assert (a.micro_batch, a.microbatches) == (b.micro_batch, b.microbatches) == (2, 8)
    assert (c.micro_batch, c.microbatches) == (6, 3)
    assert spec({}, {"pp": 2, "schedule": "interleaved-1f1b", "dp": 1}).chunks == 2


def test_gpu_pipelines_refuse_schedules_nccl_cannot_order(tmp_path):
    base = tiny_spec(tmp_path, tmp_path, model={"name": "gpt", "layers": 2, "width": 32,
                                                "heads": 2, "seq_len": 32})
    raw = {**base, "train": {**base["train"], "global_batch": 5, "micro_batch": None},
           "parallel": {"dp": 1, "pp": 2, "schedule": "interleaved-1f1b", "microbatches": 5}}
    assert spec_from_dict(raw).chunks == 2  # gloo matches by tag: fine on CPU
    gpu = {**raw, "resources": {"gpus_per_worker": 1}}
    with pytest.raises(SpecError, match="NCCL matches messages by order"):
        spec_from_dict(gpu)


def test_fingerprint_ignores_steps_and_layout_but_not_the_model(tmp_path):
    base = tiny_spec(tmp_path, tmp_path)
    a = spec_from_dict(base)
    b = spec_from_dict({**base, "train": {**base["train"], "steps": 99, "rewind_on_spike": {}},
                        "parallel": {"dp": 1}, "resources": {"cpus_per_worker": 1}})
    c = spec_from_dict({**base, "model": {**base["model"], "width": 64}})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()
    # a mix: its sources are the recipe; their weights are pinned with their files (resumed
    # with --rebase-data: tests/unit/test_data.py), the names of their metrics are not
    mix = [{"path": "a", "weight": 1}, {"path": "b", "weight": 3}]
    mixed = [spec_from_dict({**base, "data": {**base["data"], "mix": m}}) for m in (
        mix, [dict(mix[0], name="web"), mix[1]], [mix[0], dict(mix[1], weight=2)],
        [mix[0], dict(mix[1], path="c")])]
    assert mixed[0].fingerprint() == mixed[1].fingerprint() == mixed[2].fingerprint() != mixed[3].fingerprint()
    phased = spec_from_dict({**base, "data": {**base["data"], "mix": mix,
                                              "mix_phases": [{"after_step": 5, "weights": [0, 1]}]}})
    assert phased.fingerprint() == mixed[0].fingerprint()  # pinned with the files, as weights are
    assert a.fingerprint() != mixed[0].fingerprint()
    # documents kept apart are the recipe where set; unset, the recipe of a checkpoint
    # written before data.document_mask existed (no key for it)
    assert "document_mask" not in a.recipe()["data"] and "eod_token" not in a.recipe()["data"]
    masked = [spec_from_dict({**base, "data": {**base["data"], "document_mask": True, **eod}})
              for eod in ({}, {"eod_token": 0}, {"eod_token": 10})]
    assert len({a.fingerprint(), *(m.fingerprint() for m in masked)}) == 4


# (override of the valid tiny spec, or raw YAML text; the message the user must see)
BROKEN = [
    ({"train": {"lrr": 0.1}}, "train.lrr: unknown key; did you mean 'lr'?"),
    ({"train": {"steps": "ten"}}, "train.steps: expected an integer, got a string 'ten'"),
    ({"train": {"lr": -0.1}}, "train.lr: -0.1 is invalid; must be > 0"),
    ({"train": {"ema": 1.5}}, "train.ema: 1.5 is invalid; is the average's decay, in (0, 1)"),
    ({"train": {"global_batch": 10, "micro_batch": 2}},
     "train.global_batch: 10 is invalid; must be a multiple of parallel.dp x train.micro_batch = 2 x 2 = 4"),
    ({"parallel": {"dp": 512}, "train": {"global_batch": 1024}}, "parallel.dp: 512 is invalid; 512 workers x resources.cpus_per_worker 0.5 need 256 CPUs"),
    ({"data": {"path": "no/such/folder"}}, "data.path: 'no/such/folder' does not exist"),
    ({"model": {"name": "transformer"}}, "model.name: 'transformer' is invalid; use one of gpt, llama, mlp"),
    ({"model": {"name": "llama", "heads": 4, "options": {"kv_heads": 3}}},
     "model.options.kv_heads: 3 is invalid; must divide model.heads (4)"),
    ({"model": {"name": "llama", "width": 12, "heads": 4}},
     "model.heads: 4 is invalid; must leave an even head width (model.width 12 / heads 4 is 3)"),
    ({"model": {"name": "llama", "options": {"kv_head": 2}}},
     "model.options: {'kv_head': 2} is invalid; llama takes no option 'kv_head' (did you mean 'kv_heads'?); "
     "it takes kv_heads, hidden, rope_theta, norm_eps, qkv_bias, qk_norm, head_dim, rope_factor"),
    ({"model": {"name": "llama", "width": 12, "heads": 4, "options": {"head_dim": 5}}},
     "model.options.head_dim: 5 is invalid; must be even: rotary positions turn pairs of numbers"),
    ({"model": {"name": "llama", "options": {"norm_eps": "tiny"}}},
     "model.options: {'norm_eps': 'tiny'} is invalid; norm_eps must be a number in [1e-12, 0.1], not 'tiny'"),
    ({"model": {"name": "llama", "options": {"qkv_bias": 1}}},
     "model.options: {'qkv_bias': 1} is invalid; qkv_bias must be true or false, not 1"),
    ({"model": {"name": "llama", "options": {"rope_original_seq_len": 8192}}},
     "model.options.rope_original_seq_len: 8192 is invalid; scales the rotary embedding with "
     "model.options.rope_factor (Llama 3.1's scaling), which is not given"),
    ({"model": {"name": "llama", "options": {"rope_factor": 8, "rope_high_freq_factor": 1}}},
     "model.options.rope_high_freq_factor: 1 is invalid; must be more than rope_low_freq_factor (1.0)"),
    ({"model": {"width": 31}}, "model.heads: 2 is invalid; must divide model.width (31); try 1"),
    ({"parallel": {"pp": 5}}, "parallel.pp: 5 is invalid; the model has 4 layers (model.layers plus embedding and head), fewer than 5 stages; use pp <= 4"),
    ({"parallel": {"dp": 1, "pp": 3, "schedule": "interleaved-1f1b"}}, "parallel.pp: 3 is invalid; the model has 4 layers (model.layers plus embedding and head), fewer than 3 stages x 2 chunks; use pp <= 2"),
    ({"parallel": {"pp": 2, "microbatches": 0}}, "parallel.microbatches: 0 is invalid; must be at least 1"),
    ({"parallel": {"pp": 2, "schedule": "zigzag"}}, "parallel.schedule: 'zigzag' is not one of gpipe | 1f1b | interleaved-1f1b"),
    ({"parallel": {"dp": 1, "pp": 3, "partition": [1, 1, 1]}}, "parallel.partition: [1, 1, 1] is invalid; give 3 layer counts, each >= 1, summing to the model's 4 layers (e.g. [2, 1, 1])"),
    ({"parallel": {"pp": 2, "partition": "flops"}}, "parallel.partition: 'flops' is not one of params | time"),
    ({"parallel": {"dp": 1, "pp": 2, "microbatches": 3}, "train": {"micro_batch": None}}, "parallel.microbatches: 3 is invalid; must divide the 8 samples each replica gets per step"),
    ({"parallel": {"dp": 1, "pp": 2, "schedule": "1f1b", "chunks": 2}}, "parallel.chunks: 2 is invalid; only interleaved-1f1b runs several chunks per rank"),
    ({"parallel": {"dp": 1, "pp": 2, "microbatches": 2}}, "parallel.microbatches: 2 is invalid; dp x microbatches x train.micro_batch must equal train.global_batch (1 x 2 x 2 != 8)"),
    ({"train": {"schedule": "step"}}, "train.schedule: 'step' is not one of cosine | linear | constant | wsd"),
    ({"train": {"decay_steps": 10}}, "train.decay_steps: 10 is invalid; is wsd's (warmup-stable-decay); "
                                     "train.schedule is cosine"),
    ({"train": {"schedule": "wsd", "decay_steps": 0}},
     "train.decay_steps: 0 is invalid; must be in [1, train.steps = "),
    ({"train": {"compile": 1}}, "train.compile: 1 is not one of true | false | auto"),  # 1 == True in Python
    ({"model": {"seq_len": 64}}, "model.seq_len: 64 does not fit the data; rows of"),
    ({"name": "has space"}, "name: 'has space' is invalid"),
    ({"data": {"source": "stdlib", "loss_mask_column": "loss_mask"}},
     "data.loss_mask_column: 'loss_mask' is invalid; the built-in stdlib data has no loss mask"),
    ({"task": "classification", "data": {"loss_mask_column": "loss_mask"}},
     "data.loss_mask_column: 'loss_mask' is invalid; marks a language model's targets"),
    ({"data": {"document_mask": True}}, "data.document_mask: data.path "),
    ({"data": {"eod_token": 10}},
     "data.eod_token: 10 is invalid; is read by data.document_mask alone: set data.document_mask: true"),
    ({"data": {"document_mask": True, "eod_token": 256}},
     "data.eod_token: 256 is invalid; give a token id of the vocabulary, 0 to 255"),
    ({"task": "classification", "data": {"document_mask": True}},
     "data.document_mask: True is invalid; separates the documents of a language model's rows"),
    ({"model": {"name": "hf:gpt2", "config": {"n_layer": 2, "n_embd": 32, "n_head": 2}}, "data": {"document_mask": True}},
     "data.document_mask: True is invalid; hf:gpt2's attention takes no document mask here"),
    ({"checkpoint": {"keep": 0}}, "checkpoint.keep: 0 is invalid; must be at least 1"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "no/such"}]}}, "data.mix[1].path: 'no/such' does not exist"),
    ({"data": {"mix": [{"path": "../data"}]}}, "data.mix: ['../data'] is invalid; mixes two or more datasets"),
    ({"data": {"mix": [{"path": "../data", "weight": 0}, {"path": "../data", "name": "b"}]}},
     "data.mix[0].weight: 0.0 is invalid; must be > 0"),
    ({"data": {"source": "stdlib", "mix": [{"path": "../data"}, {"path": "../data", "name": "b"}]}},
     "data.source: 'stdlib' is invalid; data.mix reads Parquet datasets"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data"}]}},
     "data.mix[0].name: None is invalid; 'data' names two sources; give each a name of its own"),
    ({"data": {"mix": [{"path": "../data", "name": "a/b"}, {"path": "../data"}]}},
     "data.mix[0].name: 'a/b' is invalid; names its held-out metrics (eval_loss/NAME)"),
    ({"data": {"mix_phases": [{"after_step": 2, "weights": [1]}]}},
     "data.mix_phases: [{'after_step': 2, 'weights': [1.0]}] is invalid; changes the weights of data.mix: give data.mix too"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data", "name": "b"}], "mix_phases": [{"after_step": 0, "weights": [1, 1]}]}},
     "data.mix_phases[0].after_step: 0 is invalid; must be at least 1"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data", "name": "b"}], "mix_phases": [{"after_step": 5, "weights": [1, 1]}, {"after_step": 5, "weights": [1, 2]}]}},
     "data.mix_phases[1].after_step: 5 is invalid; must be after the phase before it (data.mix_phases[0].after_step: 5)"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data", "name": "b"}], "mix_phases": [{"after_step": 5, "weights": [1]}]}},
     "data.mix_phases[0].weights: [1.0] is invalid; give one weight for each of the 2 sources of data.mix"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data", "name": "b"}], "mix_phases": [{"after_step": 5, "weights": [0, 0]}]}},
     "data.mix_phases[0].weights: [0.0, 0.0] is invalid; each must be 0 to 1,000,000 (0: none of that source's samples), and one above 0"),
    ({"data": {"mix": [{"path": "../data"}, {"path": "../data", "name": "b"}], "mix_phases": [{"after_step": 5}]}},
     "data.mix_phases[0].weights: required key is missing"),
    ({"train": {"rewind_on_spike": {"factor": 1}}},
     "train.rewind_on_spike.factor: 1.0 is invalid; must be above 1 (a loss that many times the window's median is a spike), at most 1e6"),
    ({"train": {"rewind_on_spike": {"window": 1}}},
     "train.rewind_on_spike.window: 1 is invalid; must be 2 to 10,000 steps"),
    ({"train": {"rewind_on_spike": {"most": 0}}},
     "train.rewind_on_spike.most: 0 is invalid; must be 1 to 1,000 rewinds in a run (the next spike fails it)"),
    ({"train": {"rewind_on_spike": {"factr": 2}}},
     "train.rewind_on_spike.factr: unknown key; did you mean 'factor'?"),
    ({"model": {"name": "nosuchmodule:build"}}, "model.name: 'nosuchmodule:build' is invalid; cannot load the builder"),
    ("name: x\ntrain: {steps: 3\n", "not valid YAML at line"),
    ("- just\n- a list\n", "the top level must be a mapping of sections, got a list"),
    ("model: {name: gpt}\n", "name: required key is missing"),
]


@pytest.mark.parametrize("broken,message", BROKEN, ids=[m.split(":")[0] for _, m in BROKEN])
def test_bad_input_is_refused_before_anything_is_created(tmp_path, monkeypatch, capsys, broken, message):
    data = write_dataset(tmp_path / "data", 16, 32)
    work = tmp_path / "work"
    work.mkdir()
    job = work / "job.yaml"
    if isinstance(broken, str):
        job.write_text(broken)
    else:
        spec = tiny_spec(tmp_path, data)
        spec["checkpoint"]["path"] = "ckpt"  # relative: inside `work`
        spec["tracking"]["uri"] = None  # the default: ./mlflow.db inside `work`
        for section, values in broken.items():
            spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
        write_spec(job, spec)
    monkeypatch.chdir(work)
    before = sorted(os.listdir(work))

    code = cli.main(["run", "job.yaml"])

    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert lines[0].startswith("baton: error: job.yaml: ") and message in lines[0], lines[0]
    assert sorted(os.listdir(work)) == before  # no checkpoint folder, no mlflow.db, no data
    assert sorted(os.listdir(tmp_path)) == ["data", "work"]


def test_validate_command_in_a_fresh_process(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\ntrain: {lr: -1}\n")
    proc = subprocess.run([sys.executable, "-m", "baton.cli", "validate", str(job)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == f"baton: error: {job}: train.lr: -1.0 is invalid; must be > 0 (e.g. 3e-4)\n"
    assert proc.stdout == ""


def test_the_driver_imports_no_torch(tmp_path):
    """`baton run`'s driver checks the spec, the data and the checkpoint folder before Ray
    starts, then runs the coordinator, which makes the worker actors: none of those modules
    imports torch, which only the workers use. Importing it cost every refusal and `baton
    validate` 1.5 s (0.43 s against 1.9 s for `baton validate jobs/quickstart.yaml` on the
    2-core machine), and every run 1.9 CPU-s of a start that the workers' own imports need
    (docs/benchmarks.md)."""
    data = write_dataset(tmp_path / "data", 64, 128)
    probe = ("import sys; from baton import api; from baton.spec import load_spec; "
             f"spec = load_spec({str(REPO / 'jobs' / 'quickstart.yaml')!r}, "
             f"['data.path={data}', 'data.source=parquet']); "
             "api.plan_resume(spec, 'job', None); api.validate; "
             "from baton.data.source import preflight; preflight(spec, 'job'); "
             "from baton.coordinator import Coordinator; from baton.workers import WorkerGroup; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout[:500]


def test_spec_error_is_picklable():
    import pickle

    e = pickle.loads(pickle.dumps(SpecError("f: k: bad")))
    assert isinstance(e, SpecError) and str(e) == "f: k: bad"


def test_validate_shows_the_corpus_as_the_run_will_see_it(tmp_path, capsys):
    from baton import cli
    from helpers import tiny_spec, write_dataset, write_spec

    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32, row_group_rows=16)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="v"))
    assert cli.main(["validate", str(job)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"  data: 64 samples in 4 row groups of 2 files \([\d.]+ MiB\), manifest "
                        r"[0-9a-f]{16}; a full permutation each epoch", out[1]), out
    assert cli.main(["validate", str(job), "--set", "data.shuffle_block=20"]) == 0
    assert capsys.readouterr().out.splitlines()[1].endswith("shuffled in 4 blocks of 20 samples")


SHARDING_ERRORS = [
    ({"dp": 1, "shard": "full"}, "parallel.shard: 'full' is invalid; sharding splits state across "
                                 "replicas and this job has one"),
    ({"dp": 4, "shard": "full", "shard_group": 3}, "parallel.shard_group: 3 is invalid; must divide "
                                                   "parallel.dp = 4"),
    ({"dp": 4, "shard": "full", "shard_group": 1}, "parallel.shard_group: 1 is invalid; must be at least 2"),
    ({"dp": 4, "shard_group": 2}, "parallel.shard_group: 2 is invalid; hybrid sharding needs a shard level"),
    ({"dp": 2, "pp": 2, "shard": "optimizer", "microbatches": 2},
     "parallel.shard: 'optimizer' is invalid; ZeRO-1 inside pipeline stages (parallel.pp = 2) is "
     "not supported"),
]


TENSOR_ERRORS = [
    ({"dp": 1, "tp": 4},  # the tiny GPT has 2 heads
     "parallel.tp: 4 is invalid; gpt's layer 1: 2 heads do not split over tp = 4"),
    ({"dp": 1, "tp": 0}, "parallel.tp: 0 is invalid; must be at least 1"),
    ({"dp": 2, "sequence_parallel": True},
     "parallel.sequence_parallel: True is invalid; splits the sequence over the tp workers: "
     "set parallel.tp > 1"),
    ({"dp": 1, "tp": 3},  # 256 tokens
     "parallel.tp: 3 is invalid; gpt's 0.tok has 256 rows (its vocabulary), which do not split "
     "into 1 x 3 equal pieces; make the vocabulary a multiple of that"),
]
LAYOUT_ERRORS = SHARDING_ERRORS + TENSOR_ERRORS


def test_a_llamas_key_value_heads_must_split_over_tp(tmp_path):
    raw = tiny_spec(tmp_path, tmp_path, train={"global_batch": 16, "micro_batch": None},
                    parallel={"dp": 1, "tp": 2},
                    model={"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
                           "options": {"kv_heads": 1}})
    with pytest.raises(SpecError) as e:
        spec_from_dict(raw, "job.yaml")
    assert str(e.value) == ("job.yaml: parallel.tp: 2 is invalid; llama's layer 1: its key-value "
                            "heads (model.options.kv_heads = 1) do not split over tp = 2")
    raw["model"]["options"] = {"kv_heads": 2}
    spec_from_dict(raw, "job.yaml")  # one of each worker's


@pytest.mark.parametrize("options,parallel,message", [
    ({"experts": 4, "shared_expert": 33}, {"tp": 2}, "parallel.tp: 2 is invalid; llama's "
     "1.shared.gate has 33 output features, which do not split into 1 x 2 equal pieces"),
    ({"experts": 4, "experts_per_token": 5}, {}, "model.options.experts_per_token: 5 is invalid; "
     "must be at most model.options.experts (4): each token goes to that many experts"),
    ({"norm_topk": False}, {}, "model.options.norm_topk: False is invalid; routes tokens among a "
     "mixture's experts, and model.options.experts is not given"),
    ({"shared_expert": 64}, {}, "model.options.shared_expert: 64 is invalid; routes tokens among a "
     "mixture's experts, and model.options.experts is not given"),
    ({}, {"dp": 2, "ep": 2}, "parallel.ep: 2 is invalid; splits a mixture of experts' experts, and "
     "the model has none (model.options.experts of the built-in llama)"),
    ({"experts": 3}, {"dp": 2, "ep": 2}, "parallel.ep: 2 is invalid; must divide "
     "model.options.experts (3): each replica of a group holds as many"),
    ({"experts": 8}, {"dp": 4, "ep": 8}, "parallel.ep: 8 is invalid; must divide parallel.dp (4) "
     "and elastic.min_dp and max_dp (4, 4): every world holds whole groups of ep replicas"),
    ({"experts": 4}, {"dp": 2, "ep": 2, "shard": "optimizer"}, "parallel.shard: 'optimizer' is "
     "invalid; is not built with expert parallelism (parallel.ep = 2) in this version (ZeRO-1's "
     "optimizer splits every parameter by its place in the model): use grads or full, which "
     "shard the rest over each group of ep replicas, or none"),
    ({"experts": 4}, {"dp": 4, "ep": 2, "shard": "full", "shard_group": 4}, "parallel.shard_group: 4 "
     "is invalid; must equal parallel.ep (2) under expert parallelism: the replicas that split "
     "the experts shard the rest of the model (leave it out: it is ep)")])
def test_a_mixture_of_experts_mistakes_are_one_line_each(tmp_path, options, parallel, message):
    raw = tiny_spec(tmp_path, tmp_path, train={"global_batch": 16, "micro_batch": None},
                    parallel={"dp": 1, **parallel},
                    model={"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
                           "options": options})
    with pytest.raises(SpecError) as e:
        spec_from_dict(raw, "job.yaml")
    assert str(e.value) == f"job.yaml: {message}"


@pytest.mark.parametrize("model,parallel,message", [
    ({"options": {"kv_heads": 2}}, {"cp": 4}, "parallel.cp: 4 is invalid; llama's layer 1: its "
     "key-value heads (model.options.kv_heads = 2) do not split over cp = 4: each cp worker "
     "attends with a cp-th of every block's heads; parallel.cp_attention: all_gather or ring splits "
     "none"),
    ({"name": "gpt", "heads": 2, "options": {}}, {"cp": 4}, "parallel.cp: 4 is invalid; gpt's layer 1: its 2 "
     "heads do not split over cp = 4: each cp worker attends with a cp-th of every block's heads"),
    ({"seq_len": 30}, {"cp": 4}, "parallel.cp: 4 is invalid; splits model.seq_len = 30 into equal "
     "parts: make it a multiple of cp"),
    ({"name": "mlp", "context": 4, "options": {}}, {"cp": 2}, "parallel.cp: 2 is invalid; model "
     "'mlp' has no block whose attention takes a split sequence"),
    # with tensor parallelism each cp worker holds a tp-th of the heads: tp x cp must divide them
    ({"options": {"kv_heads": 2}}, {"cp": 2, "tp": 2}, "parallel.cp: 2 is invalid; llama's layer 1: "
     "its key-value heads (model.options.kv_heads = 2) do not split over tp x cp = 2 x 2: each cp "
     "worker attends with a cp-th of every block's heads (of its tp worker's share)"),
    ({"seq_len": 36}, {"cp": 2, "tp": 4, "sequence_parallel": True}, "parallel.sequence_parallel: "
     "True is invalid; splits model.seq_len = 36 over tp = 4, each of cp = 2 parts of it: make it "
     "a multiple of 8"),
    ({}, {"cp_attention": "all_gather"}, "parallel.cp_attention: 'all_gather' is invalid; says how "
     "context parallelism's workers attend: set parallel.cp > 1, or leave it out"),
    ({"dropout": 0.1}, {"cp": 2, "cp_attention": "ring"}, "model.dropout: 0.1 is invalid; drops "
     "attention's probabilities, which ring attention (parallel.cp_attention: ring) does not: set "
     "it to 0, or take all_to_all or all_gather"),
    ({"seq_len": 36}, {"cp": 4, "cp_attention": "ring"}, "parallel.cp: 4 is invalid; on a ring "
     "splits model.seq_len = 36 into 2 x cp equal pieces (each worker two, zigzag): make it a "
     "multiple of 8"),
    ({}, {"cp": 2, "cp_attention": "rings"}, "parallel.cp_attention: 'rings' is not one of "
     "all_to_all | all_gather | ring")])
def test_context_parallel_mistakes_are_one_line_each(tmp_path, model, parallel, message):
    raw = tiny_spec(tmp_path, tmp_path, train={"global_batch": 16, "micro_batch": None},
                    parallel={"dp": 1, **parallel},
                    model={"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
                           "options": {}, **model})
    with pytest.raises(SpecError) as e:
        spec_from_dict(raw, "job.yaml")
    assert str(e.value).startswith(f"job.yaml: {message}") and "\n" not in str(e.value), str(e.value)


def test_validate_says_what_each_worker_holds_of_a_mixture_split_over_replicas(tmp_path, capsys):
    """parallel.ep 2: half of each block's experts a worker, the rest whole under DDP; under
    ZeRO-3 (dp 4: two groups) the rest sharded over each pair too, as the sharding line says;
    at tp 2 half of every layer, each expert's too."""
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    raw = tiny_spec(tmp_path, data, name="v", train={"global_batch": 16, "micro_batch": None},
                    parallel={"dp": 2, "ep": 2}, resources={"cpus_per_worker": 0.25},
                    model={"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
                           "options": {"kv_heads": 2, "hidden": 32, "experts": 4}})
    lines = {}
    for name, parallel in (("ddp", {}), ("zero3", {"dp": 4, "shard": "full"}), ("tp", {"tp": 2})):
        job = write_spec(tmp_path / f"{name}.yaml", {**raw, "parallel": {**raw["parallel"], **parallel}})
        assert cli.main(["validate", str(job)]) == 0
        lines[name] = [s for s in capsys.readouterr().out.splitlines() if s.startswith("  expert")]
    model = build_model(spec_from_dict(raw).model, 0)
    total = sum(q.numel() for q in model.parameters())
    routed = sum(q.numel() for n, q in model.named_parameters() if ".experts." in n)
    assert lines["ddp"] == [f"  expert parallel: the 4 experts of each of 2 blocks split over 2 "
                            f"workers (2 each); per worker {total - routed // 2:,} of the {total:,} "
                            "parameters: 0.5 MiB of parameters, gradients and optimizer state "
                            "(DDP: 0.7 MiB)"], lines
    assert lines["zero3"] == [f"  expert parallel: the 4 experts of each of 2 blocks split over 2 "
                              f"workers (2 each; 2 groups, each expert's gradient summed over its 2 "
                              f"holders); per worker {total // 2:,} of the {total:,} parameters (the "
                              "rest sharded over 2: ZeRO-3): 0.4 MiB of parameters, gradients and "
                              "optimizer state (DDP: 0.7 MiB)"], lines
    whole = sum(q.numel() for n, q in model.named_parameters() if "norm" in n or "router" in n)
    mine = (total - whole - routed) // 2 + routed // 4 + whole
    assert lines["tp"] == [f"  expert parallel: the 4 experts of each of 2 blocks split over 2 "
                           "workers (2 each, 1/2 of each one's hidden units on each tp worker); "
                           f"per worker {mine:,} of the {total:,} parameters: 0.3 MiB of "
                           "parameters, gradients and optimizer state (DDP: 0.7 MiB)"], lines


def test_validate_says_how_context_parallelism_splits_a_row(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    raw = tiny_spec(tmp_path, data, name="v", train={"global_batch": 16, "micro_batch": None},
                    parallel={"dp": 2, "cp": 2}, model={"name": "llama", "layers": 2, "width": 32,
                                                        "heads": 4, "seq_len": 32,
                                                        "options": {"kv_heads": 2}})
    assert cli.main(["validate", str(write_spec(tmp_path / "job.yaml", raw))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "llama, dp=2 pp=1 cp=2, " in out[0], out[0]
    assert ("  context parallel: each row's 32 positions split over 2 workers (16 each, embedded, "
            "run and scored there); attention over all 32 for 2 of the 4 query heads and 1 of "
            "the 2 key-value heads on each (two all-to-alls a block, and two in its backward); a "
            "replica's 2 workers read the same rows, and every parameter's gradient is summed "
            "over all 4 workers") in out, out
    # sharded with shard_group 1: each replica's 2 cp workers split the state, a copy a replica
    job = write_spec(tmp_path / "sharded.yaml", {
        **raw, "parallel": {**raw["parallel"], "shard": "full", "shard_group": 1}})
    assert cli.main(["validate", str(job)]) == 0
    line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("  sharding: "))
    assert line.startswith("  sharding: full (ZeRO-3) over 2 replica groups of 2 (1 replica x 2 "
                           "cp workers) (hybrid); per worker: "), line
    # with tensor parallelism: a quarter of the heads a worker, each share's holders
    job = write_spec(tmp_path / "tp.yaml", {
        **raw, "parallel": {**raw["parallel"], "tp": 2, "shard": "full"},
        "model": {**raw["model"], "options": {"kv_heads": 4}}})
    assert cli.main(["validate", str(job)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "llama, dp=2 pp=1 tp=2 cp=2, " in out[0], out[0]
    assert any(s.startswith("  tensor parallel: ") and "full (ZeRO-3) over the 4 workers holding "
               "each share" in s for s in out), out
    assert ("  context parallel: each row's 32 positions split over 2 workers (16 each, embedded, "
            "run and scored there); attention over all 32 for 1 of the 4 query heads on each (two "
            "all-to-alls a block, and two in its backward); a replica's 4 workers read the same "
            "rows, and each tp share's gradients are summed over the 4 workers holding it") in out, out
    # keys and values gathered: no heads divided (the 2 key-value heads over tp 2 x cp 2 too)
    job = write_spec(tmp_path / "gather.yaml", {
        **raw, "parallel": {**raw["parallel"], "tp": 2, "cp_attention": "all_gather"}})
    assert cli.main(["validate", str(job)]) == 0
    assert ("  context parallel: each row's 32 positions split over 2 workers (16 each, embedded, "
            "run and scored there); attention of its positions, 2 query heads, over all 32 "
            "positions' keys and values (one all-gather a block, a reduce-scatter in its "
            "backward); a replica's 4 workers read the same rows, and each tp share's gradients "
            "are summed over the 4 workers holding it") in capsys.readouterr().out.splitlines()
    # passed around a ring: no heads divided either
    job = write_spec(tmp_path / "ring.yaml", {
        **raw, "parallel": {**raw["parallel"], "cp": 4, "cp_attention": "ring"}})
    assert cli.main(["validate", str(job)]) == 0
    assert ("  context parallel: each row's 32 positions split over 4 workers (8 each in two pieces "
            "of 4, the zigzag order, embedded, "
            "run and scored there); attention of its positions, every query head, over each "
            "worker's keys and values in turn, passed around a ring (3 sends a block, 4 more with "
            "their gradients in its backward); a replica's 4 workers read the same rows, and "
            "every parameter's gradient is summed over all 8 workers") in capsys.readouterr().out.splitlines()
    # experts split over the 2 replicas (ep 2): an expert's gradient over its 2 holders (of its
    # replica's 2 workers)
    job = write_spec(tmp_path / "ep.yaml", {
        **raw, "parallel": {**raw["parallel"], "ep": 2},
        "model": {**raw["model"], "options": {"kv_heads": 2, "experts": 4}}})
    assert cli.main(["validate", str(job)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "every parameter's gradient is summed over all 4 workers (each expert's over the 2 "
        "holding it)")


@pytest.mark.parametrize("parallel,message", LAYOUT_ERRORS,
                         ids=[f"{i}-{m.split(':')[0]}" for i, (_, m) in enumerate(LAYOUT_ERRORS)])
def test_sharding_and_tensor_parallel_mistakes_are_one_line_each(tmp_path, parallel, message):
    raw = tiny_spec(tmp_path, tmp_path, train={"global_batch": 16, "micro_batch": None},
                    parallel=parallel)
    with pytest.raises(SpecError) as e:
        spec_from_dict(raw, "job.yaml")
    assert str(e.value).startswith(f"job.yaml: {message}"), str(e.value)
    assert "\n" not in str(e.value)


def test_tensor_parallelism_needs_a_plan(tmp_path):
    raw = tiny_spec(tmp_path, tmp_path, parallel={"dp": 1, "tp": 2},
                    model={"name": "mlp", "layers": 2, "width": 64, "context": 4, "seq_len": 32})
    with pytest.raises(SpecError, match="parallel.tp: 2 is invalid; model 'mlp' has no "
                                        "tensor-parallel plan"):
        spec_from_dict(raw, "job.yaml")
    raw = tiny_spec(tmp_path, tmp_path, parallel={"dp": 1, "tp": 2})
    assert spec_from_dict(raw).dims().world_size == 2 and spec_from_dict(raw).per_replica == 2
    # compiled blocks, and PowerSGD over each share's replicas, run with it
    raw["parallel"].update(dp=2, grad_comm="powersgd")
    raw["train"]["compile"] = True
    assert spec_from_dict(raw).parallel.grad_comm == "powersgd" and spec_from_dict(raw).train.compile


def test_sharding_needs_blocks_to_wrap(tmp_path, monkeypatch):
    (tmp_path / "flatmodel.py").write_text(
        "import torch\n\ndef build(spec):\n"
        "    return torch.nn.Linear(spec.width, spec.vocab_size)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    raw = tiny_spec(tmp_path, tmp_path, model={"name": "flatmodel:build"},
                    parallel={"dp": 2, "shard": "full"})
    with pytest.raises(SpecError, match=r"parallel.shard: 'full' is invalid; model 'flatmodel:build' "
                                        r"\(a Linear\) has no repeated blocks for FSDP to wrap"):
        spec_from_dict(raw, "job.yaml")
    raw["parallel"]["shard"] = "optimizer"  # ZeRO-1 wraps no blocks: any model
    assert spec_from_dict(raw).dp_shard == 2


def test_an_elastic_sharded_job_may_shrink_to_one_replica_and_keeps_whole_groups(tmp_path):
    raw = tiny_spec(tmp_path, tmp_path, train={"global_batch": 24, "micro_batch": None},
                    parallel={"dp": 4, "shard": "full"}, elastic={"min_dp": 1, "max_dp": 4})
    assert spec_from_dict(raw).valid_dps() == [1, 2, 3, 4]
    raw["parallel"]["shard_group"] = 2
    raw["elastic"]["min_dp"] = 2
    spec = spec_from_dict(raw)
    assert spec.valid_dps() == [2, 4] and spec.at_dp(2).dims().dp_replicate == 1


def test_validate_shows_the_bytes_each_worker_holds(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(
        tmp_path, data, name="v", train={"global_batch": 16, "micro_batch": None},
        parallel={"dp": 4, "shard": "full", "shard_group": 2}))
    assert cli.main(["validate", str(job)]) == 0
    line = capsys.readouterr().out.splitlines()[2]
    # the tiny GPT (2 blocks of width 32, 256 tokens, 32 positions) has 42,880 parameters:
    # 16 bytes each under DDP (670 KiB); a replica group of 2 halves all of it
    assert line == ("  sharding: full (ZeRO-3) over 2 replica groups of 2 (hybrid); per worker: "
                    "params 0.1 MiB, grads 0.1 MiB, optimizer 0.2 MiB = 0.3 MiB (DDP: 0.7 MiB)"), line


def test_validate_says_what_the_job_does_about_bad_steps_and_rows(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(
        tmp_path, data, name="v", train={"skip_nonfinite": 1, "rewind_on_spike": {"factor": 4}},
        data={"source": "parquet", "path": str(data), "skip_bad_row_groups": 2}))
    assert cli.main(["validate", str(job)]) == 0
    assert ("  guards: up to 1 step in a row whose gradient is not finite skipped; a loss above "
            "4x the median of the 20 steps before it rewound past, up to 3 times; up to 2 row "
            "groups with bad rows left out") in capsys.readouterr().out.splitlines()
    job = write_spec(tmp_path / "plain.yaml", tiny_spec(tmp_path, data, name="v"))
    assert cli.main(["validate", str(job)]) == 0
    assert "guards" not in capsys.readouterr().out


def test_validate_shows_the_largest_pipeline_stage_share(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)
    job = write_spec(tmp_path / "job.yaml", tiny_spec(
        tmp_path, data, name="v", train={"global_batch": 16, "micro_batch": None},
        parallel={"dp": 2, "pp": 2, "microbatches": 2, "shard": "full"}))
    assert cli.main(["validate", str(job)]) == 0
    out = capsys.readouterr().out
    # the tiny GPT's 42,880 parameters in 4 layers, balanced by count over 2 stages: the larger
    # stage holds the embedding (8,192 + 1,024) and a block (12,704): 21,920 (its two halves:
    # 10,960 params, 43 KiB of fp32), DDP's 16 bytes each of it: 342.5 KiB
    assert ("sharding: full (ZeRO-3) over 2 workers in each of 2 pipeline stages (the largest "
            "stage's share); per worker: params 0.0 MiB, grads 0.0 MiB, optimizer 0.1 MiB = "
            "0.2 MiB (DDP: 0.3 MiB)") in out, out


def test_validate_shows_a_tensor_parallel_workers_shard_of_its_share(tmp_path, capsys):
    data = write_dataset(tmp_path / "data", num_samples=64, seq_len=32)

    def tensor_line(**model) -> str:  # dp 2 x tp 2 under ZeRO-3
        job = write_spec(tmp_path / "job.yaml", tiny_spec(
            tmp_path, data, name="v", train={"global_batch": 16, "micro_batch": None},
            parallel={"dp": 2, "tp": 2, "shard": "full"}, **({"model": model} if model else {})))
        assert cli.main(["validate", str(job)]) == 0
        return next(line for line in capsys.readouterr().out.splitlines()
                    if line.startswith("  tensor parallel:"))
    line = tensor_line()
    # of the tiny GPT's 42,880 parameters, a worker keeps half of each block's 4 linear
    # weights and 2 column biases (the row layers' biases stay whole: 6,256 of a block's
    # 12,704 go) and half of the token embedding's and the head's 256 x 32 (4,096 each go):
    # a share is 42,880 - 2 x 6,256 - 2 x 4,096 = 22,176; ZeRO-3 over the 2 workers holding
    # it: 22,176 x 16 / 2 bytes = 0.17 MiB, against 42,880 x 16 = 0.65 MiB whole
    assert line == ("  tensor parallel: 10 layers split over 2 workers, full (ZeRO-3) "
                    "over the 2 workers holding each share; per worker 22,176 of the 42,880 "
                    "parameters: 0.2 MiB of parameters, gradients and optimizer state (whole: "
                    "0.7 MiB)"), line
    # with adapters of rank 2 on every linear layer (2,624 parameters: 2 x (in + out) each),
    # a worker keeps a column layer's A whole and half its B, a row layer's B whole and half
    # its A (1,600: a block's 160 + 96 + 192 + 192, the head's 64 + 256), and gradients and
    # optimizer state for those alone: (23,776 x 4 + 1,600 x 12) / 2 bytes, against
    # 45,504 x 4 + 2,624 x 12 whole
    line = tensor_line(name="gpt", layers=2, width=32, heads=4, seq_len=32, lora={"rank": 2})
    assert line == ("  tensor parallel: 10 layers split over 2 workers, full (ZeRO-3) over "
                    "the 2 workers holding each share; per worker 23,776 of the 45,504 "
                    "parameters: 0.1 MiB of parameters, gradients and optimizer state (whole: "
                    "0.2 MiB)"), line


@pytest.mark.parametrize("width,heads,hint", [
    (31, 2, "; try 1"), (48, 5, "; try 4"), (130_000, 140, "; try 130"),
    (2**17 - 1, 4, "; try 1"),  # a prime
    (10**12 + 1, 140, None), (2**61 - 1, 10**6, None),  # past the bounds: refused for that
])
def test_a_width_the_heads_do_not_divide_is_refused_at_once(tmp_path, width, heads, hint):
    raw = tiny_spec(tmp_path, tmp_path, model={"name": "gpt", "layers": 2, "width": width,
                                               "heads": heads, "seq_len": 32})
    t0 = time.perf_counter()
    with pytest.raises(SpecError) as e:
        spec_from_dict(raw, "job.yaml")
    assert time.perf_counter() - t0 < 1.0  # was minutes for 10^12 + 1 (a scan up to the width)
    if hint is None:
        assert str(e.value) == f"job.yaml: model.width: {width} is invalid; at most 131,072 (16 times GPT-3's)"
    else:
        assert str(e.value) == (f"job.yaml: model.heads: {heads} is invalid; must divide model.width "
                                f"({width}){hint}")
