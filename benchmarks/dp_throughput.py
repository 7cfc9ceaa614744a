"""Data-parallel throughput: baton against plain DDP and Ray Train, side by side in one run.

The same GPT, data (the stdlib corpus), global batch, micro-batching, optimizer and world size,
trained for a fixed number of steps by
  (a) baton (`baton.api.run`, Ray actors, DDP inside),
  (b) a plain torch.distributed DDP script (torch.multiprocessing, no Ray),
  (c) Ray Train's TorchTrainer.
(b) and (c) run one plain loop, `plain_steps`, so they differ only in who launches it. Throughput
is tokens per second over the steps after `--warmup`, timed on rank 0 (every step ends in an
all-reduce, so rank 0's clock is the group's). This machine is shared and noisy, so each round
runs all three back to back, in an order that rotates from round to round, and a ratio is the
median over rounds of that round's ratio (paired), not a ratio of separate medians. Each run
starts once the machine is quiet (`settle`, which prints how long it waited).

    python benchmarks/dp_throughput.py                       # CPU, gloo, 2 workers
    python benchmarks/dp_throughput.py --device cuda --layers 12 --width 768 --heads 12 \\
        --seq-len 1024 --global-batch 32 --micro-batch 8     # GPU, NCCL, bf16, MFU
    ... --compile                # all three with each block compiled (train.compile), as baton does
    ... --baseline /tmp/before   # and baton from other checkouts (one or more), in the same rounds
    python benchmarks/dp_throughput.py --skip baton,ray_train --bucket-mbs 1 5 100 --width 384 \\
        --global-batch 16 --micro-batch 8 --steps 20 --warmup 4 --rounds 4
                                 # DDP's bucket size (bucket_cap_mb) against its default 25 MB

The results file is written after every run, marked "complete": false until the last one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from baton import api
from results_io import write_result
from baton.data import Cursor
from baton.data.local import job_order, read_corpus
from baton.data.corpus import prepare_stdlib
from baton.parallel.compiled import compile_blocks
from baton.models import build_model, loss_sum
from baton.models.flops import gpt_flops_per_token, peak_flops
from baton.parallel import ParallelDims
from baton.parallel.mesh import split_micro
from baton.spec import spec_from_dict
from baton.training import clip_and_norm, make_optimizer, set_lr


def settle(quiet_pct: float = 10.0, most_s: float = 30.0) -> float:
    """Wait until the whole machine's CPU use over one second is under `quiet_pct` (of all
    cores), at most `most_s`; the seconds waited: no run starts inside the one before's
    teardown. (Ray Train's controller and helper actors stay alive after `fit()` returns, at
    about 1 % of a core each; in the 5-round run in docs/benchmarks.md this waited 1-2 s, and
    baton's gap to DDP was the same whether it ran after Ray Train or first.)"""
    import psutil

    t0 = time.monotonic()
    while time.monotonic() - t0 < most_s and psutil.cpu_percent(interval=1.0) >= quiet_pct:
        pass
    return time.monotonic() - t0


def job(args, data: str, tmp: str) -> dict:
    cuda = args.device == "cuda"
    return {
        "name": "bench-dp",
        "model": {"name": "gpt", "layers": args.layers, "width": args.width, "heads": args.heads,
                  "seq_len": args.seq_len},
        "data": {"source": "parquet", "path": data},
        "train": {"steps": args.steps, "global_batch": args.global_batch,
                  "micro_batch": args.micro_batch, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 5,
                  "precision": "bf16" if cuda else "fp32", "compile": args.compile},
        "parallel": {"dp": args.workers},
        "resources": {"cpus_per_worker": 1 if not cuda else 2, "gpus_per_worker": 1 if cuda else 0,
                      "threads_per_worker": args.threads},
        "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10**9},
        "tracking": {"enabled": False},
    }


def load_tokens(data: str, seq_len: int) -> np.ndarray:
    """The corpus in manifest order: row i is the sample baton's order calls position i."""
    return read_corpus(data)[1]


def plain_steps(model, spec, tokens: np.ndarray, rank: int, world: int, device) -> list[float]:
    """A plain DDP training loop, as a user would write it: same batches, micro-batches and
    recipe as baton. `model` is already DDP-wrapped. Returns per-step seconds."""
    t = spec.train
    optimizer = make_optimizer(model, t)
    order, cursor, dims = job_order(spec), Cursor(), ParallelDims(world)
    num_micro = t.global_batch // (world * spec.micro_batch)
    bf16 = t.precision == "bf16"
    times = []
    for step in range(t.steps):
        t0 = time.perf_counter()
        batch = order.next_batch(cursor, t.global_batch)
        micro = split_micro(dims.replica_part(batch, rank), num_micro)
        scale = world / (len(batch) * spec.model.seq_len)
        # Ray Train's prepare_model leaves a world of one unwrapped: no DDP, no no_sync
        no_sync = getattr(model, "no_sync", contextlib.nullcontext)
        for i, rows in enumerate(micro):
            data = torch.from_numpy(tokens[rows]).to(device, torch.long)
            with contextlib.nullcontext() if i == len(micro) - 1 else no_sync():
                with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
                    logits = model(data[:, :-1])
                (loss_sum(logits, data[:, 1:]) * scale).backward()
        set_lr(optimizer, t.lr_at(step))
        clip_and_norm(model, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


# -- (b) plain DDP ------------------------------------------------------------------------------

def _ddp_worker(rank: int, world: int, port: int, spec_dict: dict, data: str, threads: int,
                out: str, bucket_mb: float | None = None) -> None:
    torch.set_num_threads(threads)
    spec = spec_from_dict(spec_dict)
    cuda = spec.resources.gpus_per_worker > 0
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    model = build_model(spec.model, spec.train.seed).to(device)
    compile_blocks(model, spec.train.compile, device.type)  # as baton's workers do
    buckets = {} if bucket_mb is None else {"bucket_cap_mb": bucket_mb}
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if cuda else None,
                                                      **buckets)
    times = plain_steps(model, spec, load_tokens(data, spec.model.seq_len), rank, world, device)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_ddp(spec_dict: dict, data: str, args, tmp: str, bucket_mb: float | None = None) -> list[float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"{tmp}/ddp_times.json"
    mp.spawn(_ddp_worker, args=(args.workers, port, spec_dict, data, args.threads, out, bucket_mb),
             nprocs=args.workers, join=True)
    return json.loads(Path(out).read_text())


# -- (c) Ray Train ------------------------------------------------------------------------------

def _ray_train_loop(config: dict) -> list[float]:
    import ray.train
    import ray.train.torch

    torch.set_num_threads(config["threads"])
    spec = spec_from_dict(config["spec"])
    ctx = ray.train.get_context()
    model = build_model(spec.model, spec.train.seed)
    compile_blocks(model, spec.train.compile, ray.train.torch.get_device().type)  # as baton does
    model = ray.train.torch.prepare_model(model)
    device = ray.train.torch.get_device()
    tokens = load_tokens(config["data"], spec.model.seq_len)
    # Ray Train v2 keeps no free-floating reported metrics; rank 0's return value comes back
    return plain_steps(model, spec, tokens, ctx.get_world_rank(), ctx.get_world_size(), device)


def run_ray_train(spec_dict: dict, data: str, args, tmp: str) -> list[float]:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cuda = args.device == "cuda"
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": spec_dict, "data": data, "threads": args.threads},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=cuda,
                                     resources_per_worker={"CPU": 1 if not cuda else 2}),
        run_config=RunConfig(storage_path=f"{tmp}/ray_train", name=f"bench-{time.time_ns()}"))
    result = trainer.fit()
    return result.return_value


# -- driver -------------------------------------------------------------------------------------

def tokens_per_s(times: list[float], warmup: int, tokens_per_step: int) -> float:
    steady = times[warmup:]
    return len(steady) * tokens_per_step / sum(steady)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--compile", action="store_true",
                   help="train.compile for all three (each block compiled, as baton does); else eager")
    p.add_argument("--bucket-mbs", type=float, nargs="*", default=[],
                   help="also plain DDP with these bucket_cap_mb (the 'ddp' row is DDP's default, 25)")
    p.add_argument("--skip", default="", help="comma-separated: baton,ddp,ray_train")
    p.add_argument("--baseline", nargs="*", default=[],
                   help="other checkouts of baton, each a system named by its folder: every baton "
                   "then runs in a process of its own (a checkout's platform/ first on PYTHONPATH)")
    p.add_argument("--data", help=argparse.SUPPRESS)  # the corpus, prepared already
    p.add_argument("--baton-only", help=argparse.SUPPRESS)  # one baton run: its step times to this file
    p.add_argument("--out", default="benchmarks/results/dp_throughput_{device}.json")
    args = p.parse_args()

    import ray

    out = args.out.format(device=args.device)
    tmp = tempfile.mkdtemp(prefix="baton-bench-")
    data = args.data or f"{tmp}/data"
    if not args.data:
        prepare_stdlib(data, args.seq_len)
    spec_dict = job(args, data, tmp)
    spec = spec_from_dict(spec_dict)
    tokens_per_step = args.global_batch * args.seq_len
    grad_mib = sum(q.numel() for q in build_model(spec.model, 0).parameters()) * 4 / 2**20
    print(f"GPT {args.layers} x {args.width}: {grad_mib:.1f} MiB of fp32 gradients a step")

    ray.init(address="local", include_dashboard=False, logging_level="WARNING",
             num_cpus=os.cpu_count())
    ray.data.DataContext.get_current().enable_progress_bars = False

    def baton_run() -> list[float]:
        ckpt = Path(tmp, "ckpt")
        if ckpt.exists():
            import shutil

            shutil.rmtree(ckpt)
        return api.run(spec, show_progress=False, log=lambda _: None).step_times_s

    if args.baton_only:
        Path(args.baton_only).write_text(json.dumps(baton_run()))
        ray.shutdown()
        return 0

    def baton_process(platform: str | None) -> list[float]:
        """One baton run in a process of its own, with its own embedded Ray."""
        import subprocess

        times = f"{tmp}/times.json"
        env = {**os.environ, **({"PYTHONPATH": platform} if platform else {})}
        subprocess.run([sys.executable, *sys.argv, "--data", data, "--baton-only", times], env=env, check=True)
        return json.loads(Path(times).read_text())

    contenders = {"baton": baton_run,
                  "ddp": lambda: run_ddp(spec_dict, data, args, tmp),
                  "ray_train": lambda: run_ray_train(spec_dict, data, args, tmp)}
    if args.baseline:
        contenders["baton"] = lambda: baton_process(None)
    for other in args.baseline:
        contenders[Path(other).name] = lambda p=str(Path(other).resolve() / "platform"): baton_process(p)
    for mb in args.bucket_mbs:
        contenders[f"ddp_{mb:g}MB"] = lambda mb=mb: run_ddp(spec_dict, data, args, tmp, mb)
    skip = set(filter(None, args.skip.split(",")))
    names = [k for k in contenders if k not in skip]
    rates: dict[str, list[float]] = {k: [] for k in names}
    # each run's median step: a burst of another process's work on this shared machine moves
    # a run's mean, not its median (a fixed cost every step moves both)
    median_steps: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            waited = settle()
            t0 = time.perf_counter()
            times = contenders[name]()
            rates[name].append(tokens_per_s(times, args.warmup, tokens_per_step))
            median_steps[name].append(statistics.median(times[args.warmup:]))
            print(f"round {r + 1}: {name:9s} {rates[name][-1]:>12,.0f} tokens/s, median step "
                  f"{median_steps[name][-1] * 1e3:.1f} ms "
                  f"({time.perf_counter() - t0:.1f} s end to end, after {waited:.0f} s for "
                  "the machine to settle)", flush=True)
            # after every run: a run cut short by a time limit keeps what it measured
            write_result(out, {"config": vars(args), "rounds_tokens_per_s": rates,
                               "rounds_median_step_s": median_steps, "complete": False}, announce=False)
    ray.shutdown()

    median = {k: statistics.median(v) for k, v in rates.items()}

    def paired(a: str, b: str):
        if a not in rates or b not in rates:
            return None
        return statistics.median(x / y for x, y in zip(rates[a], rates[b]))

    def paired_median(b: str, a: str = "baton") -> float:
        """`a`'s speed over `b`'s, from each round's median steps (paired, median of rounds)."""
        return statistics.median(y / x for x, y in zip(median_steps[a], median_steps[b]))

    ratios = {"baton_vs_ddp": paired("baton", "ddp"), "baton_vs_ray_train": paired("baton", "ray_train"),
              "ray_train_vs_ddp": paired("ray_train", "ddp"),
              **{f"baton_vs_{Path(b).name}": paired("baton", Path(b).name) for b in args.baseline}}
    flops = gpt_flops_per_token(args.layers, args.width, args.seq_len, 256)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    peak = peak_flops(device_name, spec.train.precision) if args.device == "cuda" else None
    print(f"\n{'system':10s} {'tokens/s (median)':>18s} {'vs DDP':>8s} {'vs Ray Train':>13s}"
          + (f" {'MFU':>7s}" if peak else ""))
    for name, rate in median.items():
        vs = [paired(name, "ddp"), paired(name, "ray_train")]
        vs_txt = [f"{v:.3f}" if v is not None else "-" for v in vs]
        mfu = f" {rate * flops / (peak * args.workers):7.1%}" if peak else ""
        print(f"{name:10s} {rate:>18,.0f} {vs_txt[0]:>8s} {vs_txt[1]:>13s}{mfu}")
    for b in args.baseline:
        name = Path(b).name
        print(f"baton / {name} ({b}): {ratios[f'baton_vs_{name}']:.3f} (paired, of the rounds' "
              f"tokens/s); {paired_median(name):.3f} (of their median steps)")
    print("(ratios: median over rounds of each round's paired ratio)")

    result = {"config": vars(args), "device": device_name, "torch": torch.__version__,
              "ray": ray.__version__, "flops_per_token": flops, "peak_flops": peak,
              "tokens_per_step": tokens_per_step, "grad_mib": grad_mib, "rounds_tokens_per_s": rates,
              "rounds_median_step_s": median_steps,
              "median_step_ratios": {f"baton_vs_{k}": paired_median(k) for k in names if k != "baton"}
              if "baton" in names else None,
              "median_tokens_per_s": median,
              "paired_ratios_median": ratios,
              "mfu": {k: v * flops / (peak * args.workers) for k, v in median.items()} if peak else None,
              "complete": True}
    write_result(out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
