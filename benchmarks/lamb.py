"""LAMB against AdamW as the global batch grows: the quick-start model at 1x, 4x and 8x its
global batch of 32, each optimizer's learning rate scaled linearly with the batch (what
`batch_policy: scale_lr` does as replicas join), loss compared at equal samples seen.

Real runs of `baton.api.run` (dp 2, gloo, CPU) on the built-in corpus. Reported per run: the
mean training loss over the last tenth of the samples (the loss is each step's own batch's:
at equal samples, larger batches have taken fewer, larger steps), and whether it diverged.

    python benchmarks/lamb.py                       # 1x, 4x, 8x; 32,000 samples each
    python benchmarks/lamb.py --samples 16000 --scales 1 4
"""

from __future__ import annotations

import argparse
import math
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
from results_io import write_result  # noqa: E402

BASE_BATCH, BASE_LR = 32, 3e-3  # the quick-start job's


def run(data: str, tmp: str, optimizer: str, scale: int, samples: int) -> dict:
    batch = BASE_BATCH * scale
    steps = samples // batch
    spec = spec_from_dict({
        "name": f"lamb-{optimizer}-{scale}x",
        "model": {"name": "gpt", "layers": 4, "width": 128, "heads": 4, "seq_len": 128},
        "data": {"source": "parquet", "path": data},
        "train": {"steps": steps, "global_batch": batch, "micro_batch": 8,
                  "lr": BASE_LR * scale, "min_lr": BASE_LR * scale / 10,
                  "warmup_steps": max(1, steps // 20), "optimizer": optimizer, "seed": 0},
        "parallel": {"dp": 2}, "resources": {"cpus_per_worker": 1},
        "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10**9},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-lamb"}})
    t0 = time.perf_counter()
    try:
        result = api.run(spec, show_progress=False, log=lambda _: None)
        losses = [v for _, v in result.history("loss")]
        tail = losses[-max(1, len(losses) // 10):]
        final = sum(tail) / len(tail)
    except Exception as e:  # a NaN loss stops a run: that is the result
        final = float("nan")
        print(f"  {optimizer} {scale}x: {type(e).__name__}: {str(e)[:100]}")
    return {"optimizer": optimizer, "scale": scale, "global_batch": batch, "steps": steps,
            "lr": BASE_LR * scale, "final_loss": round(final, 4) if math.isfinite(final) else None,
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32_000)
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--out", default=str(HERE / "results" / "lamb_cpu.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, 128)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        ray.data.DataContext.get_current().enable_progress_bars = False
        for scale in args.scales:
            for optimizer in ("adamw", "lamb"):
                with tempfile.TemporaryDirectory(dir=tmp) as run_tmp:
                    row = run(data, run_tmp, optimizer, scale, args.samples)
                rows.append(row)
                print(f"{optimizer:<6} {scale}x (batch {row['global_batch']}, lr {row['lr']:g}, "
                      f"{row['steps']} steps): loss {row['final_loss']} ({row['wall_s']} s)", flush=True)
        ray.shutdown()
    print(f"\n{'batch':>6} {'adamw':>8} {'lamb':>8}   (mean loss, last tenth of {args.samples:,} samples)")
    for scale in args.scales:
        a, b = [r["final_loss"] for r in rows if r["scale"] == scale]
        print(f"{BASE_BATCH * scale:>6} {str(a):>8} {str(b):>8}")
    write_result(args.out, {"samples": args.samples, "base_batch": BASE_BATCH, "base_lr": BASE_LR,
                            "rows": rows})


if __name__ == "__main__":
    main()
