"""What checkpoints cost a run: synchronous against background (`checkpoint.async`) saves.

Real runs of `baton.api.run` on a local Ray (gloo, CPU, or `--device cuda`), each model three
ways back to back, in an order that rotates from round to round (this machine is shared and
noisy): no checkpoint during the run, a checkpoint every `--every` steps written synchronously,
and the same written in the background. The checkpoints go to a local folder (fsynced) or to
`--store` (any pyarrow URI).

Measured per run, over the steps after `--skip` (warm-up): the time of those steps and their
tokens/s. Per save: the stall, (time of the steps with checkpoints - time without) / saves in
that window, against the median step time (what saves cost the run, the write's competition
for the host included); and how long training itself waited for each save (the metric
`checkpoint_stall_s`: the slowest worker's time in the save call and, in the background, its
optimizer step's wait for the copy); throughput against no checkpoints. Ratios are the
median over rounds of each round's paired ratio. The run's last checkpoint (at its end) is not
in the window for any of them.

    python benchmarks/checkpoint.py                   # quick-start GPT and a 113 M-parameter GPT
    python benchmarks/checkpoint.py --models quickstart --rounds 5
    python benchmarks/checkpoint.py --models quickstart --shard full   # ZeRO-3's shards, through DCP
    python benchmarks/checkpoint.py --device cuda --dp 1 --models gpt-113m --seq-len 1024 \
        --micro-batch 32 --global-batch 64 --steps 160 --every 50 --skip 30 --rounds 1 \
        --modes none async       # a step that keeps a GPU busy (gpu_suite.sh's checkpoint_busy)

The results file is written after every run, marked "complete": false until the last one.
"""

from __future__ import annotations

import argparse
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
from baton.models import layer_params  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from results_io import write_result  # noqa: E402

MODELS = {  # name: (layers, width, heads, micro_batch, global_batch)
    "quickstart": (4, 128, 4, 8, 32),
    "gpt-113m": (16, 768, 12, 1, 2),
}
MODES = ("none", "sync", "async")


def job(args, data: str, tmp: str, model: str, mode: str) -> dict:
    layers, width, heads, micro, batch = MODELS[model]
    micro, batch = args.micro_batch or micro, args.global_batch or batch
    cuda = args.device == "cuda"
    store = args.store.rstrip("/") + f"/{model}-{mode}-{time.time_ns()}" if args.store else f"{tmp}/ckpt"
    return {
        "name": f"bench-ckpt-{model}-{mode}",
        "model": {"name": "gpt", "layers": layers, "width": width, "heads": heads,
                  "seq_len": args.seq_len},
        "data": {"source": "parquet", "path": data},
        "train": {"steps": args.steps, "global_batch": batch, "micro_batch": micro, "lr": 1e-3,
                  "min_lr": 1e-4, "warmup_steps": 2, "precision": "bf16" if cuda else "fp32"},
        "parallel": {"dp": args.dp, "shard": args.shard},
        "resources": {"cpus_per_worker": 1, "gpus_per_worker": 1 if cuda else 0},
        "checkpoint": {"path": store, "keep": 1, "async": mode == "async",
                       "every_steps": args.every if mode != "none" else 10**9},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-checkpoint"},
    }


def run(args, data: str, model: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_from_dict(job(args, data, tmp, model, mode))
        t0 = time.perf_counter()
        waits = []  # checkpoint_stall_s of the steps in the window: training's own wait

        def on_step(c):
            if c.step > args.skip and "checkpoint_stall_s" in c.last_metrics:
                waits.append(c.last_metrics["checkpoint_stall_s"])
        result = api.run(spec, show_progress=False, on_step=on_step)
        assert result.state == "finished", result.state
    window = result.step_times_s[args.skip:]
    saves = sum(1 for s in range(args.skip + 1, args.steps) if s % args.every == 0) if mode != "none" else 0
    return {"model": model, "mode": mode, "params": sum(layer_params(spec.model)),
            "window_s": sum(window), "median_step_s": statistics.median(window), "saves": saves,
            "waits_s": waits, "step_times_s": [round(t, 4) for t in window],
            "tokens_per_s": spec.train.global_batch * spec.model.seq_len * len(window) / sum(window),
            "wall_s": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dp", type=int, default=2, help="workers (on CUDA, one GPU each)")
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=None, help="instead of the model's (rows)")
    p.add_argument("--global-batch", type=int, default=None, help="instead of the model's (rows)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the window")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--store", default=None, help="checkpoint URI (default: a local temporary folder)")
    p.add_argument("--shard", default="none", choices=["none", "optimizer", "grads", "full"],
                   help="parallel.shard: sharded state is saved through DCP")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                   help="which of the three to run (none is needed for the ratios)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    modes = [m for m in MODES if m in args.modes]
    if "none" not in modes:
        p.error("--modes needs none: every ratio is against it")

    shard = "" if args.shard == "none" else f"_{args.shard}"
    out = args.out or HERE / "results" / f"checkpoint{shard}_{args.device}.json"
    runs: dict[str, dict[str, list[dict]]] = {}  # model -> mode -> its runs
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, args.seq_len)
        ray.init(address="local", include_dashboard=False, logging_level="ERROR",
                 **({"num_cpus": 2} if args.device == "cpu" else {}))
        ray.data.DataContext.get_current().enable_progress_bars = False
        for model in args.models:
            runs[model] = {m: [] for m in modes}
            for r in range(args.rounds):
                k = r % len(modes)
                for mode in modes[k:] + modes[:k]:
                    got = run(args, data, model, mode)
                    runs[model][mode].append(got)
                    print(f"{model} round {r + 1} {mode}: window {got['window_s']:.2f} s, "
                          f"{got['tokens_per_s']:,.0f} tokens/s", flush=True)
                    # after every run: a run cut short by a time limit keeps what it measured
                    write_result(out, {"args": vars(args), "rows": summarize(runs, modes),
                                       "complete": False}, announce=False)
        ray.shutdown()
    rows = summarize(runs, modes)

    print(f"\ncheckpoint every {args.every} steps, steps {args.skip + 1}-{args.steps} measured, "
          f"{args.rounds} rounds, {args.device}, shard {args.shard}, store {args.store or 'local folder'}")
    print("| model | params | mode | step s | tokens/s | vs none | stall per save | stall / step "
          "| training waited per save | / step |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = ["", "", "", ""]
        if r["stall_s"] is not None:
            step = r["median_step_s"]
            cells = [f"{r['stall_s']:.3f} s", f"{r['stall_s'] / step:.1%}",
                     f"{r['wait_s']:.3f} s", f"{r['wait_s'] / step:.1%}"]
        print(f"| {r['model']} | {r['params'] / 1e6:.1f} M | {r['mode']} | {r['median_step_s']:.3f} | "
              f"{r['tokens_per_s']:,.0f} | {r['vs_none']:.3f}x | " + " | ".join(cells) + " |")
    write_result(out, {"args": vars(args), "rows": rows, "complete": True})
    return 0


def summarize(runs: dict, modes: list[str]) -> list[dict]:
    """One row per model and mode, from the runs so far (model -> mode -> runs): ratios over
    the rounds in which the mode and `none` both ran."""
    rows = []
    for model, by_mode in runs.items():
        for mode in modes:
            paired = list(zip(by_mode[mode], by_mode["none"]))
            if not paired:
                continue
            rows.append({
                "model": model, "mode": mode, "params": by_mode[mode][0]["params"],
                "median_step_s": round(statistics.median(x["median_step_s"] for x, _ in paired), 4),
                "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x, _ in paired), 1),
                "vs_none": round(statistics.median(a["tokens_per_s"] / b["tokens_per_s"]
                                                   for a, b in paired), 4),
                "stall_s": (round(statistics.median((a["window_s"] - b["window_s"]) / a["saves"]
                                                    for a, b in paired), 4) if mode != "none" else None),
                "wait_s": (round(statistics.median(sum(x["waits_s"]) / x["saves"]
                                                   for x, _ in paired), 4)
                           if mode != "none" else None),
                "rounds": by_mode[mode]})
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
