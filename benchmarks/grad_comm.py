"""Gradient communication (`parallel.grad_comm`): the bytes each replica sends per step, and
what each setting does to the quick-start loss curve.

  bytes  Two processes on gloo (no Ray), the quick-start GPT under DDP with baton's own
         registration (`baton.parallel.comm.register`), `--bytes-steps` steps on random
         tokens. Every tensor handed to torch.distributed's all-reduce is counted on rank 0
         (this script wraps the function; fp32 runs DDP's default all-reduce as a hook,
         `allreduce_hook`, so that its calls are seen too: the same bytes). PowerSGD sends
         plain gradients for its first 10 steps, then rank-2 factors: its steady state is the
         median over the steps after that.
  loss   Real `baton.api.run`s of the quick-start job (dp 2, gloo) for `--steps` steps with
         each setting: the mean training loss over the last tenth of the steps, and the
         largest gap to fp32's loss at any logged step.

    python benchmarks/grad_comm.py                    # both parts, CPU
    python benchmarks/grad_comm.py --parts bytes
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_io import write_result  # noqa: E402

SETTINGS = ("fp32", "bf16", "powersgd")
MODEL = {"name": "gpt", "layers": 4, "width": 128, "heads": 4, "seq_len": 128}  # quick-start's


def _bytes_worker(rank: int, port: int, setting: str, steps: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from baton.models import build_model
    from baton.parallel import comm
    from baton.spec import ModelSpec
    from baton.models import loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    sent = [0]
    plain = dist.all_reduce

    def counted(tensor, *a, **k):
        sent[0] += tensor.numel() * tensor.element_size()
        return plain(tensor, *a, **k)
    dist.all_reduce = counted  # what every hook calls (looked up at call time)
    model = DDP(build_model(ModelSpec(**MODEL), seed=0))
    if setting == "fp32":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        comm.register(model, setting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    per_step = []
    for _ in range(steps):
        batch = torch.randint(0, 256, (16, MODEL["seq_len"] + 1), generator=gen)
        before = sent[0]
        loss = loss_sum(model(batch[:, :-1]), batch[:, 1:]) / batch[:, 1:].numel()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_step.append(sent[0] - before)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(out).write_text(json.dumps({"per_step": per_step, "params": params}))
    dist.destroy_process_group()


def part_bytes(args, tmp: str) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for setting in SETTINGS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = f"{tmp}/bytes-{setting}.json"
        mp.spawn(_bytes_worker, args=(port, setting, args.bytes_steps, out), nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
        steady = got["per_step"][12:]  # past PowerSGD's 10 plain steps (and DDP's first)
        rows.append({"grad_comm": setting, "params": got["params"],
                     "bytes_per_step": statistics.median(steady), "per_step": got["per_step"]})
        print(f"  {setting:9s} {rows[-1]['bytes_per_step'] / 2**20:8.3f} MiB a step per replica "
              f"({got['params']:,} parameters)", flush=True)
    fp32 = rows[0]["bytes_per_step"]
    for r in rows:
        r["vs_fp32"] = r["bytes_per_step"] / fp32
    return rows


def part_loss(args, tmp: str) -> list[dict]:
    import ray

    from baton import api
    from baton.data.corpus import prepare_stdlib
    from baton.spec import spec_from_dict

    data = f"{tmp}/stdlib"
    prepare_stdlib(data, MODEL["seq_len"])
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    curves, rows = {}, []
    for setting in SETTINGS:
        with tempfile.TemporaryDirectory(dir=tmp) as run_tmp:
            spec = spec_from_dict({
                "name": f"grad-comm-{setting}", "model": MODEL,
                "data": {"source": "parquet", "path": data},
                "train": {"steps": args.steps, "global_batch": 32, "micro_batch": 8,
                          "warmup_steps": 25, "seed": 0},
                "parallel": {"dp": 2, "grad_comm": setting}, "resources": {"cpus_per_worker": 1},
                "checkpoint": {"path": f"{run_tmp}/ckpt", "every_steps": 10**9},
                "tracking": {"uri": f"sqlite:///{run_tmp}/mlflow.db", "experiment": "bench"}})
            result = api.run(spec, show_progress=False, log=lambda _: None)
            curves[setting] = [v for _, v in result.history("loss")]
        tail = curves[setting][-max(1, args.steps // 10):]
        rows.append({"grad_comm": setting, "final_loss": sum(tail) / len(tail),
                     "tokens_per_s": result.tokens_per_s})
        print(f"  {setting:9s} loss {rows[-1]['final_loss']:.4f} (last tenth of {args.steps} "
              f"steps), {result.tokens_per_s:,.0f} tokens/s", flush=True)
    ray.shutdown()
    for r in rows:
        r["largest_gap_to_fp32"] = max(abs(a - b) for a, b in zip(curves[r["grad_comm"]], curves["fp32"]))
        r["curve"] = curves[r["grad_comm"]]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bytes,loss")
    ap.add_argument("--bytes-steps", type=int, default=20)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=str(HERE / "results" / "grad_comm_cpu.json"))
    args = ap.parse_args()
    parts, result = set(args.parts.split(",")), {"config": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        if "bytes" in parts:
            print("bytes each replica sends a step (quick-start GPT, DDP, 2 processes):")
            result["bytes"] = part_bytes(args, tmp)
        if "loss" in parts:
            print(f"the quick-start job at dp 2, {args.steps} steps:")
            result["loss"] = part_loss(args, tmp)
    print("\n| grad_comm | sent a step per replica | x fp32 | loss, last tenth | largest gap to fp32 |")
    print("|---|---:|---:|---:|---:|")
    for setting in SETTINGS:
        b = next((r for r in result.get("bytes", []) if r["grad_comm"] == setting), None)
        lo = next((r for r in result.get("loss", []) if r["grad_comm"] == setting), None)
        cells = [f"{b['bytes_per_step'] / 2**20:.3f} MiB" if b else "-",
                 f"{b['vs_fp32']:.3f}" if b else "-",
                 f"{lo['final_loss']:.4f}" if lo else "-",
                 f"{lo['largest_gap_to_fp32']:.4f}" if lo else "-"]
        print(f"| {setting} | " + " | ".join(cells) + " |")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
