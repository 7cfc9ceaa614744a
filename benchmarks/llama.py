"""The Llama-style model against the GPT on the quick start: the two job files as shipped
(`jobs/quickstart.yaml`, `jobs/llama.yaml`: 4 x 128, the same corpus, batch, schedule and
seed; the llama has 4 query heads on 2 key-value heads and a SwiGLU MLP of 344 units, so
fewer parameters), run in rotating order on one local Ray, and compared by the mean
training loss of their last 50 steps and their median tokens/s.

    python benchmarks/llama.py                  # 500 steps each, 2 rounds
    python benchmarks/llama.py --steps 200 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.models import build_model  # noqa: E402
from baton.spec import load_spec  # noqa: E402
from results_io import median_ratio, rotating, write_result  # noqa: E402

JOBS = {"gpt": HERE.parent / "jobs" / "quickstart.yaml", "llama": HERE.parent / "jobs" / "llama.yaml"}


def run(model: str, data: str, tmp: str, steps: int) -> dict:
    spec = load_spec(JOBS[model], [f"name=bench-{model}", f"train.steps={steps}",
                                   "data.source=parquet", f"data.path={data}",
                                   f"checkpoint.path={tmp}/ckpt", "checkpoint.every_steps=1000000",
                                   f"tracking.uri=sqlite:///{tmp}/mlflow.db"])
    result = api.run(spec, show_progress=False, log=lambda _: None)
    losses = [v for _, v in result.history("loss")]
    speeds = [v for _, v in result.history("tokens_per_s")]
    row = {"model": model, "steps": steps, "loss_last_50": round(sum(losses[-50:]) / len(losses[-50:]), 4),
           "tokens_per_s": round(statistics.median(speeds)),
           "parameters": sum(p.numel() for p in build_model(spec.model, 0).parameters())}
    print(f"{model:<6} {steps} steps: loss (last 50) {row['loss_last_50']}, "
          f"{row['tokens_per_s']:,} tokens/s (median)", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results" / "llama_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, 128)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        ray.data.DataContext.get_current().enable_progress_bars = False

        def measure(model: str) -> dict:
            with tempfile.TemporaryDirectory(dir=tmp) as run_tmp:
                return run(model, data, run_tmp, args.steps)
        runs = rotating(list(JOBS), args.rounds, measure)
        ray.shutdown()
    speed = median_ratio(runs["llama"], runs["gpt"], "tokens_per_s")
    print(f"\n| model | parameters | loss, last 50 of {args.steps} steps (each round) | tokens/s (median of rounds) |")
    print("|---|---:|---|---:|")
    for model, rows in runs.items():
        print(f"| {model} | {rows[0]['parameters']:,} | {', '.join(str(r['loss_last_50']) for r in rows)} | "
              f"{statistics.median(r['tokens_per_s'] for r in rows):,.0f} |")
    print(f"\nllama / gpt tokens/s, median of each round's ratio: {speed:.3f}")
    write_result(args.out, {"steps": args.steps, "rounds": args.rounds, "runs": runs,
                            "llama_over_gpt_tokens_per_s": round(speed, 3)})


if __name__ == "__main__":
    main()
