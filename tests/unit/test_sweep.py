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


def test_halving_rungs_leave_at_least_one_trial_at_the_end():
    from baton.halving import rungs

    assert rungs(8, 80, 2) == [10, 20, 40, 80]  # 8 -> 4 -> 2 -> 1 trials
    assert rungs(9, 100, 3) == [11, 33, 100]  # 9 -> 3 -> 1 (100 / 9 rounded)
    assert rungs(4, 4, 2) == [1, 2, 4]
    assert rungs(5, 100, 3) == [33, 100]  # 5 -> 1: one rung to judge at
    assert rungs(9, 100, 3, first=5) == [5, 15, 100]
    assert rungs(27, 10, 3) == [1, 3, 9, 10]  # short jobs: a rung is at least a step
    assert rungs(27, 10, 3, first=8) == [8, 10]  # 24 is past train.steps


def _losses():
    """A stand-in for api.run that trains nothing: each trial's loss falls with its step, by
    a factor its learning rate sets (the closest to 3e-3 falls fastest); records each call."""
    from types import SimpleNamespace

    from baton.errors import WorkerError

    calls = []

    def run(spec, until):
        calls.append((spec.name, until))
        if spec.train.lr > 0.5:
            raise WorkerError("worker rank 0 failed while training step 1: loss is NaN")
        step = until or spec.train.steps
        loss = 1 + abs(spec.train.lr - 3e-3) * 100 / step
        return SimpleNamespace(state="paused" if until else "finished", step=step, loss=loss,
                               run_id=f"run-{spec.name}", eval={}, best=None, stopped_early=None)
    return run, calls


def test_halving_trains_the_best_third_on_at_each_rung_and_cuts_the_rest(tmp_path):
    """9 trials, --halving 3 over 90 steps: all 9 to step 10, the best 3 to step 30, the best
    one to step 90; the others cut where they stopped. A trial that fails is never promoted."""
    from baton.halving import dealt, halve
    from baton.sweeps import train_each

    lrs = [1e-3, 2e-3, 3e-3, 4.5e-3, 5e-3, 6e-3, 8e-3, 1e-2, 1.0]
    trials = plan(_job(tmp_path, train={"steps": 90}), {"train.lr": lrs})
    run, calls = _losses()
    log = []
    halve(dealt(trials, 3, None), 3, lambda batch, until: train_each(
        batch, lambda spec, end, on_step: run(spec, end), log.append, until), log.append)
    name = {t.spec.train.lr: t.name for t in trials}
    assert calls == ([(name[lr], 10) for lr in lrs] + [(name[lr], 30) for lr in (3e-3, 2e-3, 4.5e-3)]
                     + [(name[3e-3], None)])
    state = {t.spec.train.lr: (t.state, t.step, t.rung) for t in trials}
    assert state[3e-3] == ("finished", 90, 2)
    assert state[2e-3] == state[4.5e-3] == ("cut", 30, 1)
    assert all(state[lr] == ("cut", 10, 0) for lr in (1e-3, 5e-3, 6e-3, 8e-3, 1e-2))
    assert state[1.0] == ("failed", 0, 0)
    ranked = [t.spec.train.lr for t in rank(trials, "loss", True)]
    assert ranked[:3] == [3e-3, 2e-3, 4.5e-3] and ranked[-1] == 1.0  # furthest first, failed last
    assert "rung 2 of 3: 3 trials to step 30" in log
    assert any(line.startswith(f"  {name[1e-2]}: cut at step 10: loss ") and line.endswith(", 8 of 9")
               for line in log), log


def test_asynchronous_halving_promotes_a_trial_as_soon_as_it_stands_among_the_best(tmp_path):
    """The 9 trials of the test above under --async, a trial at a time: the best of the first
    three (3e-3) goes on to step 30 before the fourth begins, and on to the end once three
    are judged at step 30; the same trials go as far as under synchronous halving, here."""
    from baton.halving import dealt, promote
    from baton.sweeps import drive

    lrs = [1e-3, 2e-3, 3e-3, 4.5e-3, 5e-3, 6e-3, 8e-3, 1e-2, 1.0]
    trials = plan(_job(tmp_path, train={"steps": 90}), {"train.lr": lrs})
    run, calls = _losses()
    log = []
    promote(dealt(trials, 3, None), 3, lambda lineup: drive(
        lineup, lambda spec, end, on_step: run(spec, end), log.append), log.append)
    name = {t.spec.train.lr: t.name for t in trials}
    assert calls == [(name[1e-3], 10), (name[2e-3], 10), (name[3e-3], 10), (name[3e-3], 30),
                     (name[4.5e-3], 10), (name[5e-3], 10), (name[6e-3], 10), (name[2e-3], 30),
                     (name[8e-3], 10), (name[1e-2], 10), (name[1.0], 10), (name[4.5e-3], 30),
                     (name[3e-3], None)]
    state = {t.spec.train.lr: (t.state, t.step, t.rung) for t in trials}
    assert state[3e-3] == ("finished", 90, 2)
    assert state[2e-3] == state[4.5e-3] == ("cut", 30, 1)
    assert all(state[lr] == ("cut", 10, 0) for lr in (1e-3, 5e-3, 6e-3, 8e-3, 1e-2))
    assert state[1.0] == ("failed", 0, 0)
    assert [t.spec.train.lr for t in rank(trials, "loss", True)][:3] == [3e-3, 2e-3, 4.5e-3]
    assert log[0] == f"trial 1 of 9: {name[1e-3]} (train.lr=0.001) to step 10"
    assert f"  {name[3e-3]} goes on to step 30 (rung 2 of 3): loss 1 at step 10, 1 of 3 judged there so far" in log
    assert f"  {name[2e-3]}: cut at step 30: loss 1.003, 2 of 3" in log, log
    assert any(line.startswith(f"  {name[1e-2]}: cut at step 10: loss ") and line.endswith(", 8 of 9")
               for line in log), log


def test_asynchronous_halving_keeps_the_places_of_trials_that_ended_or_went_further_before(tmp_path):
    """6 trials, --halving 3 --async over 90 steps (the best 2 of 6 on from step 30): one
    finished before (a sweep run again: judged at the end, it holds a place at step 30) and
    one stopped early at step 20 (eval.patience) with the second best loss, which holds the
    other place without training; the 4 others are cut, and no trial trains twice."""
    from types import SimpleNamespace

    from baton.halving import dealt, promote
    from baton.sweeps import drive

    trials = plan(_job(tmp_path, train={"steps": 90}), {"train.lr": [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]})
    calls = []

    def run(spec, until, on_step):
        calls.append(spec.train.lr)
        step = {1e-3: 90, 2e-3: 20}.get(spec.train.lr, until)
        return SimpleNamespace(state="finished" if step == 90 else "paused", step=step,
                               loss=spec.train.lr * 1000, run_id="r", eval={}, best=None,
                               stopped_early="no better eval_loss" if step == 20 else None)

    promote(dealt(trials, 3, None), 3, lambda lineup: drive(lineup, run, lambda line: None), lambda line: None)
    assert calls == [1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3]
    assert [(t.state, t.step, t.rung) for t in trials] == [
        ("finished", 90, 1), ("stopped early", 20, 1), *[("cut", 30, 0)] * 4]


def test_asynchronous_halving_does_not_wait_for_a_rungs_slowest_trial(tmp_path):
    """4 trials, 2 at once, --halving 3 --async over 9 steps (judged at step 3): the first
    trial trains to the end while the second, slow one is still on its way to step 3 (the
    slow one waits until then, or 30 s); the slow one, judged last, is cut."""
    import threading
    from types import SimpleNamespace

    from baton.halving import dealt, promote
    from baton.sweeps import drive

    trials = plan(_job(tmp_path, train={"steps": 9}), {"train.lr": [1e-3, 2e-3, 3e-3, 4e-3]})
    fast_one_at_the_end, waited = threading.Event(), []

    def run(spec, until, on_step):
        if until is None:
            fast_one_at_the_end.set()
        if spec.train.lr == 2e-3:
            waited.append(fast_one_at_the_end.wait(timeout=30))
        step = until or spec.train.steps
        return SimpleNamespace(state="paused" if until else "finished", step=step,
                               loss=spec.train.lr * 1000 / step, run_id="r", eval={}, best=None,
                               stopped_early=None)

    log = []
    promote(dealt(trials, 3, None), 3, lambda lineup: drive(lineup, run, log.append, concurrent=2,
                                                  total={"CPU": 2.0}), log.append)
    assert waited == [True]
    assert [(t.state, t.step) for t in trials] == [("finished", 9), ("cut", 3), ("cut", 3), ("cut", 3)]


def test_a_halving_that_cannot_judge_its_trials_is_one_line(tmp_path, capsys):
    from baton.halving import check_halving

    job = _job(tmp_path, train={"steps": 8})
    two = plan(job, {"train.lr": [1e-3, 2e-3]})
    for args, message in [((two, 1, None), "--halving 1: give 2 or more"),
                          ((two, 3, None), "--halving 3 keeps the best 1/3 of the trials at each "
                                           "rung: give at least 3 trials (there are 2)"),
                          ((two, 2, 8), "--first-rung 8: give a step from 1 to below train.steps (8)"),
                          ((plan(job, {"train.steps": [4, 8]}), 2, None),
                           "train.steps cannot differ between trials")]:
        with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_halving(*args, job)
    assert cli.main(["sweep", job, "--grid", "train.lr=[1e-3, 2e-3]", "--first-rung", "2"]) == 2
    assert "--first-rung is where --halving first judges the trials: give --halving too" in capsys.readouterr().err
    assert cli.main(["sweep", job, "--grid", "train.lr=[1e-3, 2e-3]", "--async", "--list"]) == 2
    assert ("--async promotes the trials of a --halving as soon as they stand among the best: "
            "give --halving too") in capsys.readouterr().err
    assert cli.main(["sweep", job, "--grid", "train.lr=[1e-3, 2e-3, 3e-3, 4e-3]", "--halving", "2",
                     "--async", "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "asynchronous halving: judged at steps 2, 4; the best 1/2 go on as they are judged, the "
        "last to step 8")
    assert cli.main(["sweep", job, "--grid", "train.lr=[1e-3, 2e-3, 3e-3, 4e-3]", "--halving", "2",
                     "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "halving: judged at steps 2, 4; the best 1/2 go on each time, the last to step 8")


def test_hyperband_deals_the_trials_among_brackets_in_its_proportions(tmp_path):
    """--brackets B: Hyperband's numbers of trials a bracket (Li et al., 2018, Table 1: R=81,
    eta=3 gives 81, 34, 15, 8 and 5 trials to its five brackets); 9 trials in 3 brackets get 5,
    3 and 1, judged from step 10, from step 30 and never; each trial in one bracket, dealt
    alike for the same seed."""
    from baton.halving import bracket_sizes, deal

    assert bracket_sizes(143, 3, 5, 4) == [81, 34, 15, 8, 5]
    assert bracket_sizes(9, 3, 3, 2) == [5, 3, 1] and bracket_sizes(3, 3, 3, 2) == [1, 1, 1]
    assert bracket_sizes(9, 3, 2, 2) == [6, 3]
    trials = plan(_job(tmp_path, train={"steps": 90}), {"train.lr": [1e-3 * k for k in range(1, 10)]})
    dealt = deal(trials, 3, None, 3, seed=0)
    assert [(len(group), ends) for group, ends in dealt] == [(5, [10, 30, 90]), (3, [30, 90]), (1, [90])]
    assert sorted(t.name for group, _ in dealt for t in group) == sorted(t.name for t in trials)
    names = [[t.name for t in group] for group, _ in dealt]
    assert names == [[t.name for t in group] for group, _ in deal(trials, 3, None, 3, seed=0)]
    assert names != [[t.name for t in group] for group, _ in deal(trials, 3, None, 3, seed=1)]
    assert deal(trials, 3, None) == [(trials, [10, 30, 90])]  # one bracket: plain halving


def _hyperband(tmp_path, asynchronous):
    """The 9 trials of the halving tests in 3 brackets (seed 0 deals 2e-3, 4.5e-3, 5e-3,
    6e-3 and 1e-2 to the first, 1e-3, 3e-3 and 1.0 to the second, 8e-3 to the third)."""
    from baton.halving import dealt, halve, promote
    from baton.sweeps import drive, train_each

    lrs = [1e-3, 2e-3, 3e-3, 4.5e-3, 5e-3, 6e-3, 8e-3, 1e-2, 1.0]
    trials = plan(_job(tmp_path, train={"steps": 90}), {"train.lr": lrs})
    run, calls = _losses()
    log = []
    if asynchronous:
        promote(dealt(trials, 3, None, 3, 0), 3, lambda lineup: drive(
            lineup, lambda spec, end, on_step: run(spec, end), log.append), log.append)
    else:
        halve(dealt(trials, 3, None, 3, 0), 3, lambda batch, until: train_each(
            batch, lambda spec, end, on_step: run(spec, end), log.append, until), log.append)
    lr = {t.name: t.spec.train.lr for t in trials}
    return trials, [(lr[name], until) for name, until in calls], log


def test_hyperband_halves_each_bracket_and_ranks_every_trial_together(tmp_path):
    """Each bracket a halving of its own, one after another: the first judges its 5 at step
    10 and 30, the second its 3 at step 30, the third trains its one to the end unjudged; the
    ranking puts the three that trained to the end first, whatever their bracket."""
    trials, calls, log = _hyperband(tmp_path, asynchronous=False)
    assert calls == [(2e-3, 10), (4.5e-3, 10), (5e-3, 10), (6e-3, 10), (1e-2, 10), (2e-3, 30),
                     (2e-3, None), (1e-3, 30), (3e-3, 30), (1.0, 30), (3e-3, None), (8e-3, None)]
    assert [(t.spec.train.lr, t.state, t.step) for t in rank(trials, "loss", True)] == [
        (3e-3, "finished", 90), (2e-3, "finished", 90), (8e-3, "finished", 90), (1e-3, "cut", 30),
        (4.5e-3, "cut", 10), (5e-3, "cut", 10), (6e-3, "cut", 10), (1e-2, "cut", 10),
        (1.0, "failed", 0)]
    assert [line for line in log if line.startswith("bracket")] == [
        "bracket 1 of 3: 5 trials", "bracket 2 of 3: 3 trials", "bracket 3 of 3: 1 trial"]
    lines = table(rank(trials, "loss", True), "loss")  # each trial's bracket beside its values
    assert lines[0].split() == ["trial", "train.lr", "bracket", "state", "step", "loss", "loss"]
    assert [line.split()[2:4] for line in lines[1:4]] == [["2", "finished"], ["1", "finished"],
                                                          ["3", "finished"]]


def test_asynchronous_hyperband_begins_the_brackets_side_by_side_and_ends_each_on_a_trial(tmp_path):
    """--async --brackets 3: the brackets' first trials begin one after another (the third
    bracket's to the end at once), a trial going on comes before a new one, and the first
    bracket, whose 5 trials leave none among the best 1/3 of the one judged at step 30,
    still trains its best to the end (as the synchronous one does): the same trials end
    where they end under synchronous Hyperband."""
    trials, calls, log = _hyperband(tmp_path, asynchronous=True)
    assert calls[:3] == [(2e-3, 10), (1e-3, 30), (8e-3, None)]
    assert calls[-1] == (2e-3, None) and len(calls) == 12
    assert log[0] == "bracket 1, trial 1 of 5: q-lr0.002 (train.lr=0.002) to step 10"
    assert ("  q-lr0.002 goes on to step 90 (rung 3 of 3): loss 1.003 at step 30, 1 of 1 judged "
            "there so far") in log
    synchronous, _, _ = _hyperband(tmp_path / "sync", asynchronous=False)
    assert ([(t.name, t.state, t.step) for t in rank(trials, "loss", True)]
            == [(t.name, t.state, t.step) for t in rank(synchronous, "loss", True)])


def test_brackets_that_cannot_be_dealt_are_one_line(tmp_path, capsys):
    from baton.halving import check_halving

    job = _job(tmp_path, train={"steps": 90})
    nine = plan(job, {"train.lr": [1e-3 * k for k in range(1, 10)]})
    for count, message in [(4, "--brackets 4: give 1 to 3 (these 9 trials are judged at 2 rungs at "
                                "most, so 3 brackets at most"), (0, "--brackets 0: give 1 to 3")]:
        with pytest.raises(SpecError, match=message.replace("(", r"\(")):
            check_halving(nine, 3, None, job, brackets=count)
    grid = "train.lr=[1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3, 7e-3, 8e-3, 9e-3]"
    assert cli.main(["sweep", job, "--grid", grid, "--brackets", "2", "--list"]) == 2
    assert ("--brackets deals the trials of a --halving out among several halvings: give "
            "--halving too") in capsys.readouterr().err
    assert cli.main(["sweep", job, "--grid", grid, "--halving", "3", "--brackets", "3", "--list"]) == 0
    assert capsys.readouterr().out.splitlines()[-3:] == [
        "bracket 1 of 3: 5 trials (q-lr2e-3, q-lr4e-3, q-lr5e-3, q-lr6e-3, q-lr8e-3), judged at "
        "steps 10, 30; the best 1/3 go on each time, the last to step 90",
        "bracket 2 of 3: 3 trials (q-lr1e-3, q-lr3e-3, q-lr9e-3), judged at step 30; the best 1/3 "
        "go on each time, the last to step 90",
        "bracket 3 of 3: 1 trial (q-lr7e-3), each to step 90, unjudged"]


def test_concurrent_trials_run_together_where_their_largest_worlds_fit(tmp_path):
    """--concurrent 2 on a cluster of 2 CPUs: two trials of 1 CPU each (dp 2 x 0.5) at once,
    each meeting the other at a barrier that only two running together pass; on 1.5 CPUs
    one at a time. An elastic trial counts its largest world."""
    import threading

    from baton.sweeps import fit_together, most_at_once, train_each

    job = _job(tmp_path)
    trials = plan(job, {"train.lr": [1e-3, 2e-3, 3e-3, 4e-3]})
    assert fit_together([t.spec for t in trials[:2]], {"CPU": 2.0})
    assert not fit_together([t.spec for t in trials[:3]], {"CPU": 2.0})
    elastic = plan(job, {"train.lr": [1e-3]}, ["elastic.min_dp=1", "elastic.max_dp=4"])
    assert not fit_together([elastic[0].spec, trials[0].spec], {"CPU": 2.0})  # 2 CPUs + 1
    assert [most_at_once(trials, {"CPU": cpus}) for cpus in (0.5, 2.0, 3.5, 64.0)] == [1, 2, 3, 4]

    def runner(meet=None):
        from types import SimpleNamespace

        lock, now, most = threading.Lock(), [0], [0]

        def run(spec, until, on_step):
            with lock:
                now[0] += 1
                most[0] = max(most[0], now[0])
            if meet is not None:
                meet.wait(timeout=30)  # BrokenBarrierError unless two run at once
            with lock:
                now[0] -= 1
            return SimpleNamespace(state="finished", step=spec.train.steps, loss=1.0, run_id="r",
                                   eval={}, best=None, stopped_early=None)
        return run, most

    run, most = runner(threading.Barrier(2))
    log = []
    train_each(trials, run, log.append, concurrent=2, total={"CPU": 2.0, "GPU": 0.0})
    assert [t.state for t in trials] == ["finished"] * 4 and most[0] == 2
    assert log[:2] == ["trial 1 of 4: q-lr0.001 (train.lr=0.001)", "trial 2 of 4: q-lr0.002 (train.lr=0.002)"]

    trials = plan(job, {"train.lr": [1e-3, 2e-3, 3e-3]})
    run, most = runner()
    train_each(trials, run, lambda line: None, concurrent=2, total={"CPU": 1.5})
    assert [t.state for t in trials] == ["finished"] * 3 and most[0] == 1


def test_a_concurrent_trial_that_fails_leaves_the_rest_and_a_crash_stops_them(tmp_path):
    """A trial's BatonError (a rate that diverges) is reported and the others train on; any
    other error stops the trials still running at their next step (their on_step raises
    KeyboardInterrupt, as Ctrl-C would) and is raised."""
    import threading
    from types import SimpleNamespace

    from baton.errors import WorkerError
    from baton.sweeps import train_each

    trials = plan(_job(tmp_path), {"train.lr": [1e-3, 2e-3]})
    started, stopped = threading.Barrier(2), []

    def run(spec, until, on_step):
        started.wait(timeout=30)
        if spec.train.lr == 2e-3:
            raise WorkerError("worker rank 0 failed while training step 1: loss is NaN")
        return SimpleNamespace(state="finished", step=3, loss=1.0, run_id="r", eval={}, best=None,
                               stopped_early=None)

    train_each(trials, run, lambda line: None, concurrent=2, total={"CPU": 2.0})
    assert [t.state for t in trials] == ["finished", "failed"]

    def crashing(spec, until, on_step):
        started.wait(timeout=30)
        if spec.train.lr == 2e-3:
            raise RuntimeError("a bug")
        try:
            for _ in range(600):  # a trial's steps, at most 30 s
                on_step(None)
                threading.Event().wait(0.05)
        except KeyboardInterrupt:
            stopped.append(spec.name)
            raise
        return SimpleNamespace(state="finished", step=3, loss=1.0, run_id="r", eval={}, best=None,
                               stopped_early=None)

    started.reset()
    trials = plan(_job(tmp_path), {"train.lr": [1e-3, 2e-3]})
    with pytest.raises(RuntimeError, match="a bug"):
        train_each(trials, crashing, lambda line: None, concurrent=2, total={"CPU": 2.0})
    assert stopped == ["q-lr0.001"]


def _searched(tmp_path, axes, n, score, seed=0, fail=lambda values: False):
    """A TPE search (`search.Suggested`) driven as `sweeps.drive` drives it a trial at a time,
    each trial's result `score(values)` instead of a run (or a failure); its trials' values,
    the lines it said and its Optuna study."""
    from baton.search import Model, Suggested

    lines = []
    search = Suggested(Model(_job(tmp_path), axes, ["train.steps=2", "train.min_lr=0"], n, seed, True,
                             lines.append))
    while search.peek() is not None:
        t, until = search.take()
        assert until is None
        if fail(t.values):
            t.state = "failed"
        else:
            t.state, t.metric = "finished", score(t.values)
        search.ended(t)
    return [t.values for t in search.trials], lines, search.model.study()


def test_a_tpe_search_suggests_near_the_best_results_and_replays_the_same_trials(tmp_path):
    """--search tpe: the first trials at random (a third, 3 to 10), then each suggested from
    the results so far, every result told to the model; the same seed and results suggest the
    same trials again (a sweep run again goes on where it stopped). A trial whose values were
    suggested before is not trained twice, and the search ends when it suggests only those; a
    failed trial is told as failed. (Whether the suggestions find better settings than random
    draws is measured, not tested: benchmarks/search.py.)"""
    import math

    from baton.search import startup

    assert [startup(n) for n in (2, 9, 20, 100)] == [3, 3, 6, 10]
    axes = {"train.lr": "loguniform(1e-5, 1e-1)", "model.width": [32, 64]}

    def score(v):
        return abs(math.log10(v["train.lr"]) + 3) + (v["model.width"] == 32) * 0.1
    values, lines, study = _searched(tmp_path, axes, 20, score)
    assert len(values) == len({(v["train.lr"], v["model.width"]) for v in values}) == 20
    assert lines[0].endswith("suggested at random") and lines[6].endswith("suggested from 6 results")
    # every result reached the model, as the score of the values it suggested
    assert [round(x.value, 9) for x in study.trials] == [round(score(v), 9) for v in values]
    again, _, _ = _searched(tmp_path / "again", axes, 20, score)
    assert again == values

    few, lines, _ = _searched(tmp_path / "few", {"model.width": [32, 64]}, 5, lambda v: 1.0)
    assert sorted(v["model.width"] for v in few) == [32, 64]
    assert lines[-1] == ("the search suggested only trials already run, 100 times in a row: it "
                         "ends at 2 trials")
    failed, _, study = _searched(tmp_path / "failed", axes, 8, score, fail=lambda v: v["train.lr"] > 1e-3)
    assert len(failed) == 8  # a failed trial tells the model nothing; the search goes on
    assert [x.state.name for x in study.trials] == [
        "FAIL" if v["train.lr"] > 1e-3 else "COMPLETE" for v in failed]


def _bohb(tmp_path, n, brackets, asynchronous, seed=0, axes=None):
    """A TPE search under --halving 3 over 90 steps (`search.brackets`), each trial's loss
    `_losses`'s (the closest learning rate to 3e-3 falls fastest) instead of a run: its
    trials, the runs made (learning rate, until), the lines said and the model."""
    from baton.halving import halve, promote
    from baton.search import Model, brackets as suggested
    from baton.sweeps import drive, train_each

    run, calls = _losses()
    log = []
    model = Model(_job(tmp_path, train={"steps": 90}), axes or {"train.lr": "loguniform(1e-4, 1e-1)"},
                  ["train.min_lr=0"], n, seed, True, log.append)
    lineups = suggested(model, 3, None, brackets)
    if asynchronous:
        promote(lineups, 3, lambda lineup: drive(
            lineup, lambda spec, end, on_step: run(spec, end), log.append), log.append)
    else:
        halve(lineups, 3, lambda batch, until: train_each(
            batch, lambda spec, end, on_step: run(spec, end), log.append, until), log.append)
    lr = {t.name: t.spec.train.lr for t in model.trials}
    return model.trials, [(lr[name], until) for name, until in calls], log, model


def test_bohb_suggests_each_trial_from_the_rungs_judged_so_far(tmp_path):
    """--search tpe --halving 3 --async (BOHB, asynchronous): each trial is suggested as it
    begins, the first 3 at random, the next ones from the results at the first rung (no trial
    has trained to the end yet), each told to the model as a trial pruned at that rung's
    step; a trial that trained to the end is told complete. The same seed and results suggest
    the same trials (a sweep run again goes on where it stopped)."""
    trials, calls, log, model = _bohb(tmp_path, 9, 1, asynchronous=True)
    assert len(trials) == len({t.name for t in trials}) == 9
    begun = [line for line in log if line.startswith("trial ")]
    assert [line.rsplit(", suggested ", 1)[1] for line in begun[:4]] == [
        "at random", "at random", "at random", "from 3 results"]
    assert calls[:3] == [(t.spec.train.lr, 10) for t in trials[:3]]
    assert not any(until is None for _, until in calls[:4])  # the 4th from rung results only
    finished = [t for t in trials if t.state == "finished"]
    assert len(finished) == 1 and finished[0].step == 90
    assert all((t.state, t.step) in (("cut", 10), ("cut", 30)) for t in trials if t not in finished)
    states = {t.name: x for t, x in zip(model.trials, model.study().trials)}
    for t in trials:
        x = states[t.name]
        if t is finished[0]:
            assert x.state.name == "COMPLETE" and x.value == t.metric
        else:
            assert x.state.name == "PRUNED" and x.intermediate_values == {t.step: t.metric}
    again, _, _, _ = _bohb(tmp_path / "again", 9, 1, asynchronous=True)
    assert [t.name for t in again] == [t.name for t in trials]


def test_synchronous_bohb_suggests_each_brackets_trials_from_the_brackets_before(tmp_path):
    """--search tpe --halving 3 --brackets 3 (BOHB): the first bracket's 5 trials at random,
    the second's 3 from the first's 5 results (4 pruned at a rung, 1 trained to the end), the
    third's one from those 8; each trial in its bracket."""
    trials, calls, log, _ = _bohb(tmp_path, 9, 3, asynchronous=False)
    assert [line for line in log if line.startswith("bracket")] == [
        "bracket 1 of 3: 5 trials, suggested at random", "bracket 2 of 3: 3 trials, suggested from 5 results",
        "bracket 3 of 3: 1 trial, suggested from 8 results"]
    assert [t.bracket for t in trials] == [1] * 5 + [2] * 3 + [3]
    assert calls[-1] == (trials[-1].spec.train.lr, None)  # the third bracket's, to the end unjudged
    assert sum(t.state == "finished" for t in trials) == 3


def test_bohb_over_fewer_settings_than_trials_ends_when_none_is_left_to_suggest(tmp_path):
    """Two learning rates, 9 trials: the search runs out after two, and the halving still
    ends on a trial trained to the end (asynchronous: the best of the highest rung goes on;
    synchronous: the later brackets have none)."""
    two = {"train.lr": [1e-3, 3e-3]}
    trials, calls, log, _ = _bohb(tmp_path, 9, 1, asynchronous=True, axes=two)
    assert [(t.spec.train.lr, t.state, t.step) for t in trials] == [(3e-3, "finished", 90), (1e-3, "cut", 10)]
    assert "the search suggested only trials already run, 100 times in a row: it ends at 2 trials" in log
    trials, calls, log, _ = _bohb(tmp_path / "sync", 9, 3, asynchronous=False, axes=two)
    assert [(t.spec.train.lr, t.state, t.step) for t in trials] == [(3e-3, "finished", 90), (1e-3, "cut", 10)]
    assert log[-2:] == ["bracket 2 of 3: no trial left to suggest", "bracket 3 of 3: no trial left to suggest"]


def test_a_tpe_search_is_refused_without_trials_or_under_a_halving_it_cannot_inform(tmp_path, capsys):
    from baton import api

    job = _job(tmp_path, train={"steps": 90})
    with pytest.raises(SpecError, match="--search tpe suggests --trials N trials: give --trials"):
        api.sweep(job, {"train.lr": [0.1, 0.2]}, search="tpe")
    with pytest.raises(SpecError, match=r"--search tpe with a synchronous --halving of one bracket "
                                        r"would suggest every trial before any result \(all at random\): "
                                        "add --async"):
        api.sweep(job, {"train.lr": [0.1, 0.2]}, search="tpe", halving=2, trials=4)
    with pytest.raises(SpecError, match="--search grid: use random or tpe"):
        api.sweep(job, {"train.lr": [0.1, 0.2]}, search="grid")
    grid = "train.lr=loguniform(1e-4, 1e-1)"
    assert cli.main(["sweep", job, "--grid", grid, "--trials", "9", "--search", "tpe", "--halving",
                     "3", "--list"]) == 2
    assert "add --async (each suggested as it begins)" in capsys.readouterr().err
    assert cli.main(["sweep", job, "--grid", grid, "--trials", "9", "--search", "tpe", "--halving",
                     "3", "--brackets", "3", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bracket 1 of 3: 5 trials, suggested as the bracket begins, judged at steps 10, 30; the "
        "best 1/3 go on each time, the last to step 90",
        "bracket 2 of 3: 3 trials, suggested as the bracket begins, judged at step 30; the best "
        "1/3 go on each time, the last to step 90",
        "bracket 3 of 3: 1 trial, suggested as the bracket begins, each to step 90, unjudged"]
    assert cli.main(["sweep", job, "--grid", grid, "--trials", "9", "--search", "tpe", "--halving",
                     "3", "--async", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "asynchronous halving: 9 trials, suggested as each begins, judged at steps 10, 30; the "
        "best 1/3 go on as they are judged, the last to step 90"]


def test_a_sweep_has_an_mlflow_run_of_its_own_found_again_when_it_runs_again(tmp_path):
    """`tracking.sweep.SweepRun`: a run named after the job, its axes and options as params;
    each trial's tags name it as the parent; closed with the trials ranked (`sweep.json`),
    the best one's name, run and metric, and its picture (report/: a line a trial that logged
    its metric, `baton report` draws the same); the same settings find the same run again,
    other settings make another; a sweep stopped by Ctrl-C is KILLED. (That trials' runs
    carry the tag: tests/integration/test_tasks.py's TPE sweep.)"""
    import json

    from mlflow.tracking import MlflowClient

    from baton import load
    from baton.tracking.sweep import PARENT, SweepRun

    job = _job(tmp_path, train={"steps": 90})
    trials = plan(job, {"train.lr": [1e-3, 3e-3, 1e-2]})
    base = trials[0].spec.tracking
    settings = {"axes": {"train.lr": [1e-3, 3e-3, 1e-2]}, "overrides": [], "trials": None,
                "halving": 3, "brackets": 1}
    record = SweepRun(load(job), settings)
    run_id = record.open()
    assert record.tags() == {PARENT: run_id}
    client = MlflowClient(base.uri)
    for t, (state, step, loss) in zip(trials, [("cut", 30, 1.5), ("finished", 90, 1.1), ("failed", 0, None)]):
        t.state, t.step, t.metric = state, step, loss
        if state != "failed":  # (a trial's run, as its coordinator logs it: the loss every 10 steps)
            t.run_id = client.create_run(client.get_run(run_id).info.experiment_id, run_name=t.name,
                                         tags=record.tags()).info.run_id
            for at in range(10, step + 1, 10):
                client.log_metric(t.run_id, "loss", loss + 1 / at, step=at)
    record.close(trials)
    run = client.get_run(run_id)
    assert run.info.run_name == "q-sweep" and run.info.status == "FINISHED"
    assert run.data.params["axis.train.lr"] == "[0.001, 0.003, 0.01]" and run.data.params["halving"] == "3"
    assert run.data.tags["best_trial"] == trials[1].name and run.data.metrics["best_loss"] == 1.1
    ranking = client.download_artifacts(run_id, "sweep.json", str(tmp_path))
    assert [(t["name"], t["state"]) for t in json.load(open(ranking))["trials"]] == [
        (trials[1].name, "finished"), (trials[0].name, "cut"), (trials[2].name, "failed")]
    assert sorted(a.path for a in client.list_artifacts(run_id, "report")) == [
        "report/report.html", "report/report.png"]
    assert cli.main(["report", run_id, "--tracking-uri", base.uri, "--out", str(tmp_path / "rep")]) == 0
    from baton.tracking.report import build_any

    drawn = build_any(client, run, str(tmp_path / "again"))
    assert drawn.points == {trials[1].name: 9, trials[0].name: 3}  # (the failed one has no run)
    again = SweepRun(load(job), settings)
    assert again.open() == run_id  # the same sweep, run again
    with pytest.raises(KeyboardInterrupt), again.recording(lambda: trials):
        raise KeyboardInterrupt
    assert client.get_run(run_id).info.status == "KILLED"
    other = SweepRun(load(job), {**settings, "halving": 2})
    assert other.open() not in (None, run_id)
    other.close([])
