"""The workers' allocator settings (`baton.workers.host`), measured without Ray.

A baton worker runs its steps on one of its Ray actor's threads, not on the main thread. This
runs the dp_throughput GPT's step (4 x 128, seq 128, 2 micro-batches of 8, fused AdamW, one
torch thread) on a second thread of a fresh process, with glibc's default allocator settings
or with baton's, in rounds of alternating order, and prints per step: the wall time, the
thread's CPU time and its minor page faults (medians over steps, then over rounds).

    python benchmarks/host_memory.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_io import write_result  # noqa: E402

CHILD = """
import json, resource, sys, threading, time, torch
from baton.models import build_model
from baton.spec import ModelSpec, TrainSpec
from baton.tasks import loss_sum
from baton.training import make_optimizer
from baton.workers import host
kept = host.keep_freed_memory() if sys.argv[1] == "baton" else None
steps, warmup = int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
rows = []
def run():
    model = build_model(ModelSpec(name="gpt", layers=4, width=128, heads=4, seq_len=128), 0)
    optimizer = make_optimizer(model, TrainSpec(lr=1e-3))
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(2):
            batch = torch.randint(0, 256, (8, 129), generator=gen)
            loss_sum(model(batch[:, :-1]), batch[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= warmup:
            rows.append((time.perf_counter() - t0, time.thread_time() - c0,
                         resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0))
thread = threading.Thread(target=run)
thread.start()
thread.join()
print(json.dumps({"kept": kept, "rows": rows}))
"""


def measure(mode: str, steps: int, warmup: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(steps), str(warmup)], env=env,
                          capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    wall, cpu, faults = zip(*out["rows"])
    return {"kept": out["kept"], "wall_ms": statistics.median(wall) * 1e3,
            "cpu_ms": statistics.median(cpu) * 1e3, "faults": statistics.median(faults)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/host_memory_cpu.json")
    args = p.parse_args()
    modes = ["glibc", "baton"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes[r % 2:] + modes[:r % 2]:
            runs[mode].append(measure(mode, args.steps, args.warmup))
            m = runs[mode][-1]
            print(f"round {r + 1}: {mode:6s} {m['wall_ms']:7.1f} ms a step, {m['cpu_ms']:7.1f} ms "
                  f"CPU, {m['faults']:7.0f} page faults", flush=True)
    summary = {m: {k: statistics.median(run[k] for run in runs[m])
                   for k in ("wall_ms", "cpu_ms", "faults")} for m in modes}
    paired = statistics.median(b["wall_ms"] / g["wall_ms"] for g, b in zip(runs["glibc"], runs["baton"]))
    print("\n| allocator | step (ms) | thread CPU (ms) | minor page faults a step |\n|---|---:|---:|---:|")
    for m in modes:
        s = summary[m]
        print(f"| {m} | {s['wall_ms']:.1f} | {s['cpu_ms']:.1f} | {s['faults']:.0f} |")
    print(f"\nbaton / glibc step time, median of paired rounds: {paired:.3f}")
    write_result(args.out, {"args": vars(args), "runs": runs, "summary": summary,
                            "baton_vs_glibc_step": paired})
    return 0


if __name__ == "__main__":
    sys.exit(main())
