"""Sharding (ZeRO-1/2/3 on FSDP2) against DDP: memory per worker, throughput, and the largest
GPT that trains when each worker may hold at most a fixed budget of model state.

Every figure comes from real runs of `baton.api.run` on a local Ray with gloo (CPU) or NCCL
(`--device cuda`):
  - state bytes: parameters, gradients and optimizer state each worker holds, read from its
    live tensors (local shards) at the last step (`RunResult.state_bytes`);
  - RSS: each worker process's resident memory, sampled after every step (/proc);
  - tokens/s: the median over the second half of the run's steps.
Table 1 runs the same GPT at each level and dp; ratios of tokens/s are against DDP at the same
dp, measured back to back in one process, in rounds whose order rotates, as the median of
each round's ratio (this machine is shared and noisy).
Table 2 walks a ladder of GPT widths and, for each level at dp `--budget-dp`, trains the widest
whose predicted state fits `--budget-mib` per worker for a few steps, and reports what the
workers measured (a prediction that the measurement contradicts fails the script).

    python benchmarks/sharding.py                      # CPU: dp 1, 2, 4; budget 16 MiB at dp 4
    python benchmarks/sharding.py --dps 2 4 --levels none full --unit-mibs 0 16 --skip-budget
                                   # FSDP units: each block alone (0) against blocks grouped to 16 MiB
    python benchmarks/sharding.py --pps 1 2 --dps 2 --levels none grads full --skip-budget
                                   # the same levels inside 2 pipeline stages, side by side
    python benchmarks/sharding.py --device cuda --dps 1 --budget-dp 1
                                   # one GPU: each level as a world of one (FSDP2's own cost,
                                   # nothing to communicate); table 2 needs dp 2 or more
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray

from baton import api
from baton.data.corpus import prepare_stdlib
from baton.models import layer_params
from baton.parallel.sharding import NAMES, estimate_bytes
from baton.spec import spec_from_dict
from results_io import write_result

LEVELS = ("none", "optimizer", "grads", "full")


def job(args, data: str, tmp: str, *, dp: int, level: str, width: int, layers: int,
        steps: int, unit_mib: float | None = None, pp: int = 1) -> dict:
    cuda = args.device == "cuda"
    return {
        "name": f"bench-shard-{level}-{pp}x{dp}-{width}",
        "model": {"name": "gpt", "layers": layers, "width": width, "heads": 4,
                  "seq_len": args.seq_len},
        "data": {"source": "parquet", "path": data},
        "train": {"steps": steps, "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                  "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 2,
                  "precision": "bf16" if cuda else "fp32"},
        "parallel": {"dp": dp, "pp": pp, "shard": level,
                     **({"shard_unit_mib": unit_mib} if unit_mib is not None else {})},
        # a shard level on a world of one (one GPU) is a job that may grow to two
        **({"elastic": {"min_dp": 1, "max_dp": 2}} if dp == 1 and level != "none" else {}),
        "resources": {"cpus_per_worker": 0.01 if not cuda else 1, "gpus_per_worker": 1 if cuda else 0,
                      "threads_per_worker": args.threads},
        "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10_000, "keep": 1},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-sharding"},
    }


def _rss_bytes(pid: int) -> int:
    """A local process's resident memory (the workers of a local Ray run on this machine)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def measure(spec) -> dict:
    """Run `spec` to the end: the largest worker's state and resident memory, tokens/s, the
    wall time and the model's parameters (benchmarks/tensor_parallel.py uses it too)."""
    rss: dict[int, int] = {}

    def sample(c) -> None:
        for w in c.workers:
            rss[w["pid"]] = max(rss.get(w["pid"], 0), _rss_bytes(w["pid"]))
    t0 = time.perf_counter()
    result = api.run(spec, show_progress=False, on_step=sample)
    assert result.state == "finished", result.state
    state = max(result.state_bytes, key=lambda b: sum(b.values()))
    return {"params": sum(layer_params(spec.model)),
            "state_mib": {k: round(v / 2**20, 3) for k, v in state.items()},
            "state_total_mib": round(sum(state.values()) / 2**20, 3),
            "rss_mib": round(max(rss.values()) / 2**20, 1) if rss else None,
            "tokens_per_s": round(result.tokens_per_s, 1), "wall_s": round(time.perf_counter() - t0, 1)}


def run(args, data: str, *, dp: int, level: str, width: int, layers: int, steps: int,
        unit_mib: float | None = None, pp: int = 1) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_from_dict(job(args, data, tmp, dp=dp, level=level, width=width,
                                  layers=layers, steps=steps, unit_mib=unit_mib, pp=pp))
        return {"level": level, "pp": pp, "dp": dp, "width": width, "layers": layers,
                "unit_mib": spec.parallel.shard_unit_mib if level in ("grads", "full") else None,
                **measure(spec)}


def memory_and_speed(args, data: str) -> list[dict]:
    """Each round runs every level at each (pp, dp) back to back, in an order that rotates from
    round to round; a ratio is the median over rounds of that round's ratio to DDP at the same
    layout (paired). With pp > 1 the levels are those that compose with pipelines: DDP inside
    the stages, ZeRO-2 and ZeRO-3 in each stage."""
    runs: dict[tuple[str, float | None, int, int], list[dict]] = {}
    variants = [("none", None)] + [(level, unit) for level in args.levels if level != "none"
                                   for unit in (args.unit_mibs if level in ("grads", "full") else [None])]
    for r in range(args.rounds):
        for pp in args.pps:
            for dp in args.dps:
                # dp 1 on one GPU: each level as a world of one, FSDP2's own cost with nothing
                # to communicate (on a CPU, dp 2 and 4 show more: DDP alone there)
                alone = dp == 1 and args.device == "cuda" and args.dps == [1]
                order = [v for v in variants if pp == 1 or v[0] != "optimizer"] if dp > 1 or alone else variants[:1]
                for level, unit in order[r % len(order):] + order[:r % len(order)]:
                    row = run(args, data, dp=dp, level=level, width=args.width, layers=args.layers,
                              steps=args.steps, unit_mib=unit, pp=pp)
                    runs.setdefault((level, unit, pp, dp), []).append(row)
                    print(f"  round {r + 1}: {level:9s} {'' if unit is None else f'unit {unit:g} MiB':13s} "
                          f"pp={pp} dp={dp}: state {row['state_total_mib']:8.2f} MiB/worker, RSS "
                          f"{row['rss_mib']} MiB, {row['tokens_per_s']:9.1f} tokens/s", flush=True)
    rows = []
    for (level, unit, pp, dp), rs in runs.items():
        ddp = runs[("none", None, pp, dp)]
        rows.append({**rs[-1], "rss_mib": max(x["rss_mib"] or 0 for x in rs),
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
                     "tokens_per_s_rounds": [x["tokens_per_s"] for x in rs],
                     "state_vs_ddp": round(rs[-1]["state_total_mib"] / ddp[-1]["state_total_mib"], 3),
                     "tokens_per_s_vs_ddp": round(statistics.median(
                         x["tokens_per_s"] / d["tokens_per_s"] for x, d in zip(rs, ddp)), 3)})
    return rows


def largest_under_budget(args, data: str) -> list[dict]:
    budget = args.budget_mib * 2**20
    rows = []
    for level in LEVELS:
        fits = []
        for width in args.widths:
            spec = spec_from_dict(job(args, data, "/tmp", dp=args.budget_dp, level=level,
                                      width=width, layers=args.layers, steps=2))
            predicted = sum(estimate_bytes(sum(layer_params(spec.model)), level,
                                           args.budget_dp if level != "none" else 1).values())
            if predicted <= budget:
                fits.append(width)
        if not fits:
            rows.append({"level": level, "width": None})
            continue
        row = run(args, data, dp=args.budget_dp, level=level, width=fits[-1], layers=args.layers,
                  steps=args.budget_steps)
        measured = row["state_total_mib"] * 2**20
        # the bound is the prediction plus what FSDP's uneven split may add (a few rows)
        assert measured <= budget * 1.02, f"{level}: measured {measured} > budget {budget}"
        rows.append(row)
        print(f"  {level:9s}: widest GPT under {args.budget_mib} MiB at dp {args.budget_dp}: "
              f"width {row['width']} ({row['params'] / 1e6:.2f} M params), measured "
              f"{row['state_total_mib']:.2f} MiB/worker", flush=True)
    ddp = rows[0]["params"]
    for row in rows:
        if row.get("params"):
            row["params_vs_ddp"] = round(row["params"] / ddp, 2)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--pps", type=int, nargs="+", default=[1],
                   help="pipeline stages: each level (DDP, ZeRO-2, ZeRO-3) inside pp stages too")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--budget-mib", type=float, default=16.0)
    p.add_argument("--budget-dp", type=int, default=4)
    p.add_argument("--budget-steps", type=int, default=3)
    p.add_argument("--widths", type=int, nargs="+", default=[128, 192, 256, 320, 384, 448, 512])
    p.add_argument("--out", default=None)
    p.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    p.add_argument("--unit-mibs", type=float, nargs="+", default=[16.0],
                   help="parallel.shard_unit_mib for grads and full, each run side by side")
    p.add_argument("--skip-budget", action="store_true", help="table 1 only")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, args.seq_len)
        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 **({"num_cpus": 2} if args.device == "cpu" else {}))
        ray.data.DataContext.get_current().enable_progress_bars = False
        print(f"table 1: GPT {args.layers} x {args.width}, seq {args.seq_len}, global batch "
              f"{args.global_batch}, {args.steps} steps ({args.device})")
        table = memory_and_speed(args, data)
        budget = []
        if args.budget_dp < 2 and not args.skip_budget:  # one GPU: nothing to split state across
            print(f"table 2 skipped: sharding needs dp 2 or more (--budget-dp {args.budget_dp})")
        elif not args.skip_budget:
            print(f"table 2: the widest GPT ({args.layers} layers) whose state fits "
                  f"{args.budget_mib} MiB per worker at dp {args.budget_dp}")
            budget = largest_under_budget(args, data)
        ray.shutdown()

    print("\n| level | unit MiB | pp | dp | state MiB/worker | vs DDP | RSS MiB | tokens/s | vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table:
        unit = "" if r["unit_mib"] is None else f"{r['unit_mib']:g}"
        print(f"| {r['level']} ({NAMES[r['level']]}) | {unit} | {r['pp']} | {r['dp']} | {r['state_total_mib']:.2f} | "
              # tokens/s: the median over rounds
              f"{r['state_vs_ddp']:.2f}x | {r['rss_mib']} | {r['tokens_per_s']:.0f} | "
              f"{r['tokens_per_s_vs_ddp']:.2f}x |")
    print(f"\n| level | widest under {args.budget_mib:g} MiB at dp {args.budget_dp} | params | vs DDP | measured MiB/worker |")
    print("|---|---|---|---|---|")
    for r in budget:
        if r.get("width"):
            print(f"| {r['level']} | {r['width']} | {r['params'] / 1e6:.2f} M | "
                  f"{r['params_vs_ddp']:.2f}x | {r['state_total_mib']:.2f} |")
    write_result(args.out or Path(__file__).parent / "results" / f"sharding_{args.device}.json",
                 {"args": vars(args), "table": table, "budget": budget,
                  "python": sys.version.split()[0]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
