"""The job spec: every shipped job loads; bad input is refused with one clear line, before
anything is created."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from baton import cli
from baton.errors import SpecError
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


def test_fingerprint_ignores_steps_and_layout_but_not_the_model(tmp_path):
    base = tiny_spec(tmp_path, tmp_path)
    a = spec_from_dict(base)
    b = spec_from_dict({**base, "train": {**base["train"], "steps": 99},
                        "parallel": {"dp": 1}, "resources": {"cpus_per_worker": 1}})
    c = spec_from_dict({**base, "model": {**base["model"], "width": 64}})
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


# (override of the valid tiny spec, or raw YAML text; the message the user must see)
BROKEN = [
    ({"train": {"lrr": 0.1}}, "train.lrr: unknown key; did you mean 'lr'?"),
    ({"train": {"steps": "ten"}}, "train.steps: expected an integer, got a string 'ten'"),
    ({"train": {"lr": -0.1}}, "train.lr: -0.1 is invalid; must be > 0"),
    ({"train": {"global_batch": 10, "micro_batch": 2}},
     "train.global_batch: 10 is invalid; must be a multiple of parallel.dp x train.micro_batch = 2 x 2 = 4"),
    ({"parallel": {"dp": 512}, "train": {"global_batch": 1024}}, "parallel.dp: 512 is invalid; 512 workers x resources.cpus_per_worker 0.5 need 256 CPUs"),
    ({"data": {"path": "no/such/folder"}}, "data.path: 'no/such/folder' does not exist"),
    ({"model": {"name": "transformer"}}, "model.name: 'transformer' is invalid; use one of gpt, mlp"),
    ({"model": {"width": 31}}, "model.heads: 2 is invalid; must divide model.width (31); try 1"),
    ({"parallel": {"pp": 2}}, "parallel.pp: 2 is invalid; pipeline parallelism is not yet supported"),
    ({"train": {"schedule": "linear"}}, "train.schedule: 'linear' is not one of cosine | constant"),
    ({"model": {"seq_len": 64}}, "model.seq_len: 64 does not fit the data; rows of"),
    ({"name": "has space"}, "name: 'has space' is invalid"),
    ({"checkpoint": {"keep": 0}}, "checkpoint.keep: 0 is invalid; must be at least 1"),
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
            spec[section] = {**spec[section], **values} if isinstance(values, dict) else values
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


def test_spec_error_is_picklable():
    import pickle

    e = pickle.loads(pickle.dumps(SpecError("f: k: bad")))
    assert isinstance(e, SpecError) and str(e) == "f: k: bad"
