"""Where a data-parallel step's CPU goes: per process (the driver, each worker, each of Ray's
services) and per thread of the driver and of one worker, in milliseconds of CPU a step.

One real `baton.api.run` (the dp_throughput model: GPT 4 x 128, seq 128, global batch 32 in
micro-batches of 8, dp 2 on gloo) on a local Ray of 2 CPUs; each process's and thread's CPU
time (user + system, from /proc) is read at the end of step 21 and of the last step, and the
difference divided by the steps between. On a machine of 2 cores every millisecond a step
that is not a worker's is one the workers wait for.

    python benchmarks/step_cpu.py --steps 150
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import ray

from baton import api
from baton.data.corpus import prepare_stdlib
from baton.spec import spec_from_dict
from results_io import write_result


def _threads(pid: int, tag: str) -> dict:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                st = f.read()
        except OSError:  # ended meanwhile
            continue
        fields = st[st.rindex(")") + 2:].split()
        out[f"{tag}/{tid}"] = (st[st.index("(") + 1:st.rindex(")")],
                               (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def snapshot() -> tuple[dict, dict]:
    """(pid -> (kind, CPU s)) for this process and all it started; (thread -> (name, CPU s))
    for the driver and the first worker."""
    root = psutil.Process(os.getpid())
    procs = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = p.cmdline()
            script = next((Path(a).name for a in cmd if a.endswith(".py")), None)
            kind = ("driver" if p.pid == root.pid else "worker" if cmd[:1] and cmd[0].startswith("ray::Worker")
                    else script or (Path(cmd[0]).name if cmd else "?"))
            t = p.cpu_times()
        except psutil.Error:
            continue
        procs[p.pid] = (kind, t.user + t.system)
    workers = sorted(pid for pid, (kind, _) in procs.items() if kind == "worker")
    threads = _threads(root.pid, "driver") | (_threads(workers[0], "worker") if workers else {})
    return procs, threads


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "step_cpu_cpu.json"))
    args = p.parse_args()
    first = 21
    with tempfile.TemporaryDirectory() as tmp:
        prepare_stdlib(f"{tmp}/data", 128)
        ray.init(address="local", include_dashboard=False, logging_level="ERROR", num_cpus=2)
        spec = spec_from_dict({
            "name": "step-cpu",
            "model": {"name": "gpt", "layers": 4, "width": 128, "heads": 4, "seq_len": 128},
            "data": {"source": "parquet", "path": f"{tmp}/data"},
            "train": {"steps": args.steps, "global_batch": 32, "micro_batch": 8, "lr": 1e-3},
            "parallel": {"dp": 2}, "resources": {"cpus_per_worker": 0.01},
            "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10**6},
            "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "step-cpu"}})
        marks, seen = [], [0]

        def on_step(_) -> None:
            seen[0] += 1
            if seen[0] in (first, args.steps):
                marks.append((seen[0], time.perf_counter(), snapshot()))
        api.run(spec, show_progress=False, on_step=on_step)
        ray.shutdown()
    (s0, t0, (p0, th0)), (s1, t1, (p1, th1)) = marks
    n = s1 - s0
    per = {"wall_ms": 1000 * (t1 - t0) / n, "processes": [], "threads": []}
    for pid, (kind, cpu) in p1.items():
        per["processes"].append({"pid": pid, "kind": kind, "ms": 1000 * (cpu - p0.get(pid, (kind, 0.0))[1]) / n})
    for key, (name, cpu) in th1.items():
        per["threads"].append({"thread": f"{key.split('/')[0]} {name}",
                               "ms": 1000 * (cpu - th0.get(key, (name, 0.0))[1]) / n})
    print(f"{n} steps (from step {first}), {per['wall_ms']:.1f} ms a step; CPU ms a step:")
    print("| process | CPU ms a step |\n|---|---:|")
    for r in sorted(per["processes"], key=lambda r: -r["ms"]):
        if r["ms"] >= 0.05:
            print(f"| {r['kind']} | {r['ms']:.2f} |")
    print("\n| thread | CPU ms a step |\n|---|---:|")
    for r in sorted(per["threads"], key=lambda r: -r["ms"]):
        if r["ms"] >= 0.1:
            print(f"| {r['thread']} | {r['ms']:.2f} |")
    write_result(args.out, {"steps": args.steps, "from_step": first, **per})
    return 0


if __name__ == "__main__":
    sys.exit(main())
