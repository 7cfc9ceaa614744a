"""`baton data prepare text`: documents tokenised in a Ray Data map stage, packed with an
end-of-document token into seq_len + 1 rows, deterministic; bad input is one line and writes
nothing; a user's tokenizer; the result trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from baton import api
from baton.data.local import read_corpus
from baton.data.text import ID_STRIDE, prepare_text
from baton.errors import DataError
from baton.spec import spec_from_dict
from helpers import tiny_spec

pytestmark = pytest.mark.usefixtures("local_ray")

DOCS = ["def f():\n    return 1\n", "héllo wörld", "x" * 40]


def _jsonl(path, docs, key="text"):
    path.write_text("".join(json.dumps({key: d, "n": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_documents_are_joined_with_an_end_token_and_packed_deterministically(tmp_path):
    (tmp_path / "in").mkdir()
    _jsonl(tmp_path / "in" / "a.jsonl", DOCS[:2])
    pq.write_table(pa.table({"text": [DOCS[2]]}), tmp_path / "in" / "b.parquet")
    info = prepare_text(str(tmp_path / "in"), str(tmp_path / "out"), seq_len=8)
    # in this process, as the built-in corpus is prepared: the same bytes as the Ray tasks'
    again = prepare_text(str(tmp_path / "in"), str(tmp_path / "out2"), seq_len=8, on_ray=False)
    assert info == again
    ids, tokens = read_corpus(str(tmp_path / "out"))
    assert tokens.shape[1] == 9 and info["samples"] == len(tokens) and info["documents"] == 3
    # file a: both documents' UTF-8 bytes, each followed by 0, cut into rows of 9 with stride 8
    stream_a = np.frombuffer(b"".join(d.encode() + b"\0" for d in DOCS[:2]), dtype=np.uint8)
    rows_a = (len(stream_a) - 1) // 8
    for r in range(rows_a):
        assert tokens[r].tolist() == stream_a[r * 8:r * 8 + 9].tolist()
    assert ids[:rows_a].tolist() == list(range(rows_a))  # part 0
    assert ids[rows_a:].tolist() == [ID_STRIDE + i for i in range(len(ids) - rows_a)]  # part 1
    assert tokens[rows_a].tolist() == list(b"x" * 9)
    for name in ("part-00000.parquet", "part-00001.parquet"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()


def test_a_user_tokenizer_and_its_end_token(tmp_path):
    """A tokenizer module in the working directory, as a user keeps one: the command and the
    tasks it runs on the embedded Ray both import it from there."""
    (tmp_path / "mytok.py").write_text(
        "def word_lengths(texts):\n    return [[len(w) for w in t.split()] for t in texts]\n")
    _jsonl(tmp_path / "a.jsonl", ["aa bbb c dddd", "ee f"])
    done = _baton(tmp_path, "--input", "a.jsonl", "--out", "out", "--seq-len", "3",
                  "--tokenizer", "mytok:word_lengths", "--eod-token", "9")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(6 tokens, vocabulary 10)" in done.stdout
    _, tokens = read_corpus(str(tmp_path / "out"))
    assert tokens.tolist() == [[2, 3, 1, 4], [4, 9, 2, 1]]  # stream 2 3 1 4 9 2 1 9
    with pytest.raises(DataError, match="--eod-token: give the end-of-document id"):
        prepare_text(str(tmp_path / "a.jsonl"), str(tmp_path / "x"), seq_len=3,
                     tokenizer="mytok:word_lengths")


def _baton(cwd, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run([shutil.which("baton"), "data", "prepare", "text", *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize("case", ["not text", "empty file", "missing column"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case):
    src = tmp_path / "in"
    src.mkdir()
    _jsonl(src / "good.jsonl", DOCS)
    if case == "not text":
        pq.write_table(pa.table({"text": [1, 2, 3]}), src / "bad.parquet")
        want = r"bad.parquet: column 'text' holds int64, not text"
    elif case == "empty file":
        (src / "bad.jsonl").write_text("")
        want = r"bad.jsonl: the file is empty"
    else:
        _jsonl(src / "bad.jsonl", DOCS, key="body")
        want = r"bad.jsonl: no column 'text' \(--column\); columns: body, n"
    with pytest.raises(DataError, match=want) as raised:
        prepare_text(str(src), str(tmp_path / "out"), seq_len=8)
    assert "\n" not in str(raised.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]  # no out, no temporary folder


def test_the_command_prepares_text_that_trains(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", [DOCS[0] * 40, DOCS[1] * 40])
    done = _baton(tmp_path, "--input", "docs.jsonl", "--out", "corpus", "--seq-len", "32")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("wrote ")
    assert "samples of 33 tokens from 2 documents in 1 files" in done.stdout
    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path / "corpus", name="text",
                                    train={"steps": 2, "global_batch": 4}))
    result = api.run(spec, show_progress=False)
    assert result.state == "finished" and np.isfinite(result.loss)


def test_prompts_and_responses_train_on_the_responses_alone(tmp_path):
    """Instruction tuning: `--prompt-column` writes a loss mask beside the tokens (0 on each
    prompt's bytes, 1 on its response's and the end of document), and a job that names it
    (data.loss_mask_column) trains on the responses alone, its loss their mean over the whole
    batch: dp 2 with accumulation (each replica's targets counted from its rows and summed
    over the replicas), then resumed as dp 2 x pp 2 (the last stages count them), one
    process's numbers for the masked loss at every step."""
    from helpers import assert_like_one_process

    pairs = [{"prompt": f"Q{i}: {i} squared?\n", "response": f"{i * i}\n"} for i in range(60)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    done = _baton(tmp_path, "--input", "sft.jsonl", "--out", "sft", "--seq-len", "32",
                  "--prompt-column", "prompt", "--column", "response")
    assert done.returncode == 0, done.stderr[-2000:]
    stream = b"".join(p["prompt"].encode() + p["response"].encode() + b"\0" for p in pairs)
    marks = np.concatenate([np.r_[np.zeros(len(p["prompt"].encode())), np.ones(len(p["response"].encode()) + 1)]
                            for p in pairs]).astype(np.uint8)
    rows = (len(stream) - 1) // 32
    assert f"{int(marks[1:rows * 32 + 1].sum()):,} of the tokens are targets" in done.stdout
    _, tokens = read_corpus(str(tmp_path / "sft"))
    _, masks = read_corpus(str(tmp_path / "sft"), "loss_mask")
    for r in range(rows):  # the rows of the stream, and their masks beside them
        assert tokens[r].tolist() == list(stream[r * 32:r * 32 + 33])
        assert masks[r].tolist() == marks[r * 32:r * 32 + 33].tolist()
    # --one-per-row: each pair at the start of a row of its own, padded with the end token
    # the mask leaves out (none here is longer than a row)
    done = _baton(tmp_path, "--input", "sft.jsonl", "--out", "rows", "--seq-len", "32",
                  "--prompt-column", "prompt", "--column", "response", "--one-per-row")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a document a row, padded; 0 longer than a row cut to it" in done.stdout
    _, tokens = read_corpus(str(tmp_path / "rows"))
    _, masks = read_corpus(str(tmp_path / "rows"), "loss_mask")
    assert len(tokens) == len(pairs)
    for p, row, mask in zip(pairs, tokens, masks):
        asked, said = p["prompt"].encode(), p["response"].encode() + b"\0"
        assert row.tolist() == list(asked + said) + [0] * (33 - len(asked) - len(said))
        assert mask.tolist() == [0] * len(asked) + [1] * len(said) + [0] * (33 - len(asked) - len(said))
    # (a constant schedule: the second run's 5 steps would change a cosine's first 3)
    train = {"schedule": "constant"}
    spec = spec_from_dict(tiny_spec(tmp_path, tmp_path / "sft", name="sft", train=train,
                                    data={"loss_mask_column": "loss_mask"}))
    result = api.run(spec, show_progress=False)
    assert result.state == "finished" and result.step == 3
    assert_like_one_process(spec, tmp_path / "sft", result, 3)  # measured: 7.3e-6 at most
    staged = spec_from_dict(tiny_spec(tmp_path, tmp_path / "sft", name="sft",
                                      data={"loss_mask_column": "loss_mask"}, train={**train, "steps": 5},
                                      parallel={"dp": 2, "pp": 2, "timeout_s": 60}))
    result = api.run(staged, show_progress=False)
    assert result.resumed_from == 3 and len(result.workers) == 4
    assert_like_one_process(staged, tmp_path / "sft", result, 5)  # measured: 7.2e-6 at most
