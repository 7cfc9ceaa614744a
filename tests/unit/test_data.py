"""The built-in corpus, the per-epoch order and the cursor."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pyarrow.dataset as pads
import pytest

from baton.data import Cursor, EpochOrder
from baton.data.order import rebased
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


def test_prepare_stdlib_is_deterministic_real_text_through_the_text_path(tmp_path):
    """Byte-identical parts from two runs; every source file one document, each followed by
    the end-of-document token 0 (which Python sources never hold); the text path's ids."""
    from baton.data.text import ID_STRIDE

    a = prepare_stdlib(tmp_path / "a", seq_len=256)
    b = prepare_stdlib(tmp_path / "b", seq_len=256)
    assert a == b and a["files"] > 500 and a["documents"] == a["files"] and a["samples"] > 10_000
    parts = sorted(p.name for p in (tmp_path / "a").glob("part-*.parquet"))
    assert len(parts) == 8
    for name in parts:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    table = pads.dataset(tmp_path / "a").to_table().sort_by("sample_id")
    ids = np.asarray(table.column("sample_id"))
    assert sorted(set((ids // ID_STRIDE).tolist())) == list(range(8)) and len(ids) == a["samples"]
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(len(ids), 257)
    first = bytes(tokens[0])
    assert first.isascii() and b"\0" not in first[:100]
    # each row's targets are new tokens (stride 256), so the 0s among them are the documents'
    # ends: one per file, less those that fell in a part's dropped tail (under a row each)
    ends = int((tokens[:, 1:] == 0).sum())
    assert a["files"] - 8 <= ends <= a["files"], ends
    meta = json.loads((tmp_path / "a" / "_corpus.json").read_text())
    assert meta["seq_len"] == 256 and meta["source"] == "python-stdlib" and meta["eod_token"] == 0
    with pytest.raises(FileExistsError):
        prepare_stdlib(tmp_path / "a", seq_len=256)


def test_stdlib_stream_is_python_source():
    stream, files = stdlib_stream()
    text = bytes(stream[:200_000]).decode("utf-8", "replace")
    assert files > 500 and "def " in text and "import " in text


UNITS = [37, 50, 13, 64, 64, 29, 41, 8]  # rows of each row group: 306 samples


def _epoch(order: EpochOrder, epoch: int) -> np.ndarray:
    return order.positions(epoch, 0, order.num_samples)


@pytest.mark.parametrize("block", [None, 1, 40, 64, 1000])
def test_each_epoch_is_a_seeded_permutation_of_every_sample(block):
    a, b = EpochOrder(UNITS, seed=1, shuffle_block=block), EpochOrder(UNITS, seed=1, shuffle_block=block)
    assert np.array_equal(_epoch(a, 0), _epoch(b, 0))
    for epoch in range(3):
        assert sorted(_epoch(a, epoch)) == list(range(sum(UNITS)))
    assert not np.array_equal(_epoch(a, 0), _epoch(a, 1))
    assert not np.array_equal(_epoch(a, 0), _epoch(EpochOrder(UNITS, seed=2, shuffle_block=block), 0))


def test_a_block_draws_only_from_the_row_groups_it_overlaps():
    """The windowed shuffle: block k's samples come from the units that overlap it in the
    epoch's unit order, so a reader needs only those; the last block may be short."""
    order = EpochOrder(UNITS, seed=3, shuffle_block=40)
    offsets = np.concatenate([[0], np.cumsum(UNITS)[:-1]])
    perm, _ = order.unit_order(0)
    for k in range(order.num_blocks):
        first, last = order.block_units(0, k)
        allowed = set()
        for u in perm[first:last]:
            allowed |= set(range(offsets[u], offsets[u] + UNITS[u]))
        block = order.block(0, k)
        assert set(block.tolist()) <= allowed
        assert len(block) == (40 if k < order.num_blocks - 1 else sum(UNITS) - 40 * k)
    # a block of 1 keeps the unit sequence's order: row groups permuted, rows in file order
    seq = _epoch(EpochOrder(UNITS, seed=3, shuffle_block=1), 0)
    assert np.array_equal(seq[:UNITS[perm[0]]], offsets[perm[0]] + np.arange(UNITS[perm[0]]))


def test_a_cursor_seeks_without_computing_earlier_blocks():
    order = EpochOrder(UNITS, seed=4, shuffle_block=40)
    want = order.positions(1, 200, 230)
    fresh = EpochOrder(UNITS, seed=4, shuffle_block=40)
    got = fresh.next_batch(Cursor(epoch=1, consumed=200), 30)
    assert np.array_equal(got, want) and set(fresh._blocks) == {(1, 5)}
    first, last = fresh.units_for(1, 200, 230)
    assert (first, last) == fresh.block_units(1, 5)


def test_cursor_walks_epochs_with_a_short_last_batch():
    order, cursor = EpochOrder([4, 6], seed=0), Cursor()
    sizes = [len(order.next_batch(cursor, 4)) for _ in range(4)]
    assert sizes == [4, 4, 2, 4] and cursor.state_dict() == {"epoch": 1, "consumed": 4}


def test_rebased_cursor_starts_the_next_epoch():
    assert rebased({"epoch": 2, "consumed": 17}) == {"epoch": 3, "consumed": 0}
    assert rebased({"epoch": 2, "consumed": 0}) == {"epoch": 2, "consumed": 0}


@pytest.mark.parametrize("weights", [[1, 3], [3, 5], [1, 1, 1], [0.5, 2, 7.25], [1, 1000]])
def test_a_mix_gives_each_source_its_share_within_one_sample_whatever_the_batches(weights):
    """data.mix's schedule: after every prefix of the stream, source k has given w_k n
    samples within one (measured against the exact share); and the stream is the same taken
    in batches of any sizes (a resume or another dp splits it elsewhere)."""
    from baton.data.mix import due

    w = np.array(weights, dtype=np.float64) / sum(weights)
    whole = due([0] * len(w), w, 2000)
    counts = np.cumsum(np.eye(len(w), dtype=np.int64)[whole], axis=0)
    n = np.arange(1, 2001)[:, None]
    assert np.abs(counts - w[None, :] * n).max() < 1
    taken, pieces = [0] * len(w), []
    for size in [1, 7, 64, 3, 500, 1, 1424]:
        piece = due(taken, w, size)
        pieces.append(piece)
        taken = [t + int((piece == k).sum()) for k, t in enumerate(taken)]
    assert np.array_equal(np.concatenate(pieces), whole)


def test_a_mix_cursor_keeps_each_sources_place_and_rebases_each(tmp_path):
    """A mix's cursor: each source's place and the counts its schedule starts from. Rebased
    (--rebase-data) onto new weights, each source whose files are unchanged (or hold the same
    row groups) keeps its place and a changed one starts its next epoch; the schedule starts
    again from there."""
    from types import SimpleNamespace

    from baton.data.manifest import FileEntry, Manifest
    from baton.data.mix import MixCursor, MixedFeed, Mixture

    cursor = MixCursor([16, 100])
    cursor.load_state_dict({"sources": [{"epoch": 1, "consumed": 14}, {"epoch": 0, "consumed": 50}]})
    assert cursor.taken() == [30, 50] and cursor.scheduled() == [30, 50]
    state = cursor.state_dict()
    assert state == {"epoch": 0, "consumed": 80, "since": [0, 0], "sources": [
        {"epoch": 1, "consumed": 14}, {"epoch": 0, "consumed": 50}]}
    with pytest.raises(ValueError, match="a cursor of 0 sources for a mix of 2"):
        cursor.load_state_dict({"epoch": 0, "consumed": 8})  # a checkpoint of one corpus

    def manifest(path, rows):
        return Manifest(str(tmp_path / path), [FileEntry("part-0.parquet", 100, rows)])

    sources = [manifest("a", (16,)), manifest("b", (100,))]
    before = Mixture(["a", "b"], sources, [3, 5])
    meta = {"step": 10, "cursor": state, "data": before.summary()}
    feeds = [SimpleNamespace(order=SimpleNamespace(num_samples=n)) for n in (16, 100)]
    after = MixedFeed(Mixture(["a", "b"], sources, [1, 1]), feeds)
    assert after.rebased(meta) == {"epoch": 0, "consumed": 80, "since": [30, 50], "sources": [
        {"epoch": 1, "consumed": 14}, {"epoch": 0, "consumed": 50}]}
    grown = MixedFeed(Mixture(["a", "b"], [sources[0], manifest("b", (100, 20))], [1, 1]), feeds)
    assert grown.rebased(meta)["sources"] == [{"epoch": 1, "consumed": 14}, {"epoch": 1, "consumed": 0}]
    # b written again with the same row groups (bad rows fixed in place: other bytes): its place
    fixed = Manifest(str(tmp_path / "b"), [FileEntry("part-0.parquet", 97, (100,))])
    assert fixed.digest() != sources[1].digest() and fixed.same_rows(
        {"data": sources[1].summary()}) and not fixed.same_rows({"data": {"digest": "old"}})
    kept = MixedFeed(Mixture(["a", "b"], [sources[0], fixed], [1, 1]), feeds)
    assert kept.rebased(meta)["sources"] == [{"epoch": 1, "consumed": 14}, {"epoch": 0, "consumed": 50}]
    # from a checkpoint of one corpus (--rebase-data onto a mix): the epoch after its own
    one = {"step": 4, "cursor": {"epoch": 3, "consumed": 5}, "data": sources[0].summary()}
    assert after.rebased(one)["sources"] == [{"epoch": 4, "consumed": 0}] * 2


def test_a_mix_phase_changes_the_weights_from_its_step_and_a_checkpoint_pins_only_begun_phases(tmp_path):
    """data.mix_phases: from the step after `after_step` the batches follow the phase's weights
    (a weight of 0 takes none of that source), the schedule starting again there, whatever
    the batch sizes; the cursor's state holds the phase. A checkpoint pins the phases that had
    begun by its step: those after it may be added or changed, an earlier one is named."""
    from types import SimpleNamespace

    from baton.data.manifest import FileEntry, Manifest
    from baton.data.mix import MixedFeed, Mixture, due

    zero = due([4, 0, 4], np.array([0.5, 0.0, 0.5]), 40)
    assert (zero == 1).sum() == 0 and np.bincount(zero, minlength=3).tolist() == [20, 0, 20]

    def manifest(path, rows):
        return Manifest(str(tmp_path / path), [FileEntry("part-0.parquet", 100, rows)])

    sources = [manifest("a", (16,)), manifest("b", (100,))]
    mixture = Mixture(["a", "b"], sources, [1, 1], ["a", "b"], [(3, [0, 1]), (5, [1, 3])])
    assert [mixture.phase_at(s) for s in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    feed = MixedFeed(mixture, [SimpleNamespace(order=SimpleNamespace(num_samples=n)) for n in (16, 100)])
    cursor, drawn, said = feed.cursor(), [], []
    for step in range(7):
        said.append(feed.enter(cursor, step))
        sources_of = due(cursor.scheduled(), mixture.weights_in(cursor.phase), 8)
        drawn.append(np.bincount(sources_of, minlength=2).tolist())
        for k, c in enumerate(cursor.sources):  # what next_batch's feeds would take
            c.consumed += int((sources_of == k).sum())
    assert drawn == [[4, 4], [4, 4], [4, 4], [0, 8], [0, 8], [2, 6], [2, 6]]
    assert said == [None, None, None, {"step": 4, "phase": 1, "weights": {"a": 0.0, "b": 1.0}},
                    None, {"step": 6, "phase": 2, "weights": {"a": 0.25, "b": 0.75}}, None]
    state = cursor.state_dict()
    assert state["phase"] == 2 and state["since"] == [12, 28]
    again = feed.cursor()
    again.load_state_dict(state)
    assert (again.phase, again.since) == (2, [12, 28])

    meta = {"step": 4, "cursor": state, "data": mixture.summary()}
    later = Mixture(["a", "b"], sources, [1, 1], phases=[(3, [0, 1]), (6, [1, 1]), (9, [2, 1])])
    assert later.trained(meta)  # the phase after step 5 moved and one added: after the checkpoint
    moved = Mixture(["a", "b"], sources, [1, 1], phases=[(2, [0, 1])])
    assert not moved.trained(meta)
    assert moved.changed_since(meta) == ("data.mix_phases changed before step 4 (after steps 3 | 2): "
                                         "only phases after the checkpoint's step may change")
    assert not Mixture(["a", "b"], sources, [1, 1]).trained(meta)
    assert MixedFeed(later, feed.feeds).rebased({**meta, "step": 7})["phase"] == 2


@pytest.mark.parametrize("dp_before,dp_after", [(2, 2), (2, 3), (4, 1)])
def test_resumed_at_any_world_size_every_sample_once(dp_before, dp_after):
    """Switch world size mid-epoch through a saved cursor: still exactly once."""
    seen = Counter()
    order, cursor = EpochOrder(UNITS, seed=5, shuffle_block=64), Cursor()
    for _ in range(4):
        ids = order.next_batch(cursor, 12)
        for r in range(dp_before):
            seen.update(ParallelDims(dp_before).replica_part(ids, r).tolist())
    saved = cursor.state_dict()
    order, cursor = EpochOrder(UNITS, seed=5, shuffle_block=64), Cursor()
    cursor.load_state_dict(saved)
    while cursor.epoch == 0:
        ids = order.next_batch(cursor, 12)
        for r in range(dp_after):
            for micro in split_micro(ParallelDims(dp_after).replica_part(ids, r), 3):
                seen.update(micro.tolist())
    assert sorted(seen) == list(range(sum(UNITS))) and set(seen.values()) == {1}


def test_dp_1_2_4_3_mid_epoch_trains_the_batches_of_an_uninterrupted_dp_1_run():
    """Each resize restores the cursor into a fresh order (a new coordinator): the global
    batches, as the union of the replicas' parts in rank order, are those of one dp 1 run."""
    batch, steps = 12, 40  # 40 x 12 > 306: crosses into the second epoch
    order, cursor = EpochOrder(UNITS, seed=6, shuffle_block=64), Cursor()
    want = [order.next_batch(cursor, batch).tolist() for _ in range(steps)]
    got, saved = [], Cursor().state_dict()
    for dp, n in ((1, 7), (2, 9), (4, 13), (3, 11)):
        order, cursor = EpochOrder(UNITS, seed=6, shuffle_block=64), Cursor()
        cursor.load_state_dict(saved)
        for _ in range(n):
            ids = order.next_batch(cursor, batch)
            dims = ParallelDims(dp)
            got.append([i for r in range(dp) for i in dims.replica_part(ids, r).tolist()])
        saved = cursor.state_dict()
    assert got == want


def test_parallel_dims_rank_arithmetic():
    dims = ParallelDims(dp=3, pp=2)
    assert dims.world_size == 6
    assert [dims.coords(r) for r in range(6)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert all(dims.rank(*dims.coords(r)) == r for r in range(6))
    assert dims.dp_group(1) == [3, 4, 5] and dims.pp_group(2) == [2, 5]
    with pytest.raises(ValueError):
        ParallelDims(dp=0)
    # context parallelism: a replica's cp workers neighbours, reading its rows, each a copy
    # of the whole state (one part: its copies are every rank)
    cp = ParallelDims(dp=2, cp=2)
    assert cp.world_size == 4 and cp.per_replica == 2 and cp.parts == 1
    assert [(cp.coords(r), cp.cp_rank(r)) for r in range(4)] == [((0, 0), 0), ((0, 0), 1),
                                                                 ((1, 0), 0), ((1, 0), 1)]
    assert all(cp.rank(*cp.coords(r), cp_rank=cp.cp_rank(r)) == r for r in range(4))
    assert cp.replica_groups() == [[0, 1, 2, 3]] and {cp.part_of(r) for r in range(4)} == {(0, 0, 0)}
    # sharded (ZeRO with cp): a replica's cp workers split the state too, shard = dp shard x cp
    z = ParallelDims(dp=4, dp_shard=2, cp=2, sharded_cp=True)  # rank = dp_rank * 2 + cp_rank
    assert z.shards == 4 and z.parts == 4 and z.dp_replicate == 2
    assert [z.part_of(r)[1] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert z.replica_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # unsharded over cp, a replica's cp workers are copies: 2 parts, each held by 4 ranks
    assert ParallelDims(dp=4, dp_shard=2, cp=2).replica_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # in pipeline stages: a pipeline is the stages of one part of the positions (and one tp
    # share), rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank
    staged = ParallelDims(dp=1, pp=2, cp=2, tp=2)
    assert staged.pp_group(0, tp_rank=1, cp_rank=1) == [3, 7] and staged.pp_group(0) == [0, 4]
    assert staged.replica_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]  # (a stage's tp share)


def test_data_prepare_command(tmp_path, capsys):
    from baton import cli

    out = tmp_path / "corpus"
    assert cli.main(["data", "prepare", "stdlib", "--out", str(out), "--seq-len", "512"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("wrote ") and "samples of 513 tokens" in printed and str(out) in printed
    assert (out / "_corpus.json").exists() and list(out.glob("part-*.parquet"))
    assert cli.main(["data", "prepare", "stdlib", "--out", str(out)]) == 2  # never overwrites
    assert capsys.readouterr().err == f"baton: error: {out} already exists; choose a new --out\n"
    under_a_file = out / "_corpus.json" / "again"  # used to end in a traceback
    assert cli.main(["data", "prepare", "stdlib", "--out", str(under_a_file)]) == 2
    assert capsys.readouterr().err.startswith(f"baton: error: cannot write a corpus to {under_a_file} (")


def test_a_batch_sends_only_the_references_of_units_the_workers_do_not_hold():
    """The coordinator's `UnitsSent` mirrors each worker's `UnitRows`: batch by batch, the
    units a stripped batch leaves without references are exactly those the worker still
    holds, and the worker ends up with every unit's references as the full batch gave them;
    a unit let go (out of the window) and needed again is sent again."""
    from baton.data.feed import Batch, UnitsSent
    from baton.data.rows import UnitRows

    refs = {u: [f"ref-{u}"] for u in range(8)}
    steps = [({0, 1}, {0, 1, 2}), ({1, 2}, {0, 1, 2, 3}), ({3}, {3, 4}), ({0, 4}, {0, 4}),
             ({0, 5}, {0, 5, 6}), ({6, 7}, {6, 7})]  # (units of the batch, the feed's window)
    sent, rows = UnitsSent(), UnitRows({})
    resent = []
    for units, window in steps:
        full = Batch(np.zeros(0, dtype=np.int64), {u: (10 * u, refs[u]) for u in units}, frozenset(window))
        stripped = sent.strip(full)
        resent.append(sorted(u for u, (_, r) in stripped.units.items() if r is not None))
        rows.use(stripped)
        assert set(rows.wanted) == sent.uids
        assert all(rows.wanted[u] == (10 * u, refs[u]) for u in units)
    assert resent == [[0, 1], [2], [3], [0, 4], [5], [6, 7]]  # 0 left the window at step 3
    with pytest.raises(RuntimeError, match="unit 3"):  # a worker of another world: one line
        UnitRows({}).use(Batch(np.zeros(0, dtype=np.int64), {3: (30, None)}, frozenset({3})))


def test_ray_data_is_quiet_once_the_feed_imports_it():
    """The feed imports Ray Data where it first reads through it, and Ray Data's import sets
    its logger to DEBUG with a console handler at INFO: the levels must be set after it, or
    each read prints its lines under the progress line. A fresh process, as a driver is."""
    import subprocess
    import sys

    probe = ("import logging; from baton.data.feed import _ray_data; data = _ray_data(); "
             "print(logging.getLogger('ray.data').level, "
             "logging.getLogger('ray.data._internal.progress').level, "
             "data.DataContext.get_current().enable_progress_bars, "
             "data.DataContext.get_current().execution_options.preserve_order)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["30", "40", "False", "True"], out.stdout + out.stderr


def test_a_mix_of_corpora_tokenised_two_ways_is_refused(tmp_path):
    """Token ids mean one vocabulary: sources `baton data prepare` tokenised by different
    tokenizers are refused before Ray starts, naming both; sources of other shapes too."""
    from pathlib import Path

    from baton.data.source import preflight
    from baton.errors import SpecError
    from baton.spec import spec_from_dict
    from helpers import tiny_spec, write_dataset

    a = write_dataset(Path(tmp_path) / "a", num_samples=16, seq_len=32)
    b = write_dataset(Path(tmp_path) / "b", num_samples=16, seq_len=32, id_offset=5000)
    raw = tiny_spec(tmp_path, a)
    raw["data"]["mix"] = [{"path": str(a)}, {"path": str(b), "weight": 2}]
    data = preflight(spec_from_dict(raw), "job.yaml")
    assert data.train_samples == 32 and data.manifest.weights.tolist() == pytest.approx([1 / 3, 2 / 3])
    (a / "_corpus.json").write_text(json.dumps({"tokenizer": "bytes"}))
    preflight(spec_from_dict(raw), "job.yaml")  # one source says, the other does not
    (b / "_corpus.json").write_text(json.dumps({"tokenizer": "mytok:encode"}))
    with pytest.raises(SpecError, match=r"data.mix\[1\].path: '.*b' was tokenised by mytok:encode, "
                                        r"data.mix\[0\].path by bytes; a model reads one vocabulary"):
        preflight(spec_from_dict(raw), "job.yaml")
    short = write_dataset(Path(tmp_path) / "short", num_samples=16, seq_len=16)
    raw["data"]["mix"][1]["path"] = str(short)
    with pytest.raises(SpecError, match=r"model.seq_len: 32 does not fit the data; rows of '.*short' hold 17"):
        preflight(spec_from_dict(raw), "job.yaml")


def test_a_mix_pins_each_source_and_says_which_changed(tmp_path):
    """A checkpoint of a mix records each source's manifest; resuming on a mix whose second
    source gained rows is refused naming that source (api.check_corpus), and a checkpoint of
    one corpus is not a mix's."""
    from pathlib import Path

    from baton.api import check_corpus
    from baton.data.manifest import Manifest
    from baton.data.mix import Mixture
    from baton.errors import CheckpointError
    from helpers import write_dataset

    a = write_dataset(Path(tmp_path) / "a", num_samples=16, seq_len=8)
    b = write_dataset(Path(tmp_path) / "b", num_samples=16, seq_len=8, id_offset=5000)
    before = Mixture([str(a), str(b)], [Manifest.build(str(a)), Manifest.build(str(b))], [1, 1])
    meta = {"step": 40, "data": before.summary(), "manifest": before.to_json()}
    check_corpus(meta, before, "job.yaml", rebase=False)  # the same corpora: resumes
    write_dataset(Path(tmp_path) / "b", num_samples=24, seq_len=8, id_offset=5000)
    after = Mixture([str(a), str(b)], [Manifest.build(str(a)), Manifest.build(str(b))], [1, 1])
    with pytest.raises(CheckpointError, match=r"job.yaml: data.mix: '.*' is not the corpus checkpoint 40 "
                                              r"was trained on: data.mix\[1\] \(.*b\) changed; restore it, "
                                              r"or pass --rebase-data"):
        check_corpus(meta, after, "job.yaml", rebase=False)
    check_corpus(meta, after, "job.yaml", rebase=True)
    one = {"step": 40, "data": Manifest.build(str(a)).summary(), "manifest": Manifest.build(str(a)).to_json()}
    with pytest.raises(CheckpointError, match="the checkpoint was not trained on a mix"):
        check_corpus(one, after, "job.yaml", rebase=False)


def test_runs_that_start_together_prepare_the_built_in_data_once(tmp_path):
    """A sweep's concurrent trials (threads of one driver) and two runs of one job started at
    once (two processes) name one built-in corpus: each reads it, none fails. Both prepared
    it at once, and the second rename failed ("Directory not empty"; found by
    benchmarks/sweeps.py)."""
    import threading

    from baton import api
    from baton.spec import spec_from_dict

    spec = spec_from_dict({"name": "d", "task": "classification", "data": {
        "source": "digits", "path": str(tmp_path / "digits"), "columns": {"inputs": ["pixels"], "label": "label"}},
        "model": {"name": "classifier", "layers": 1, "width": 8, "options": {"inputs": 64, "classes": 10}},
        "train": {"steps": 1, "global_batch": 8}, "resources": {"cpus_per_worker": 0.5}})
    got, lines = [], []

    def fitted():
        got.append(api._fitted_data(spec, "d.yaml", None, lines.append).train_samples)
    threads = [threading.Thread(target=fitted) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got) == 2 and got[0] == got[1] > 0
    assert sum(line.startswith("preparing the digits dataset") for line in lines) == 1

    # another process's: the folder is there by the time this one would rename its own
    api.prepare_data(spec, lines.append)
    assert lines[-1] == f"  {spec.data.path} was prepared meanwhile by another run: reading that"
