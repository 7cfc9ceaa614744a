"""Runs one after another from one driver, with and without `resources.keep_warm_s`.

A sweep or a notebook calls `baton.api.run` again and again on one Ray. Each round here runs
the same short job twice in a row from this process, on an embedded 2-CPU Ray: once with new
workers each time (keep_warm_s 0) and once with the first run's workers kept warm for the
second (keep_warm_s 60), alternating which goes first. Timed: the second run, from `api.run`
to its return (a few steps of a 2-worker DDP GPT), and the CPU seconds of every process on the
machine meanwhile (the system's, from /proc/stat: the new processes' imports are most of it).

    python benchmarks/warm.py --rounds 3
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from baton.workers import warm  # noqa: E402
from results_io import write_result  # noqa: E402


def cpu_seconds() -> float:
    """CPU time used by the whole machine so far (user + nice + system), in seconds."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2]) / os.sysconf("SC_CLK_TCK")


def job(tmp: str, name: str, keep_warm_s: float, steps: int) -> dict:
    return {
        "name": name,
        "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 4, "seq_len": 64},
        "data": {"source": "parquet", "path": f"{tmp}/data"},
        "train": {"steps": steps, "global_batch": 16, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "parallel": {"dp": 2, "timeout_s": 60},
        "resources": {"cpus_per_worker": 0.5, "keep_warm_s": keep_warm_s},
        "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": steps, "keep": 1},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-warm"},
    }


def second_run(tmp: str, keep_warm_s: float, steps: int) -> dict:
    """Two runs in a row; the second's wall and machine CPU seconds, and its workers' pids
    against the first's."""
    pids = []
    for k in range(2):
        spec = spec_from_dict(job(tmp, f"warm-{keep_warm_s:g}-{time.time_ns()}", keep_warm_s, steps))
        t0, c0 = time.monotonic(), cpu_seconds()
        result = api.run(spec, show_progress=False)
        wall, cpu = time.monotonic() - t0, cpu_seconds() - c0
        assert result.state == "finished", result.state
        pids.append({w["pid"] for w in result.workers})
    warm.drain()
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "same_processes": pids[0] == pids[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(HERE / "results" / "warm_cpu.json"))
    args = parser.parse_args()

    tmp = tempfile.mkdtemp(prefix="baton-bench-warm-")
    prepare_stdlib(f"{tmp}/data", 64)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows = {"new workers": [], "kept warm": []}
    for r in range(args.rounds):
        order = [("new workers", 0.0), ("kept warm", 60.0)]
        for label, keep in (order if r % 2 == 0 else order[::-1]):
            rows[label].append(second_run(tmp, keep, args.steps))
            print(f"round {r + 1} {label:12s} {rows[label][-1]}", flush=True)
    ray.shutdown()

    print(f"\nthe second of two {args.steps}-step runs of a 2-worker DDP GPT, from api.run to its return")
    print(f"{'':14s}{'wall (median)':>15s}{'machine CPU (median)':>22s}  same processes")
    med = {}
    for label, runs in rows.items():
        med[label] = (statistics.median(x["wall_s"] for x in runs), statistics.median(x["cpu_s"] for x in runs))
        print(f"{label:14s}{med[label][0]:>13.2f} s{med[label][1]:>20.2f} s  "
              f"{[x['same_processes'] for x in runs]}")
    ratio = med["kept warm"][0] / med["new workers"][0]
    print(f"kept warm / new workers, wall: {ratio:.2f}")
    write_result(args.out, {"rounds": rows, "median_wall_s": {k: v[0] for k, v in med.items()},
                            "median_cpu_s": {k: v[1] for k, v in med.items()},
                            "wall_ratio": round(ratio, 3), "steps": args.steps})


if __name__ == "__main__":
    main()
