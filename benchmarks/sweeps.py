"""What a sweep's trials cost, several ways side by side in one run: the same seeded random
search (the digits job, `--trials N` over `train.lr=loguniform(1e-4, 1e-2)` and
`model.width=[32, 64, 128]`, ranked by the best checkpoint's eval_loss), with every trial
trained its 200 steps, with `--halving 3` or with `--halving 3 --async` (asynchronous
halving), each a trial at a time and 2 at once (`--concurrent 2`), or Hyperband (`--halving 3
--brackets 3`, synchronous or not), or BOHB (`--search tpe` with `--halving 3 --brackets 3`, or
`--async` in one bracket: its trials suggested, not the random search's). Every row's workers
take half a CPU each (`resources.cpus_per_worker: 0.5`, unless --set says otherwise), so
that two trials of 2 workers fit the 2-core machine together. Measured: seconds
from the sweep's start to its table (each starts its own embedded Ray), the steps trained
(each trial's last step, summed), and where the trial each picks stands in the first row's
ranking (1: the same trial), when the third trial began (the first two's starts: two at
once start twice the worker processes), and when the first trial had trained every step.

    python benchmarks/sweeps.py --trials 9
    python benchmarks/sweeps.py --trials 9 --set train.schedule=wsd --ways full,halving \
        --out benchmarks/results/sweeps_wsd_cpu.json
    python benchmarks/sweeps.py --trials 9 --ways halving,halving-2 \
        --out benchmarks/results/sweeps_starts_cpu.json
    python benchmarks/sweeps.py --trials 9 --set train.schedule=wsd --seed 0 \
        --ways full,halving,hyperband,hyperband-async --out benchmarks/results/sweeps_hyperband_s0_cpu.json
    python benchmarks/sweeps.py --trials 9 --set train.schedule=wsd --seed 0 \
        --ways hyperband,bohb,bohb-async --out benchmarks/results/sweeps_bohb_s0_cpu.json
    python benchmarks/sweeps.py --trials 9 --ways full-2,halving,halving-2,async,async-2 \
        --set parallel.dp=1 --set resources.cpus_per_worker=1 \
        --out benchmarks/results/sweeps_async_cpu.json
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / ".." / "platform"))
sys.path.insert(0, str(ROOT))
from results_io import write_result  # noqa: E402

AXES = {"train.lr": "loguniform(1e-4, 1e-2)", "model.width": [32, 64, 128]}


def sweep(root: Path, way: str, trials: int, seed: int, halving, concurrent: int,
          extra: list[str], asynchronous: bool = False, brackets: int = 1, search: str = "random") -> dict:
    from baton import api

    sets = [f"checkpoint.path={root / way}", "checkpoint.best=eval_loss", f"data.path={root / 'digits'}",
            f"tracking.uri=sqlite:///{root / way}.db", "resources.cpus_per_worker=0.5", *extra]
    t0, log = time.perf_counter(), []
    ranked = api.sweep(str(ROOT / ".." / "jobs" / "digits.yaml"), AXES, sets, trials=trials, seed=seed,
                       halving=halving, concurrent=concurrent, asynchronous=asynchronous,
                       brackets=brackets, search=search, show_progress=False,
                       log=lambda line: log.append([round(time.perf_counter() - t0, 2), line]))
    seconds = time.perf_counter() - t0
    # how long the trials took to start: from the sweep's start to the third line that begins a
    # trial ("trial K of N: ...", or "bracket B, trial K of N: ..."; two at once: the first two
    # trials' start and run; one at a time: the first two's)
    third = [at for at, line in log if re.match(r"(bracket \d+, )?trial \d+ of \d+: ", line)][2:3]
    # when the first trial had trained every step: a model to use, before the sweep ends
    first_done = [at for at, line in log if ": finished at step " in line]
    return {"seconds": round(seconds, 1), "steps": sum(t.step for t in ranked),
            "third_trial_at_s": third[0] if third else None,
            "first_finished_at_s": first_done[0] if first_done else None, "log": log,
            "ranked": [{"trial": t.name, "state": t.state, "step": t.step, "eval_loss": t.metric}
                       for t in ranked]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a job setting for every row (e.g. train.schedule=wsd)")
    p.add_argument("--ways", default="full,full-2,halving,halving-2",
                   help="the rows to run, of full, full-2, halving, halving-2, async, async-2, "
                        "hyperband, hyperband-async, bohb (--search tpe --brackets), bohb-async "
                        "(--search tpe --async, one bracket)")
    p.add_argument("--brackets", type=int, default=3, help="the hyperband rows' --brackets")
    p.add_argument("--out", default=str(ROOT / "results" / "sweeps_cpu.json"))
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ways = {"every trial to the end": ("full", None, 1, False),
            "every trial, 2 at once": ("full-2", None, 2, False),
            f"--halving {args.eta}": ("halving", args.eta, 1, False),
            f"--halving {args.eta}, 2 at once": ("halving-2", args.eta, 2, False),
            f"--halving {args.eta} --async": ("async", args.eta, 1, True),
            f"--halving {args.eta} --async, 2 at once": ("async-2", args.eta, 2, True),
            f"--halving {args.eta} --brackets {args.brackets}": ("hyperband", args.eta, 1, False),
            f"--halving {args.eta} --brackets {args.brackets} --async": ("hyperband-async", args.eta, 1, True),
            f"--search tpe --halving {args.eta} --brackets {args.brackets}": ("bohb", args.eta, 1, False),
            f"--search tpe --halving {args.eta} --async": ("bohb-async", args.eta, 1, True)}
    ways = {label: w for label, w in ways.items() if w[0] in args.ways.split(",")}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (way, halving, concurrent, asynchronous) in ways.items():
            rows[label] = sweep(Path(tmp), way, args.trials, args.seed, halving, concurrent, args.set,
                                asynchronous, args.brackets if way in ("hyperband", "hyperband-async", "bohb")
                                else 1, "tpe" if way.startswith("bohb") else "random")
            rows[label]["way"] = way
    base = next(iter(rows.values()))
    order = [r["trial"] for r in base["ranked"]]
    print(f"{args.trials} trials of jobs/digits.yaml (seed {args.seed}"
          + "".join(f", {o}" for o in args.set) + "), ranked by eval_loss:")
    print(f"{'search':<36}{'seconds':>9}{'x time':>8}{'steps':>8}{'trial 3 at':>11}{'1st done':>11}  "
          "best trial (eval_loss), its place")
    for label, r in rows.items():
        best = r["ranked"][0]
        # (a trial TPE suggested may not be among the first row's: no place)
        r["pick_place_in_full"] = order.index(best["trial"]) + 1 if best["trial"] in order else None
        r["time_ratio"] = round(r["seconds"] / base["seconds"], 3)
        r["steps_ratio"] = round(r["steps"] / base["steps"], 3)
        print(f"{label:<36}{r['seconds']:>9.1f}{r['time_ratio']:>8.2f}{r['steps']:>8}"
              + "".join(f"{x:>10.1f}s" if x is not None else f"{'-':>11}"
                        for x in (r["third_trial_at_s"], r["first_finished_at_s"])) + "  "
              f"{best['trial']} ({best['eval_loss']:.4f}), " + (f"{r['pick_place_in_full']} of {args.trials}"
                                                                 if r["pick_place_in_full"] else "-"))
    write_result(args.out, {"trials": args.trials, "eta": args.eta, "seed": args.seed, "axes": AXES,
                            "brackets": args.brackets,
                            "set": args.set, "rows": rows})


if __name__ == "__main__":
    main()
