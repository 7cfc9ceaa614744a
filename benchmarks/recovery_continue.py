"""What a lost worker costs a run, with and without elastic.recovery continue.

`benchmarks/recovery.py` times a recovery to the first step after it. With `recovery:
continue` that step comes at once, in a smaller world, and the replacement joins later; what
the run loses is the smaller world's slower steps and the growth back, not a recovery time.
So this measures the time lost: each round runs the job without a fault (the reference),
with `replace` and with `continue`, in alternating order, on recovery.py's simulated cluster
(a head with no CPUs and three one-CPU nodes; dp 2, min_dp 1 for all three), the fault after
step 12. Time lost = (the fault to the last step) - (the reference's same steps).

    python benchmarks/recovery_continue.py      # the quick-start GPT's size, about 15 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton.data.corpus import prepare_stdlib  # noqa: E402
from recovery import FAULT_AFTER_STEP, run_baton, set_worker_nodes, start_cluster  # noqa: E402
from results_io import write_result  # noqa: E402

SYSTEMS = ("none", "replace", "continue")


def run(cluster, args, tmp: str, system: str, fault: str) -> dict:
    steps: list[tuple[int, float]] = []  # (step, when it completed), in the order seen
    out = run_baton(cluster, args, tmp, "none" if system == "none" else fault,
                    recovery="continue" if system == "continue" else "replace",
                    on_step=lambda c: steps.append((c.step, time.time())))
    out["steps"] = steps
    return out


def lost(out: dict, ref: dict) -> float:
    """From the fault to the last step, less the reference's time from the same step to its
    last: the fault is injected right as step FAULT_AFTER_STEP completes."""
    at = next(t for step, t in ref["steps"] if step == FAULT_AFTER_STEP)
    return (out["steps"][-1][1] - out["fault_at"]) - (ref["steps"][-1][1] - at)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--faults", default="kill,node")
    p.add_argument("--out", default="benchmarks/results/recovery_continue_cpu.json")
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="baton-bench-continue-")
    os.environ.setdefault("RAY_TMPDIR", f"{tmp}/ray")
    prepare_stdlib(f"{tmp}/data", args.seq_len)
    cluster = start_cluster(HERE)
    runs: dict = {f: {s: [] for s in SYSTEMS} for f in args.faults.split(",")}
    try:
        for r in range(args.rounds):
            for fault, by in runs.items():
                order = SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]
                for system in order:
                    set_worker_nodes(cluster, 3)
                    by[system].append(run(cluster, args, tmp, system, fault))
                ref = by["none"][-1]
                for system in SYSTEMS[1:]:
                    out = by[system][-1]
                    out["lost_s"] = lost(out, ref)
                    back = [step for step, dp in out["dp_history"][1:] if dp == 2]
                    out["grown_back_at_step"] = back[0] if back else None
                    print(f"round {r + 1}: {fault:4s} {system:8s} recovery {out['recovery_s']:5.2f} s, "
                          f"time lost {out['lost_s']:5.2f} s, dp {out['dp_history']}", flush=True)
                print(f"round {r + 1}: {fault:4s} none     steps {FAULT_AFTER_STEP}-{args.steps} in "
                      f"{ref['steps'][-1][1] - dict(ref['steps'])[FAULT_AFTER_STEP]:.2f} s", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    print(f"\n{'fault':6s} {'recovery':9s} {'recovery s':>11s} {'time lost s':>12s} {'each round':>18s}")
    summary: dict = {}
    for fault, by in runs.items():
        for system in SYSTEMS[1:]:
            outs = by[system]
            summary.setdefault(fault, {})[system] = {
                "recovery_s_median": statistics.median(o["recovery_s"] for o in outs),
                "lost_s_median": statistics.median(o["lost_s"] for o in outs)}
            each = ", ".join(f"{o['lost_s']:.2f}" for o in outs)
            print(f"{fault:6s} {system:9s} {summary[fault][system]['recovery_s_median']:>11.2f} "
                  f"{summary[fault][system]['lost_s_median']:>12.2f} {each:>18s}")
    for by in runs.values():  # the steps' times made lost_s; the file keeps what they gave
        for outs in by.values():
            for o in outs:
                o["last_step_s"] = round(o["steps"][-1][1] - o.pop("steps")[0][1], 3)
    write_result(args.out, {"config": vars(args), "ray": ray.__version__, "torch": torch.__version__,
                            "fault_after_step": FAULT_AFTER_STEP, "runs": runs, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
