"""A recovery while the data feed has a Ray Data read in flight: the fault tests' scenario.

The cluster is the fault tests' (`ray.cluster_utils.Cluster`: a head with no CPUs and three
one-CPU worker nodes), and so is the job: the tests' small GPT at dp 2 on 40 samples of stdlib
text, batches of 8, a checkpoint every 2 steps, 8 steps. The corpus is one shuffle block, so
an epoch is 5 steps: the driver reads the first block itself, and the next epoch's first block
goes through Ray Data from the first step on. A head with no CPUs keeps no idle task worker,
so each read starts a read worker (a process importing Ray Data: seconds on a busy machine).
Each round runs the job twice, uninterrupted and with worker rank 1 SIGKILLed after step 3,
which lands while that read is starting.

Reported per round: the recovery's phases (from the run's recovery event), and each run's
time from `api.run` to its return. Compare two checkouts by running this once with each
first on PYTHONPATH (the workers get it too), one after the other:

    PYTHONPATH=/tmp/before/platform python benchmarks/recovery_read.py --rounds 3 --out before.json
    python benchmarks/recovery_read.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))

from baton import api  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from helpers import tiny_spec, write_dataset  # noqa: E402
from recovery import start_cluster  # noqa: E402
from results_io import write_result  # noqa: E402

SAMPLES, STEPS, KILL_AFTER = 40, 8, 3


def run(tmp: Path, data: Path, name: str, kill: bool) -> dict:
    raw = tiny_spec(tmp / name, data, name=name,
                    train={"steps": STEPS, "global_batch": 8, "micro_batch": None},
                    parallel={"dp": 2, "timeout_s": 30}, resources={"cpus_per_worker": 1},
                    checkpoint={"every_steps": 2, "keep": 10},
                    elastic={"max_failures": 3, "hang_timeout_s": 4, "rescale_check_s": 1})
    (tmp / name).mkdir(parents=True)

    def hook(coordinator):
        if kill and coordinator.step == KILL_AFTER and not coordinator.failures.seen:
            os.kill(coordinator.workers[1]["pid"], signal.SIGKILL)
    began = time.monotonic()
    result = api.run(spec_from_dict(raw), show_progress=False, log=lambda _: None, on_step=hook)
    out = {"run_s": round(time.monotonic() - began, 2), "start": result.start}
    recoveries = [e for e in result.events if e["kind"] == "recovery"]
    assert result.step == STEPS and len(recoveries) == int(kill), result.events
    if kill:
        out["recovery"] = {"total_s": recoveries[0]["total_s"], "phases_s": recoveries[0]["phases_s"]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(HERE / "results" / "recovery_read_cpu.json"))
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="baton-rr-"))
    os.environ.setdefault("RAY_TMPDIR", f"{tmp}/ray")
    data = write_dataset(tmp / "data", SAMPLES, 32)
    cluster = start_cluster(TESTS, logging_level="ERROR")  # recovery.py's cluster
    rounds = []
    try:
        for r in range(args.rounds):
            plain = run(tmp, data, f"plain-{r}", kill=False)
            killed = run(tmp, data, f"killed-{r}", kill=True)
            rounds.append({"uninterrupted": plain, "killed": killed})
            phases = killed["recovery"]["phases_s"]
            print(f"round {r + 1}: uninterrupted {plain['run_s']:.1f} s; killed {killed['run_s']:.1f} s, "
                  f"recovery {killed['recovery']['total_s']:.2f} s, phases {phases}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    def median(values):
        return round(statistics.median(values), 3)
    phases = rounds[0]["killed"]["recovery"]["phases_s"]
    summary = {"uninterrupted_run_s": median(r["uninterrupted"]["run_s"] for r in rounds),
               "killed_run_s": median(r["killed"]["run_s"] for r in rounds),
               "recovery_s": median(r["killed"]["recovery"]["total_s"] for r in rounds),
               "phases_s": {k: median(r["killed"]["recovery"]["phases_s"][k] for r in rounds)
                            for k in phases}}
    print(f"\n{'medians of ' + str(args.rounds) + ' rounds':28s} {'seconds':>8s}")
    for key in ("uninterrupted_run_s", "killed_run_s", "recovery_s"):
        print(f"{key:28s} {summary[key]:8.2f}")
    for key, value in summary["phases_s"].items():
        print(f"  recovery {key:19s} {value:8.2f}")
    write_result(args.out, {"config": vars(args), "ray": ray.__version__, "rounds": rounds,
                            "summary": summary, "pythonpath": os.environ.get("PYTHONPATH")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
