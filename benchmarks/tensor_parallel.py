"""Tensor parallelism against data parallelism on the same workers: what each worker holds and
how fast the job trains, for one GPT and one global batch at each (dp, tp) with dp x tp =
`--workers`, unsharded and under each of `--shard`'s levels (FSDP2 over the dp workers that
hold one share: with tp > 1, 2D parallelism), and the smallest tp > 1 with sequence
parallelism (`sp`).

Every figure comes from real runs of `baton.api.run` on a local Ray with gloo (CPU) or NCCL
(`--device cuda`):
  - state bytes: parameters, gradients and optimizer state each worker holds, read from its
    live tensors at the last step (`RunResult.state_bytes`);
  - RSS: each worker process's resident memory, sampled after every step (/proc);
  - tokens/s: the run's median over the second half of its steps.
The layouts run back to back in rounds whose order rotates; a ratio is the median over rounds
of that round's ratio to tp 1 (this machine is shared and noisy).

    python benchmarks/tensor_parallel.py                 # CPU: 4 workers: dp 4, dp 2 x tp 2, tp 4,
                                                         # dp 4 and dp 2 x tp 2 under ZeRO-3,
                                                         # dp 2 x tp 2 sp
    python benchmarks/tensor_parallel.py --device cuda --workers 2 --width 1024 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import ray

from baton.data.corpus import prepare_stdlib
from baton.spec import spec_from_dict
from results_io import write_result
from sharding import measure


def run(args, data: str, dp: int, tp: int, shard: str, sp: bool) -> dict:
    cuda = args.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_from_dict({
            "name": f"bench-tp-{dp}x{tp}-{shard}{'-sp' if sp else ''}",
            "model": {"name": "gpt", "layers": args.layers, "width": args.width,
                      "heads": args.heads, "seq_len": args.seq_len},
            "data": {"source": "parquet", "path": data},
            "train": {"steps": args.steps, "global_batch": args.global_batch,
                      "micro_batch": args.micro_batch, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 2, "precision": "bf16" if cuda else "fp32",
                      "compile": False},
            "parallel": {"dp": dp, "tp": tp, "shard": shard, "sequence_parallel": sp},
            "resources": {"cpus_per_worker": 1 if cuda else 0.01, "gpus_per_worker": 1 if cuda else 0,
                          "threads_per_worker": args.threads},
            "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10_000, "keep": 1},
            "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-tp"}})
        return {"dp": dp, "tp": tp, "shard": shard, "sequence_parallel": sp, **measure(spec)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shard", default="full",
                   help="sharding levels to run besides none, comma-separated (grads, full; '' for none)")
    p.add_argument("--sequence-parallel", type=int, default=1,
                   help="also run the smallest tp > 1 with parallel.sequence_parallel (0: not)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tps = [tp for tp in (1, 2, 4, 8)
           if args.workers % tp == 0 and args.heads % tp == 0 and tp <= args.workers]
    # sharded: over at least 2 dp workers (dp 1 has nothing to shard over)
    layouts = [(args.workers // tp, tp, "none", False) for tp in tps] + [
        (args.workers // tp, tp, shard, False) for shard in filter(None, args.shard.split(","))
        for tp in tps if args.workers // tp > 1]
    if args.sequence_parallel:  # at the smallest tp > 1
        layouts += [(args.workers // tp, tp, "none", True) for tp in tps[1:2]]

    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, args.seq_len)
        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 **({"num_cpus": 2} if args.device == "cpu" else {}))
        ray.data.DataContext.get_current().enable_progress_bars = False
        print(f"GPT {args.layers} x {args.width} ({args.heads} heads), seq {args.seq_len}, global "
              f"batch {args.global_batch}, {args.steps} steps, {args.workers} workers ({args.device})")
        runs: dict[tuple[int, int, str, bool], list[dict]] = {}
        for r in range(args.rounds):
            for dp, tp, shard, sp in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:
                row = run(args, data, dp, tp, shard, sp)
                runs.setdefault((dp, tp, shard, sp), []).append(row)
                print(f"  round {r + 1}: dp {dp} x tp {tp}{' sp' if sp else ''}, shard {shard}: "
                      f"state {row['state_total_mib']:8.2f} "
                      f"MiB/worker, RSS {row['rss_mib']} MiB, {row['tokens_per_s']:9.1f} tokens/s",
                      flush=True)
        ray.shutdown()
    base = runs[layouts[0]]
    rows = [{**rs[-1], "rss_mib": max(x["rss_mib"] or 0 for x in rs),
             "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rs),
             "tokens_per_s_rounds": [x["tokens_per_s"] for x in rs],
             "state_vs_tp1": round(rs[-1]["state_total_mib"] / base[-1]["state_total_mib"], 3),
             "tokens_per_s_vs_tp1": round(statistics.median(
                 x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(rs, base)), 3)}
            for _, rs in sorted(runs.items(), key=lambda kv: layouts.index(kv[0]))]
    print(f"\n| dp x tp | shard | state MiB/worker | vs dp {args.workers} | peak RSS MiB | tokens/s | vs dp {args.workers} |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['dp']} x {row['tp']}{' sp' if row['sequence_parallel'] else ''} | {row['shard']} "
              f"| {row['state_total_mib']:.2f} | {row['state_vs_tp1']} "
              f"| {row['rss_mib']} | {row['tokens_per_s']:.1f} | {row['tokens_per_s_vs_tp1']} |")
    write_result(args.out or Path(__file__).parent / "results" / f"tensor_parallel_{args.device}.json",
                 {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
