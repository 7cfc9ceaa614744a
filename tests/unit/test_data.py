"""The built-in corpus, the per-epoch order and the cursor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow.dataset as pads
import pytest

from baton.data import Cursor, EpochOrder
from baton.data.corpus import prepare_stdlib, stdlib_stream, windows
from baton.parallel import ParallelDims
from baton.parallel.mesh import split_micro


def test_windows_overlap_by_one_token_so_every_token_is_a_target_once():
    stream = np.arange(21, dtype=np.uint8)
    rows = windows(stream, 5)
    assert rows.shape == (4, 6)
    assert rows[1, 0] == rows[0, -1]
    targets = np.concatenate([r[1:] for r in rows])
    assert list(targets) == list(range(1, 21))


def test_prepare_stdlib_is_deterministic_and_real_text(tmp_path):
    a = prepare_stdlib(tmp_path / "a", seq_len=256, shard_rows=50_000)
    b = prepare_stdlib(tmp_path / "b", seq_len=256, shard_rows=50_000)
    assert a == b and a["files"] > 500 and a["samples"] > 10_000
    ta = pads.dataset(tmp_path / "a").to_table().sort_by("sample_id")
    tb = pads.dataset(tmp_path / "b").to_table().sort_by("sample_id")
    assert ta.equals(tb)
    assert ta.column("sample_id").to_pylist() == list(range(a["samples"]))
    first = bytes(ta.column("tokens")[0].values.to_numpy())
    assert len(first) == 257 and first.isascii()
    assert json.loads((tmp_path / "a" / "_corpus.json").read_text())["seq_len"] == 256
    with pytest.raises(FileExistsError):
        prepare_stdlib(tmp_path / "a", seq_len=256)


def test_stdlib_stream_is_python_source():
    stream, files = stdlib_stream()
    text = bytes(stream[:200_000]).decode("utf-8", "replace")
    assert files > 500 and "def " in text and "import " in text


def test_epoch_order_is_a_seeded_permutation():
    a, b = EpochOrder(100, seed=1), EpochOrder(100, seed=1)
    assert np.array_equal(a.permutation(0), b.permutation(0))
    assert not np.array_equal(a.permutation(0), a.permutation(1))
    assert not np.array_equal(a.permutation(0), EpochOrder(100, seed=2).permutation(0))
    assert sorted(a.permutation(3)) == list(range(100))


def test_cursor_walks_epochs_with_a_short_last_batch():
    order, cursor = EpochOrder(10, seed=0), Cursor()
    sizes = [len(order.next_batch(cursor, 4)) for _ in range(4)]
    assert sizes == [4, 4, 2, 4] and cursor.state_dict() == {"epoch": 1, "consumed": 4}


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 3), (4, 1)])
def test_resumed_at_any_world_size_every_sample_once(dp_before, dp_after):
    """Switch world size mid-epoch through a saved cursor: still exactly once."""
    n, batch = 103, 12
    seen = Counter()
    order, cursor = EpochOrder(n, seed=5), Cursor()
    for _ in range(4):
        ids = order.next_batch(cursor, batch)
        for r in range(dp_before):
            seen.update(ParallelDims(dp_before).replica_part(ids, r).tolist())
    saved = cursor.state_dict()
    order, cursor = EpochOrder(n, seed=5), Cursor()
    cursor.load_state_dict(saved)
    while cursor.epoch == 0:
        ids = order.next_batch(cursor, batch)
        for r in range(dp_after):
            for micro in split_micro(ParallelDims(dp_after).replica_part(ids, r), 3):
                seen.update(micro.tolist())
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}


def test_parallel_dims_rank_arithmetic():
    dims = ParallelDims(dp=3, pp=2)
    assert dims.world_size == 6
    assert [dims.coords(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert all(dims.rank(*dims.coords(r)) == r for r in range(6))
    assert dims.dp_group(1) == [3, 4, 5] and dims.pp_group(2) == [2, 5]
    with pytest.raises(ValueError):
        ParallelDims(dp=0)


def test_data_prepare_command(tmp_path, capsys):
    from baton import cli

    out = tmp_path / "corpus"
    assert cli.main(["data", "prepare", "stdlib", "--out", str(out), "--seq-len", "512"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("wrote ") and "samples of 513 tokens" in printed and str(out) in printed
    assert (out / "_corpus.json").exists() and list(out.glob("part-*.parquet"))
    assert cli.main(["data", "prepare", "stdlib", "--out", str(out)]) == 2  # never overwrites
    assert capsys.readouterr().err == f"baton: error: {out} already exists; choose a new --out\n"
