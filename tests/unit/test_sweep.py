"""`baton sweep`'s plan, without Ray: the grid's trials, their names and job files, what is
refused before anything runs, and how trials are ranked and shown."""

from __future__ import annotations

import pytest

from baton import cli
from baton.errors import SpecError
from baton.sweeps import Draw, Trial, drawn, grid, parse_draw, plan, rank, ranked_by, table, trial_name
from helpers import tiny_spec, write_dataset, write_spec


def _job(tmp_path, **sections):
    data = write_dataset(tmp_path / "data", num_samples=16, seq_len=32)
    return str(write_spec(tmp_path / "job.yaml", tiny_spec(tmp_path, data, name="q", **sections)))


def test_every_combination_is_a_trial_named_by_its_values(tmp_path):
    assert grid({"train.lr": [1, 2], "model.width": [32, 64]}) == [
        {"train.lr": 1, "model.width": 32}, {"train.lr": 1, "model.width": 64},
        {"train.lr": 2, "model.width": 32}, {"train.lr": 2, "model.width": 64}]
    assert trial_name("quickstart", {"train.lr": 0.001, "model.width": 64}) == "quickstart-lr0.001-width64"
    assert trial_name("q", {"train.betas": [0.9, 0.95]}) == "q-betas0.90.95"
    long = trial_name("q" * 40, {"train.lr": 0.001, "model.width": 64, "train.warmup_steps": 10})
    assert len(long) <= 63 and long.startswith("q" * 40 + "-")  # a hash of the values
    trials = plan(_job(tmp_path), {"train.lr": [0.001, 0.003], "model.width": [32, 64]},
                  ["train.steps=2"])
    assert [t.name for t in trials] == ["q-lr0.001-width32", "q-lr0.001-width64",
                                        "q-lr0.003-width32", "q-lr0.003-width64"]
    t = trials[3].spec
    assert (t.name, t.train.lr, t.model.width, t.train.steps) == ("q-lr0.003-width64", 0.003, 64, 2)
    assert t.resources.keep_warm_s == 60  # the next trial takes its workers


@pytest.mark.parametrize("axes,message", [
    ({}, "a sweep needs --grid KEY=[VALUES]"),
    ({"train.lr": []}, "--grid train.lr: give a list of values"),
    ({"train.lrr": [0.1]}, "train.lrr: unknown key; did you mean 'lr'?"),
    ({"model.width": [32, 31]}, "model.heads: 2 is invalid; must divide model.width (31)"),
    ({"model.width": list(range(32, 32 + 2048))}, "the grid holds 2,048 trials; at most 1,024"),
    ({"train.lr": "loguniform(1e-4, 1e-2)"}, "--grid train.lr=loguniform(0.0001, 0.01): a range is "
                                             "drawn from by a random search; give --trials N"),
    ({"train.lr": "loguniform(0, 1)"}, "--grid train.lr=loguniform(0, 1): loguniform: LOW must be above 0"),
    ({"train.lr": "normal(0, 1)"}, "--grid train.lr=normal(0, 1): give a YAML list, or a range"),
])
def test_a_grid_that_cannot_run_is_refused_before_any_trial(tmp_path, axes, message):
    with pytest.raises(SpecError) as e:
        plan(_job(tmp_path), axes)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("item,message", [
    ("train.lr", "--grid 'train.lr': give KEY=[VALUES], a YAML list"),
    ("train.lr=0.1", "--grid 'train.lr=0.1': give KEY=[VALUES]"),
    ("train.lr=[0.1", "--grid 'train.lr=[0.1': not valid YAML"),
    ("train.lr=uniform(3, 1)", "--grid train.lr=uniform(3, 1): uniform: LOW must be below HIGH"),
    ("model.layers=randint(1, 2.5)", "randint: LOW and HIGH must be whole numbers"),
])
def test_the_command_says_what_a_grid_item_must_be(tmp_path, capsys, item, message):
    assert cli.main(["sweep", _job(tmp_path), "--grid", item]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_trials_are_ranked_by_the_jobs_metric_failed_ones_last(tmp_path):
    trials = [Trial("a", {"train.lr": 1}, "finished", 5, 2.0, 1.5), Trial("b", {"train.lr": 2}, "failed", error="boom"),
              Trial("c", {"train.lr": 3}, "stopped early", 3, 1.0, 1.2)]
    assert [t.name for t in rank(trials, "eval_loss", lowest=True)] == ["c", "a", "b"]
    assert [t.name for t in rank(trials, "eval_accuracy", lowest=False)] == ["a", "c", "b"]
    assert table(rank(trials, "eval_loss", True), "eval_loss") == [
        "trial  train.lr  state          step  loss    eval_loss",
        "c      3         stopped early  3     1.0000  1.2",
        "a      1         finished       5     2.0000  1.5",
        "b      2         failed         0",
        "  b: boom"]
    spec = plan(_job(tmp_path, eval={"fraction": 0.5, "every_steps": 1}, checkpoint={"best": "eval_loss", "every_steps": 1}),
                {"train.lr": [0.1]})[0].spec
    assert ranked_by(spec) == ("eval_loss", True)
    assert ranked_by(plan(_job(tmp_path), {"train.lr": [0.1]})[0].spec) == ("loss", True)


def test_list_shows_each_trial_and_trains_nothing(tmp_path, capsys):
    job = _job(tmp_path)
    assert cli.main(["sweep", job, "--grid", "train.lr=[0.001, 0.003]", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["q-lr0.001: train.lr=0.001", "q-lr0.003: train.lr=0.003"]
    assert not (tmp_path / "ckpt").exists()


def test_a_random_search_draws_seeded_distinct_trials_in_their_ranges(tmp_path, capsys):
    """--trials N: each trial draws every axis (a range, or one of a list's values), the same
    draws for the same seed (a sweep run again finds its trials done), floats to 3
    significant digits, randint's ends included; a space too small for N is one line."""
    import random

    axes = {"train.lr": parse_draw("loguniform(1e-4, 1e-2)"), "train.warmup_steps": parse_draw("randint(0, 3)"),
            "model.width": [32, 64], "train.grad_clip": parse_draw("uniform(0.5, 1)")}
    draws = drawn(axes, 200, seed=0)
    assert draws == drawn(axes, 200, seed=0) and draws != drawn(axes, 200, seed=1)
    assert len({str(d) for d in draws}) == 200
    lrs = [d["train.lr"] for d in draws]
    assert all(1e-4 <= x <= 1e-2 and x == float(f"{x:.3g}") for x in lrs)
    # log-uniform: a decade each side of 1e-3 holds half the draws (200 draws: 0.5 +- 0.035 at
    # one standard deviation; the bound is 4 of them)
    assert abs(sum(x < 1e-3 for x in lrs) / 200 - 0.5) < 0.15
    assert {d["train.warmup_steps"] for d in draws} == {0, 1, 2, 3}
    assert {d["model.width"] for d in draws} == {32, 64}
    assert all(0.5 <= d["train.grad_clip"] <= 1 for d in draws)
    assert Draw("randint", 1, 2).sample(random.Random(0)) in (1, 2)
    with pytest.raises(SpecError, match="--trials 9: only 8 distinct trials could be drawn"):
        drawn({"train.warmup_steps": parse_draw("randint(0, 3)"), "model.width": [32, 64]}, 9, seed=0)

    job = _job(tmp_path)
    trials = plan(job, {"train.lr": "loguniform(1e-3, 1e-2)", "model.width": [32, 64]}, trials=3, seed=4)
    assert [t.name for t in trials] == [trial_name("q", v) for v in drawn(
        {"train.lr": parse_draw("loguniform(1e-3, 1e-2)"), "model.width": [32, 64]}, 3, seed=4)]
    assert all(t.spec.train.lr == t.values["train.lr"] for t in trials)
    assert cli.main(["sweep", job, "--grid", "train.lr=loguniform(1e-3, 1e-2)", "--grid",
                     "model.width=[32, 64]", "--trials", "3", "--seed", "4", "--list"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines()] == [t.name for t in trials]
    with pytest.raises(SpecError, match="--trials 0: give 1 to 1,024"):
        plan(job, {"train.lr": [0.1]}, trials=0)
