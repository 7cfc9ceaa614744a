"""What a mix of corpora (`data.mix`) costs against the same rows as one corpus, side by side
in one run: the quick-start model (GPT 4 x 128, dp 2, global batch 32) trains `--steps`
steps on random byte tokens written once as one corpus and once split into three sources
(half, three tenths and a fifth of the rows, weighted by their sizes), alternating which goes
first each round, on one embedded local Ray. Measured: the steady tokens/s (baton's median
past warm-up) and the driver's CPU time per step over the second half of the steps (where the
mix's per-step work lies: the schedule and three feeds). Also the schedule alone
(`mix.due`): microseconds to place a batch of each size over three sources.

    python benchmarks/mix.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent / ".." / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402

SEQ = 128
SHARES = (0.5, 0.3, 0.2)


def write(folder: Path, tokens: np.ndarray, ids: np.ndarray) -> None:
    folder.mkdir(parents=True)
    column = pa.FixedSizeListArray.from_arrays(pa.array(tokens.reshape(-1)), SEQ + 1)
    pq.write_table(pa.table({"tokens": column, "sample_id": pa.array(ids)}), folder / "part-0.parquet",
                   row_group_size=2048)


def job(root: Path, name: str, data: dict, steps: int) -> dict:
    return {"name": name, "model": {"name": "gpt", "layers": 4, "width": 128, "heads": 4,
                                    "seq_len": SEQ, "vocab_size": 256},
            "data": {"source": "parquet", **data},
            "train": {"steps": steps, "global_batch": 32, "micro_batch": 8, "warmup_steps": 5},
            "parallel": {"dp": 2}, "resources": {"cpus_per_worker": 0.5},
            "checkpoint": {"path": str(root / "ckpt"), "every_steps": 10**6},
            "tracking": {"enabled": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--samples", type=int, default=60_000)
    ap.add_argument("--out", default="benchmarks/results/mix_cpu.json")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from baton import api
    from baton.data.mix import due
    from baton.spec import spec_from_dict

    schedule = []
    weights = np.array(SHARES)
    for batch in (32, 1024, 16384):
        due([0, 0, 0], weights, batch)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.5:
            due([n * 7, n * 3, n], weights, batch)
            n += 1
        schedule.append({"batch": batch, "us": (time.perf_counter() - t0) / n * 1e6})
        print(f"schedule of a batch of {batch:,} over 3 sources: {schedule[-1]['us']:,.0f} us", flush=True)

    root = Path(tempfile.mkdtemp(prefix="baton-mix-"))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (args.samples, SEQ + 1), dtype=np.int64)
    ids = np.arange(args.samples)
    write(root / "one", tokens, ids)
    cuts = np.cumsum([0, *(int(s * args.samples) for s in SHARES[:-1]), args.samples - sum(
        int(s * args.samples) for s in SHARES[:-1])])
    mix = []
    for k in range(3):
        write(root / f"source-{k}", tokens[cuts[k]:cuts[k + 1]], ids[cuts[k]:cuts[k + 1]])
        mix.append({"path": str(root / f"source-{k}"), "weight": SHARES[k]})
    ways = {"one corpus": {"path": str(root / "one")}, "a mix of 3": {"mix": mix}}

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            cpu: list[float] = []

            def watch(c) -> None:
                if c.step in (args.steps // 2, args.steps):
                    cpu.append(time.process_time())

            name = f"{'mix' if 'mix' in ways[way] else 'one'}-{r}"
            result = api.run(spec_from_dict(job(root, name, ways[way], args.steps)),
                             show_progress=False, log=lambda _: None, on_step=watch)
            out = {"tokens_per_s": result.tokens_per_s,
                   "driver_cpu_ms_per_step": (cpu[1] - cpu[0]) / (args.steps - args.steps // 2) * 1000}
            runs[way].append(out)
            print(f"round {r + 1} {way}: {out['tokens_per_s']:,.0f} tokens/s, driver "
                  f"{out['driver_cpu_ms_per_step']:.2f} ms CPU a step", flush=True)
    ray.shutdown()

    ratios = [m["tokens_per_s"] / o["tokens_per_s"] for m, o in zip(runs["a mix of 3"], runs["one corpus"])]
    print("\n| data | tokens/s (median) | driver CPU a step, ms (median) |")
    print("|---|---:|---:|")
    table = {}
    for way, outs in runs.items():
        tps = statistics.median(o["tokens_per_s"] for o in outs)
        ms = statistics.median(o["driver_cpu_ms_per_step"] for o in outs)
        table[way] = {"tokens_per_s": tps, "driver_cpu_ms_per_step": ms}
        print(f"| {way} | {tps:,.0f} | {ms:.2f} |")
    print(f"\nmix / one corpus, round by round: {', '.join(f'{x:.3f}' for x in ratios)} "
          f"(median {statistics.median(ratios):.3f})")
    write_result(args.out, {"schedule": schedule, "runs": runs, "table": table, "ratios": ratios,
                            "median_ratio": statistics.median(ratios), "steps": args.steps,
                            "samples": args.samples})


if __name__ == "__main__":
    main()
