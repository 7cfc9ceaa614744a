"""What `--search tpe` finds against random draws, for the same number of trials, side by side.

Three parts:

- **synthetic**: the searches as `baton sweep` runs them (`search.Suggested` and
  `sweeps.drawn`, the same axes' parsing and rounding), each trial scored at once by a bowl
  whose best is a learning rate of 1e-3 and a weight decay of 1e-2 (its distance from them,
  in decades, squared; the weight decay's at half weight) plus a width's cost (32: 0.3,
  64: 0.1, 128: 0); the best score after 10, 15, 20 and 30 trials, median over `--seeds`
  seeds. No training: it measures the searches, cheaply, over many seeds.
- **halving** (`--parts halving`): successive halving of `--halving-trials` trials over
  `--halving-steps` steps, `--halving 3`, with random draws or TPE's suggestions (BOHB),
  synchronous in `--brackets` brackets or asynchronous (ASHA) in one, each run's score read
  off a curve (`CURVES`: one whose order at every step is the end's, one where a larger
  learning rate looks better early than it ends); the true score (the bowl's) of the trial
  each sweep ranks first, and the steps its trials trained, median over `--seeds` seeds.
- **digits** (`--digits N`): the digits job, `--trials N` over `train.lr=loguniform(1e-4,
  1e-1)`, `train.weight_decay=loguniform(1e-4, 1)` and `model.width=[32, 64, 128]` at
  `--steps` steps, ranked by the best checkpoint's eval_loss, random and TPE with the same
  seed, for each of `--digits-seeds` seeds, each sweep on its own embedded Ray: the best
  eval_loss each found and after how many trials.

    python benchmarks/search.py --seeds 20
    python benchmarks/search.py --seeds 20 --parts halving --out benchmarks/results/search_halving_cpu.json
    python benchmarks/search.py --seeds 20 --digits 12 --digits-seeds 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / ".." / "platform"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / ".." / "tests"))
from results_io import write_result  # noqa: E402

AXES = {"train.lr": "loguniform(1e-4, 1e-1)", "train.weight_decay": "loguniform(1e-4, 1)",
        "model.width": [32, 64, 128]}
SYNTHETIC_AT = (10, 15, 20, 30)


def bowl(v: dict) -> float:
    return ((math.log10(v["train.lr"]) + 3) ** 2 + 0.5 * (math.log10(v["train.weight_decay"]) + 2) ** 2
            + {32: 0.3, 64: 0.1, 128: 0.0}[v["model.width"]])


def synthetic(job: str, seeds: int) -> dict:
    from baton.search import Model, Suggested
    from baton.sweeps import drawn, parsed_axes

    n = max(SYNTHETIC_AT)
    best = {"random": [], "tpe": []}
    for seed in range(seeds):
        scores = [bowl(v) for v in drawn(parsed_axes(job, AXES, n), n, seed)]
        best["random"].append([min(scores[:k]) for k in SYNTHETIC_AT])
        search = Suggested(Model(job, AXES, ["train.min_lr=0"], n, seed, True, lambda line: None))
        while search.peek() is not None:
            t, _ = search.take()
            t.state, t.metric = "finished", bowl(t.values)
            search.ended(t)
        scores = [t.metric for t in search.trials]
        best["tpe"].append([min(scores[:k]) for k in SYNTHETIC_AT])
    out = {way: {str(k): statistics.median(r[i] for r in runs) for i, k in enumerate(SYNTHETIC_AT)}
           for way, runs in best.items()}
    print(f"\nsynthetic: the best score after k trials (median of {seeds} seeds; lower is better)\n")
    print("| search | " + " | ".join(f"k={k}" for k in SYNTHETIC_AT) + " |")
    print("|---|" + "---:|" * len(SYNTHETIC_AT))
    for way, row in out.items():
        print(f"| {way} | " + " | ".join(f"{row[str(k)]:.3f}" for k in SYNTHETIC_AT) + " |")
    wins = sum(t[-1] < r[-1] for t, r in zip(best["tpe"], best["random"]))
    print(f"\nTPE's best after {max(SYNTHETIC_AT)} below random's in {wins} of {seeds} seeds")
    return {"median_best": out, "tpe_wins_at_30": wins, "seeds": seeds}


# How a trial's score goes with its step, for the halving part: `faithful`, the order at every
# step the order at the end (a rung judges as the end would); `misleading`, a larger learning
# rate looks better early than it ends (as on digits under train.schedule wsd, where
# halving's pick was 7th of 9: docs/benchmarks.md)
CURVES = {"faithful": lambda v, s, end: bowl(v) + 1 / math.sqrt(s) - 1 / math.sqrt(end),
          "misleading": lambda v, s, end: bowl(v) - (1 - s / end) * (math.log10(v["train.lr"]) + 3)}
HALVING_WAYS = {"random, hyperband": ("random", False), "tpe, hyperband (BOHB)": ("tpe", False),
                "random, asha": ("random", True), "tpe, asha (BOHB, async)": ("tpe", True)}


def halving(job: str, seeds: int, n: int, steps: int, brackets: int) -> dict:
    """Each way of `HALVING_WAYS` (`baton sweep --halving 3`, with `--brackets` when
    synchronous, `--async` with one bracket), as `api.sweep` drives it but each run's score
    read off a `CURVES` curve at the step it stops at: the true score (`bowl`) of the trial
    the sweep ranks first, and the steps its trials trained, median over `seeds` seeds."""
    from types import SimpleNamespace

    from baton import halving as halving_
    from baton import search as search_
    from baton import sweeps

    sets = [f"train.steps={steps}", "train.min_lr=0"]
    out = {}
    for curve, score in CURVES.items():
        rows = {way: {"true": [], "steps": []} for way in HALVING_WAYS}
        for seed in range(seeds):
            for way, (how, asynchronous) in HALVING_WAYS.items():
                def run(spec, until, on_step):
                    v = {"train.lr": spec.train.lr, "train.weight_decay": spec.train.weight_decay,
                         "model.width": spec.model.width}
                    at = until or steps
                    return SimpleNamespace(state="paused" if until else "finished", step=at,
                                           loss=score(v, at, steps), run_id="-", eval={}, best=None,
                                           stopped_early=None)
                count = 1 if asynchronous else brackets
                if how == "tpe":
                    model = search_.Model(job, AXES, sets, n, seed, True, lambda line: None)
                    lineups = search_.brackets(model, 3, None, count)
                else:
                    lineups = halving_.dealt(sweeps.plan(job, AXES, sets, n, seed), 3, None, count, seed)
                if asynchronous:
                    halving_.promote(lineups, 3, lambda lu: sweeps.drive(lu, run, lambda line: None),
                                     lambda line: None)
                else:
                    halving_.halve(lineups, 3, lambda batch, until: sweeps.train_each(
                        batch, run, lambda line: None, until), lambda line: None)
                trials = model.trials if how == "tpe" else [t for lu, _ in lineups for t in lu.listed]
                pick = sweeps.rank(trials, "loss", True)[0]
                rows[way]["true"].append(bowl(pick.values))
                rows[way]["steps"].append(sum(t.step for t in trials))
        out[curve] = {way: {"median_true_score": statistics.median(r["true"]),
                            "median_steps": statistics.median(r["steps"]), "true": r["true"]}
                      for way, r in rows.items()}
    print(f"\nhalving: {n} trials, --halving 3 over {steps} steps (--brackets {brackets} when "
          f"synchronous); the true score of the trial each picks, median of {seeds} seeds (lower is "
          "better), and the steps trained\n")
    print("| curve | way | pick's true score | steps | TPE's pick better than random's |")
    print("|---|---|---:|---:|---:|")
    for curve, rows in out.items():
        for way, r in rows.items():
            twin = way.replace("tpe", "random").replace(" (BOHB)", "").replace(" (BOHB, async)", "")
            wins = (f"{sum(a < b for a, b in zip(r['true'], rows[twin]['true']))} of {seeds}"
                    if twin != way else "")
            print(f"| {curve} | {way} | {r['median_true_score']:.3f} | {r['median_steps']:.0f} | {wins} |")
    return {"trials": n, "steps": steps, "brackets": brackets, "seeds": seeds, "curves": out}


def digits(n: int, seeds: int, steps: int) -> list[dict]:
    from baton import api

    rows = []
    for seed in range(seeds):
        for way in ("random", "tpe"):
            with tempfile.TemporaryDirectory() as tmp:
                root = Path(tmp)
                sets = [f"checkpoint.path={root / 'ckpt'}", "checkpoint.best=eval_loss",
                        f"data.path={root / 'digits'}", f"tracking.uri=sqlite:///{root / 'm.db'}",
                        f"train.steps={steps}", "eval.every_steps=" + str(steps // 2),
                        f"checkpoint.every_steps={steps // 2}", "train.min_lr=0",
                        "parallel.dp=1", "resources.cpus_per_worker=1"]
                t0 = time.perf_counter()
                order = []
                ranked = api.sweep(str(ROOT / ".." / "jobs" / "digits.yaml"), AXES, sets, trials=n,
                                   seed=seed, search=way, show_progress=False,
                                   log=lambda line: order.append(line.split(": ", 1)[1].split(" (", 1)[0])
                                   if line.startswith("trial ") else None)
                best = ranked[0]
                row = {"seed": seed, "search": way, "best_eval_loss": best.metric,
                       "best_trial": best.name, "found_at_trial": order.index(best.name) + 1,
                       "seconds": round(time.perf_counter() - t0, 1),
                       "eval_losses": [t.metric for t in sorted(ranked, key=lambda t: order.index(t.name))]}
                rows.append(row)
                print(f"seed {seed} {way}: best eval_loss {best.metric:.4f} ({best.name}, trial "
                      f"{row['found_at_trial']} of {n}) in {row['seconds']:.0f} s", flush=True)
    print(f"\ndigits: the best eval_loss of {n} trials of {steps} steps\n")
    print("| seed | random | tpe |")
    print("|---|---:|---:|")
    for seed in range(seeds):
        got = {r["search"]: r for r in rows if r["seed"] == seed}
        print(f"| {seed} | {got['random']['best_eval_loss']:.4f} (trial {got['random']['found_at_trial']}) "
              f"| {got['tpe']['best_eval_loss']:.4f} (trial {got['tpe']['found_at_trial']}) |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--parts", default="synthetic", help="of synthetic, halving (and --digits N)")
    ap.add_argument("--halving-trials", type=int, default=27)
    ap.add_argument("--halving-steps", type=int, default=81)
    ap.add_argument("--brackets", type=int, default=4, help="the synchronous halving rows' --brackets")
    ap.add_argument("--digits", type=int, default=0, metavar="N", help="trials of each real sweep (0: none)")
    ap.add_argument("--digits-seeds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default="benchmarks/results/search_cpu.json")
    args = ap.parse_args()
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        from helpers import tiny_spec, write_dataset, write_spec

        data = write_dataset(Path(tmp) / "data", num_samples=16, seq_len=32)
        job = str(write_spec(Path(tmp) / "job.yaml", tiny_spec(Path(tmp), data, name="s")))
        parts = args.parts.split(",")
        result = {"synthetic": synthetic(job, args.seeds)} if "synthetic" in parts else {}
        if "halving" in parts:
            result["halving"] = halving(job, args.seeds, args.halving_trials, args.halving_steps,
                                        args.brackets)
    if args.digits:
        result["digits"] = digits(args.digits, args.digits_seeds, args.steps)
    write_result(args.out, {**result, "axes": AXES})


if __name__ == "__main__":
    main()
