"""Any input to `baton validate` gets one line or a pass, in under a second, and writes nothing.

A property-based fuzz over mutations of every job file in jobs/ (hypothesis, seeded per file:
the same mutants every run), and the hostile inputs found by hand on v0.5, each by name.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from baton import api
from baton.errors import BatonError
from baton.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.yaml"))
KEYS = sorted(spec_from_dict({"name": "x"}).flat()) + [
    "model.options.embed_dim", "bogus", "train.bogus",
    *(f"model.lora.{k}" for k in ("rank", "alpha", "targets", "whole", "dropout", "rslora", "init_from"))]  # (null by default: not in flat())
EXAMPLES_PER_FILE = int(os.environ.get("BATON_FUZZ_EXAMPLES", 80))  # x 7 job files: 560 mutants a run (the issue asks for at least 500)
BUDGET_S = 1.0  # a spec is validated in under a second (the hypothesis deadline below too)

HUGE = [10**7, 10**12 + 1, 10**30, 10**400, 2**40, 2**63, -1, 0, -(10**30)]
STRINGS = ["a" * 5000, "bogus://x", "a\0b", "s3://", "x" * 300 + "/y", "é", "", " ", "*", "-1"]
values = st.one_of(
    st.integers(), st.sampled_from(HUGE), st.floats(), st.text(max_size=20),
    st.sampled_from(STRINGS), st.booleans(), st.none(), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=4), st.integers(), st.none(), st.booleans()),
                    st.integers(), max_size=3))
override_text = st.one_of(  # what follows KEY= on the command line
    st.text(max_size=12), st.sampled_from(["[", "{", "a: b: c", "*alias", "!!python/object/apply:os.system ['true']",
                                            "\t", ".inf", ".nan", "1e400", "1" + "0" * 400, "&a [*a]"]))
mutation = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(KEYS), values),
    st.tuples(st.just("delete"), st.sampled_from(KEYS)),
    st.tuples(st.just("override"), st.sampled_from(KEYS), override_text),
    st.tuples(st.just("key"), st.sampled_from(["", "model", "train", "parallel"]),
              st.one_of(st.integers(), st.none(), st.booleans(), st.text(max_size=4))))


def _mutate(raw: dict, mutations: list) -> list[str]:
    """Apply mutations to the job's tree; return the --set overrides among them."""
    overrides = []
    for op, key, *rest in mutations:
        if op == "override":
            overrides.append(f"{key}={rest[0]}")
            continue
        *sections, last = key.split(".") if key else [""]
        node = raw
        for part in sections:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        if op == "set":
            node[last] = rest[0]
        elif op == "delete":
            node.pop(last, None)
        else:  # an extra key of any type (1, null, true beside strings)
            (node.setdefault(last, {}) if last and isinstance(node.get(last, {}), dict) else node)[rest[0]] = 1
    return overrides


def _validate(text: str, overrides: list[str], times: list | None = None,
              budget_s: float = BUDGET_S) -> str:
    """Validate a job file holding `text` in a fresh working folder; return 'ok' or the error
    (and append the seconds it took to `times`).
    Fails on a traceback, a message of more than one line, a slow answer or a written file."""
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp, "job.yaml")
        job.write_text(text)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            t0 = time.perf_counter()
            try:
                api.validate(str(job), overrides)
                answer = "ok"
            except BatonError as e:
                answer = str(e)
            took = time.perf_counter() - t0
        finally:
            os.chdir(cwd)
        written = sorted(str(p.relative_to(tmp)) for p in Path(tmp).rglob("*"))
    assert "\n" not in answer, answer
    assert len(answer) < 1000, answer
    assert took < budget_s, (took, answer)
    assert written == ["job.yaml"], written
    if times is not None:
        times.append(took)
    return answer


@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_every_mutant_of_a_job_file_gets_one_line_or_a_pass(job):
    base = yaml.safe_load(job.read_text())
    # the first call imports what validate needs (torch, for a file whose checks build the
    # model on the meta device: 2.5 s when no test before it imported it): not timed
    _validate(job.read_text(), [], budget_s=math.inf)

    @seed(zlib.crc32(job.name.encode()))  # seeded: the same mutants every run, others per file
    @settings(max_examples=EXAMPLES_PER_FILE, database=None,
              deadline=BUDGET_S * 1000, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(mutation, min_size=1, max_size=3))
    def one(mutations):
        raw = yaml.safe_load(yaml.safe_dump(base))
        overrides = _mutate(raw, mutations)
        answers.append(_validate(yaml.safe_dump(raw, allow_unicode=True), overrides, times))

    answers, times = [], []
    one()
    assert len(answers) >= EXAMPLES_PER_FILE
    print(f"\nfuzz {job.name}: {len(answers)} mutants, {answers.count('ok')} accepted, "
          f"slowest {max(times):.3f} s")


Q = (REPO / "jobs" / "quickstart.yaml").read_text()
BIG = "1" + "0" * 400


def _file(text: str) -> str:
    return Q + text


@pytest.mark.parametrize("text, overrides, key", [
    # tracebacks on v0.5
    (Q + "1: a\n", [], "the top level: the key 1"),
    (Q.replace("train:", "train:\n  null: 1\n  true: 2", 1), [], "train: the key None"),
    (Q, ["train.lr=["], "not valid YAML"),
    (Q, ["train.lr={"], "not valid YAML"),
    (Q, ["train.lr=a: b: c"], "not valid YAML"),
    (Q, ["train.lr=*alias"], "undefined alias"),
    (Q, ["train.lr=!!python/object/apply:os.system ['true']"], "could not determine a constructor"),
    (Q, ["train.lr=\t"], "not valid YAML"),
    (Q, [f"train.lr={BIG}"], "too large for a number"),
    (Q, ["model.options={bogus: 1}", "parallel.pp=2"], "model.options"),
    (Q, ["model.options={bogus: 1}", "parallel.partition=time"], "model.options"),
    (Q, ["model.name=fuzz_raises:build"], "raised RuntimeError: at import"),
    (Q, ["model.name=fuzz_syntax:build"], "raised SyntaxError"),
    (Q, ["model.name=fuzz_exits:build"], "raised SystemExit"),
    (Q, ["model.name=fuzz_ok:NUMBER"], "not a function"),
    (Q, ["model.name=fuzz_ok:build", "model.options={bad: 1}", "parallel.pp=2"], "failed on these settings: TypeError"),
    ("name: x\nmodel: {options: " + "[" * 5000 + "]" * 5000 + "}\n", [], "nested too deeply"),
    ("name: x\nmodel: {options: &a {b: *a}}\n", [], "a recursive alias"),
    (Q, ["data.path=bogus://x"], "unknown scheme 'bogus'"),
    ('name: x\ndata: {path: "a\\0b"}\n', [], "NUL"),
    (Q, ["data.path=" + "a" * 5000], "longer than any file system allows"),
    # hangs on v0.5
    (Q, ["model.width=1000000000001"], "model.width"),
    (Q, ["elastic.max_dp=10000000"], "elastic.max_dp"),
    (Q, ["model.layers=10000000", "parallel.pp=2"], "model.layers"),
    (Q, ["parallel.microbatches=100000000", "parallel.pp=2", "resources.gpus_per_worker=1"],
     "parallel.microbatches"),
    (Q, ["train.global_batch=131072", "train.micro_batch=1", "parallel.pp=2"], "parallel.pp"),
    # accepted on v0.5
    *[(Q, [f"{key}=.inf"], key) for key in (
        "train.lr", "train.min_lr", "train.weight_decay", "train.grad_clip", "parallel.timeout_s",
        "elastic.hang_timeout_s", "elastic.rescale_check_s", "tracking.flush_every_s",
        "resources.cpus_per_worker", "resources.gpus_per_worker")],
    (Q, ["train.lr=.nan"], "give a finite number"),
    (Q, [f"train.steps={BIG}"], "train.steps"),
    (Q, ["train.seed=-1"], "train.seed"),
    (Q, ["train.seed=1" + "0" * 30], "train.seed"),
    (Q, ["model.options={nope: 1}"], "gpt takes no option 'nope'"),
    (Q, ["resources.threads_per_worker=1099511627776"], "resources.threads_per_worker"),
], ids=lambda v: None)
def test_each_hostile_input_found_on_v05_gets_one_line(text, overrides, key, monkeypatch, tmp_path):
    builders = {"fuzz_raises": "raise RuntimeError('at import')\n", "fuzz_syntax": "def f(:\n",
                "fuzz_exits": "import sys\nsys.exit(3)\n",
                "fuzz_ok": "import torch\nNUMBER = 3\n\ndef build(spec):\n"
                           "    return torch.nn.Linear(spec.width, spec.width, **spec.options)\n"}
    for name, code in builders.items():
        (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    answer = _validate(text, overrides)
    assert answer != "ok" and key in answer, answer


def test_a_job_file_that_is_not_utf8_gets_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_bytes(b"name: x\nmodel: {name: \xff\xfe}\n")
    with pytest.raises(BatonError, match=r"not UTF-8 text \(byte 22 is 0xff\)"):
        api.validate(str(job))


def test_the_largest_elastic_ranges_are_planned_at_once():
    """max_dp at its bound, under both batch policies: valid_dps checks the dps that split the
    batch arithmetically and builds few specs (it built one per dp: 4 s for 2,000)."""
    base = {"name": "x", "data": {"source": "parquet", "path": "d"}}
    keep = spec_from_dict({**base, "train": {"global_batch": 720_720, "micro_batch": 1},
                           "elastic": {"min_dp": 1, "max_dp": 720}})
    t0 = time.perf_counter()
    dps = keep.valid_dps()
    assert dps == [d for d in range(1, 721) if 720_720 % d == 0]
    scale = spec_from_dict({**base, "batch_policy": "scale_lr", "parallel": {"dp": 2},
                            "train": {"global_batch": 4}, "elastic": {"min_dp": 1, "max_dp": 65_536}})
    assert scale.valid_dps() == list(range(1, 65_537))
    grouped = spec_from_dict({**base, "batch_policy": "scale_lr", "train": {"global_batch": 16},
                              "parallel": {"dp": 4, "shard": "full", "shard_group": 4},
                              "elastic": {"min_dp": 4, "max_dp": 4096}})
    assert grouped.valid_dps() == list(range(4, 4097, 4))
    assert time.perf_counter() - t0 < 3 * BUDGET_S  # three specs; about 0.2 s measured
    assert math.isfinite(scale.at_dp(65_536).train.lr)
