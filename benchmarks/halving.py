"""What successive halving (`baton sweep --halving`) saves against training every trial to the
end, side by side in one run: the same seeded random search (the digits job, `--trials N`
over `train.lr=loguniform(1e-4, 1e-2)` and `model.width=[32, 64, 128]`, ranked by the best
checkpoint's eval_loss), once with every trial trained its 200 steps and once with
`--halving 3`. Measured: seconds from the sweep's start to its table (each starts its own
embedded Ray), the steps trained (each trial's last step, summed), and where the trial
halving picks stands in the full search's ranking (1: the same trial).

    python benchmarks/halving.py --trials 9
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / ".." / "platform"))
sys.path.insert(0, str(ROOT))
from results_io import write_result  # noqa: E402

AXES = {"train.lr": "loguniform(1e-4, 1e-2)", "model.width": [32, 64, 128]}


def sweep(root: Path, way: str, trials: int, seed: int, halving) -> dict:
    from baton import api

    sets = [f"checkpoint.path={root / way}", "checkpoint.best=eval_loss", f"data.path={root / 'digits'}",
            f"tracking.uri=sqlite:///{root / way}.db"]
    t0 = time.perf_counter()
    ranked = api.sweep(str(ROOT / ".." / "jobs" / "digits.yaml"), AXES, sets, trials=trials, seed=seed,
                       halving=halving, show_progress=False, log=lambda line: None)
    seconds = time.perf_counter() - t0
    return {"seconds": round(seconds, 1), "steps": sum(t.step for t in ranked),
            "ranked": [{"trial": t.name, "state": t.state, "step": t.step, "eval_loss": t.metric}
                       for t in ranked]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "results" / "halving_cpu.json"))
    args = p.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        full = sweep(root, "full", args.trials, args.seed, None)
        halved = sweep(root, "halving", args.trials, args.seed, args.eta)
    order = [r["trial"] for r in full["ranked"]]
    pick = halved["ranked"][0]
    place = order.index(pick["trial"]) + 1
    rows = [("every trial to the end", full), (f"--halving {args.eta}", halved)]
    print(f"{args.trials} trials of jobs/digits.yaml (seed {args.seed}), ranked by eval_loss:")
    print(f"{'search':<24}{'seconds':>9}{'steps':>8}  best trial (eval_loss)")
    for label, r in rows:
        best = r["ranked"][0]
        print(f"{label:<24}{r['seconds']:>9.1f}{r['steps']:>8}  {best['trial']} ({best['eval_loss']:.4f})")
    print(f"halving's pick is number {place} of {args.trials} in the full search; it took "
          f"{halved['seconds'] / full['seconds']:.2f}x the time and "
          f"{halved['steps'] / full['steps']:.2f}x the steps")
    write_result(args.out, {"trials": args.trials, "eta": args.eta, "seed": args.seed,
                            "axes": AXES, "full": full, "halving": halved,
                            "halving_pick_place_in_full": place,
                            "time_ratio": round(halved["seconds"] / full["seconds"], 3),
                            "steps_ratio": round(halved["steps"] / full["steps"], 3)})


if __name__ == "__main__":
    main()
