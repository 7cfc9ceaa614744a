"""DDP's gradients as views into its all-reduce buckets (`gradient_as_bucket_view`, which
baton's data-parallel workers use), measured without Ray.

Two gloo processes train a GPT (6 x 512 by default, 19 M parameters, seq 128, micro-batches
of 8 rows (`--rows`), AdamW, one torch thread each) wrapped in DDP, with the gradients held apart from the
buckets (torch's default) or as views into them, in rounds of alternating order. Each prints
its peak resident memory (`ru_maxrss`) and its median step time; rank 0's losses tell
whether the two train the same.

    python benchmarks/ddp_memory.py --rounds 3
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

CHILD = """
import json, resource, statistics, sys, time, torch
import torch.distributed as dist
from datetime import timedelta
from baton.models import build_model
from baton.spec import ModelSpec, TrainSpec
from baton.tasks import loss_sum
from baton.training import make_optimizer
rank, port, view, layers, width, steps, rows = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "views", *map(int, sys.argv[4:8])
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                        timeout=timedelta(seconds=300))
model = build_model(ModelSpec(name="gpt", layers=layers, width=width, heads=8, seq_len=128), 0)
ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
optimizer = make_optimizer(ddp, TrainSpec(lr=1e-3))
gen = torch.Generator().manual_seed(rank)
times, losses = [], []
for step in range(steps):
    t0 = time.perf_counter()
    batch = torch.randint(0, 256, (rows, 129), generator=gen)
    loss = loss_sum(ddp(batch[:, :-1]), batch[:, 1:]) / batch[:, 1:].numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
dist.destroy_process_group()
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "step_s": statistics.median(times[2:]), "losses": losses,
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def measure(mode: str, layers: int, width: int, steps: int, rows: int) -> dict:
    with socket.socket() as s:  # a free port for the two processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "platform")}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rank), str(port), mode, str(layers),
                               str(width), str(steps), str(rows)], stdout=subprocess.PIPE, text=True, env=env)
             for rank in range(2)]
    texts = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"a training process failed ({mode}); its output: {texts}")
    outs = [json.loads(text) for text in texts]
    return {"peak_rss_mib": max(o["peak_rss_mib"] for o in outs),
            "step_s": max(o["step_s"] for o in outs), "losses": outs[0]["losses"],
            "params": outs[0]["params"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8, help="rows of 128 tokens a step")
    ap.add_argument("--out", default=str(HERE / "results" / "ddp_memory_cpu.json"))
    args = ap.parse_args()
    runs = alternate(("copies", "views"), args.rounds,
                     lambda mode: measure(mode, args.layers, args.width, args.steps, args.rows))
    params = runs["views"][0]["params"]
    same = all(a["losses"] == b["losses"] for a, b in zip(runs["copies"], runs["views"]))
    print(f"\n{params / 1e6:.1f} M parameters, {4 * params / 2**20:,.0f} MiB of fp32 gradients; "
          f"losses bit for bit the same: {same}\n")
    table = memory_table(runs, "gradients")
    write_result(args.out, {"params": params, "grad_mib": round(4 * params / 2**20, 1),
                            "losses_identical": same, "table": table, "runs": runs,
                            "command": " ".join(["python", *sys.argv])})


if __name__ == "__main__":
    main()
