"""A pipeline stage's gradient all-reduce over its replicas, this checkout against another
(`--baseline DIR`, e.g. a worktree of an earlier commit), measured without Ray.

Four gloo processes (dp 2 x pp 2, 1F1B, 4 micro-batches a replica) run baton's own
`PipelineEngine` on a GPT (8 x 512 by default, 25 M parameters, seq 128, micro-batches of
`--rows` rows, AdamW, one torch thread each), in rounds of alternating order. Each process
prints its peak resident memory (`ru_maxrss`) and its median step time; the last stage's
losses and the gradient norms tell whether the two train the same.

    git worktree add /tmp/before HEAD~1
    python benchmarks/pipeline_grads.py --baseline /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_io import alternate, memory_table, write_result  # noqa: E402

WORLD = 4  # dp 2 x pp 2
CHILD = """
import json, resource, statistics, sys, time, numpy as np, torch
import torch.distributed as dist
from datetime import timedelta
from baton.data.feed import token_columns
from baton.parallel import ParallelDims
from baton.parallel.partition import plan_stages
from baton.spec import spec_from_dict
from baton.tasks import VALID, make_task, padded
from baton.workers.engines import PipelineEngine
rank, port, layers, width, steps, rows = int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:7])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                        timeout=timedelta(seconds=600))
spec = spec_from_dict({"name": "bench", "data": {"source": "parquet", "path": "unused"},
                       "model": {"name": "gpt", "layers": layers, "width": width, "heads": 8, "seq_len": 128},
                       "train": {"steps": steps, "global_batch": 8 * rows, "micro_batch": rows, "lr": 1e-3},
                       "parallel": {"dp": 2, "pp": 2, "schedule": "1f1b"}})
dims = ParallelDims(2, 2)
shapes = token_columns("tokens", None, 129, spec.model.vocab_size).shapes()
task = make_task(spec)
engine = PipelineEngine(spec, dims, rank, torch.device("cpu"), plan_stages(spec, None), task, shapes)
dp_rank = dims.coords(rank)[0]
gen = torch.Generator().manual_seed(dp_rank)  # a stage's two ranks of one replica read the same rows
times, losses = [], []
for step in range(steps):
    tokens = torch.randint(0, 256, (4 * rows, 129), generator=gen)

    def batch_fn(idx, pad_to=None):
        batch = {"tokens": tokens[torch.as_tensor(idx)], VALID: torch.ones(len(idx), dtype=torch.bool)}
        return padded(batch, pad_to, shapes) if pad_to else batch

    micro = [np.arange(i * rows, (i + 1) * rows) for i in range(4)]
    t0 = time.perf_counter()
    sums, _ = engine.forward_backward(micro, batch_fn, 1.0 / (8 * rows * 128), False)
    norm = float(engine.apply(1e-3))
    times.append(time.perf_counter() - t0)
    losses.append((sums.out()["loss_sum"] if engine.last else None, norm))
dist.destroy_process_group()
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "step_s": statistics.median(times[2:]), "losses": losses, "last": engine.last,
                  "params": sum(p.numel() for p in engine.module.parameters())}))
"""


def measure(checkout: Path, layers: int, width: int, steps: int, rows: int) -> dict:
    with socket.socket() as s:  # a free port for the processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(checkout / "platform")}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(port), str(layers),
                               str(width), str(steps), str(rows)], stdout=subprocess.PIPE,
                              text=True, env=env)
             for rank in range(WORLD)]
    texts = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"a training process failed ({checkout}); its output: {texts}")
    outs = [json.loads(text) for text in texts]
    last = next(o for o in outs if o["last"])
    return {"peak_rss_mib": max(o["peak_rss_mib"] for o in outs),
            "rank_peak_rss_mib": [round(o["peak_rss_mib"]) for o in outs],
            "step_s": max(o["step_s"] for o in outs), "losses": last["losses"],
            "stage_params": [o["params"] for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="another checkout of baton")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1, help="rows of 128 tokens a micro-batch")
    ap.add_argument("--out", default=str(HERE / "results" / "pipeline_grads_cpu.json"))
    args = ap.parse_args()
    checkouts = {"this": HERE.parent, "baseline": Path(args.baseline).resolve()}
    runs = alternate(("baseline", "this"), args.rounds,
                     lambda name: measure(checkouts[name], args.layers, args.width, args.steps, args.rows))
    same = all(a["losses"] == b["losses"] for a, b in zip(runs["this"], runs["baseline"]))
    stage = max(runs["this"][0]["stage_params"])
    print(f"\nthe larger stage: {stage / 1e6:.1f} M parameters, {4 * stage / 2**20:,.0f} MiB of fp32 "
          f"gradients; losses bit for bit the same: {same}\n")
    table = memory_table(runs, "checkout (peak: the largest rank)")
    write_result(args.out, {"stage_params": stage, "grad_mib": round(4 * stage / 2**20, 1),
                            "losses_identical": same, "table": table, "runs": runs,
                            "baseline": str(checkouts["baseline"]),
                            "command": " ".join(["python", *sys.argv])})


if __name__ == "__main__":
    main()
