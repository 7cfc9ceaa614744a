"""Compiled steps (`train.compile`) against eager: tokens/s, and what compiling costs at the
start of a run on a cold and on a warm Inductor cache (a recovery or rescale starts its new
workers on a warm one: the same node's cache folder).

Real runs of `baton.api.run` on a local Ray (gloo on CPU, NCCL with `--device cuda`), the
quick-start model on the built-in corpus. In one Ray session with its own empty
TORCHINDUCTOR_CACHE_DIR: a first compiled run (cold: every graph generated and built), then
rounds of eager and compiled runs in rotating order (warm: the cache is filled). Reported per
run: the median tokens/s over the second half of its steps, and the start's compile phase (the
slowest worker's compile time, from torch's counters). The ratio is the median of each round's
compiled/eager, measured back to back (this machine is shared and noisy).

    python benchmarks/compile.py                         # CPU, dp 2, 3 rounds
    python benchmarks/compile.py --device cuda --dp 1 --width 768 --layers 12 --seq-len 1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.models.flops import job_peak_flops, model_flops_per_token  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from results_io import write_result  # noqa: E402


def run(args, data: str, tmp: str, compiled: bool) -> dict:
    cuda = args.device == "cuda"
    spec = spec_from_dict({
        "name": f"bench-compile-{'on' if compiled else 'off'}",
        "model": {"name": "gpt", "layers": args.layers, "width": args.width, "heads": args.heads,
                  "seq_len": args.seq_len},
        "data": {"source": "parquet", "path": data},
        "train": {"steps": args.steps, "global_batch": args.global_batch,
                  "micro_batch": args.micro_batch, "compile": compiled,
                  "precision": "bf16" if cuda else "fp32"},
        "parallel": {"dp": args.dp},
        "resources": {"cpus_per_worker": 1 if cuda else 0.5, "gpus_per_worker": 1 if cuda else 0},
        "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10**9},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-compile"}})
    result = api.run(spec, show_progress=False, log=lambda _: None)
    phases = result.start["phases_s"]
    # model FLOPs a second over the workers' summed peak, as the run's own mfu metric (GPUs)
    peak = job_peak_flops([w.get("device_name", "cpu") for w in result.workers],
                          spec.train.precision, None)
    return {"compile": compiled, "tokens_per_s": round(result.tokens_per_s, 1),
            "compile_s": phases.get("compile", 0.0), "start_s": round(sum(phases.values()), 2),
            "loss": round(result.loss, 4),
            "mfu": round(result.tokens_per_s * model_flops_per_token(spec.model) / peak, 4) if peak else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = args.out or str(HERE / "results" / f"compile_{args.device}.json")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{tmp}/inductor"  # empty: the first run is cold
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, args.seq_len)
        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 **({} if args.device == "cuda" else {"num_cpus": 2}))
        ray.data.DataContext.get_current().enable_progress_bars = False

        def one(compiled: bool, cache: str) -> dict:
            with tempfile.TemporaryDirectory(dir=tmp) as run_tmp:
                row = {**run(args, data, run_tmp, compiled), "cache": cache}
            rows.append(row)
            print(f"  {'compiled' if compiled else 'eager':<8} ({cache:<4} cache): "
                  f"{row['tokens_per_s']:>9,.0f} tokens/s, compile {row['compile_s']:5.1f} s, "
                  f"start {row['start_s']:5.1f} s, loss {row['loss']}"
                  + (f", MFU {row['mfu']:.1%}" if row["mfu"] else ""), flush=True)
            return row

        one(True, "cold")
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {c: one(c, "warm") for c in order}
            ratios.append(got[True]["tokens_per_s"] / got[False]["tokens_per_s"])
        ray.shutdown()
    cold = rows[0]["compile_s"]
    warm = statistics.median(r["compile_s"] for r in rows[1:] if r["compile"])
    ratio = statistics.median(ratios)
    print(f"\n| {args.device}, dp {args.dp}, GPT {args.layers} x {args.width}, seq {args.seq_len} "
          f"| value |\n|---|---:|\n| compiled / eager tokens/s (median of {args.rounds} rounds) "
          f"| {ratio:.2f}x |\n| compile at start, cold cache | {cold:.1f} s |\n"
          f"| compile at start, warm cache | {warm:.1f} s |")
    write_result(out, {"device": args.device, "dp": args.dp, "model": {
        "layers": args.layers, "width": args.width, "seq_len": args.seq_len},
        "ratio_compiled_over_eager": round(ratio, 3), "round_ratios": [round(x, 3) for x in ratios],
        "compile_s_cold": cold, "compile_s_warm": warm, "runs": rows})


if __name__ == "__main__":
    main()
