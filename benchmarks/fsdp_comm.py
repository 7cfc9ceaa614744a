"""ZeRO-3's step on gloo, taken apart, in plain processes (torch.multiprocessing, no Ray).

Two parts, each printing a table and writing JSON:
  collectives  gloo's all-reduce, reduce-scatter, baton's reduce-scatter (`comm.
               fsdp_reduce_scatter`: an all-reduce each rank keeps its slice of) and the
               all-gather, on a buffer the size of the GPT's parameters, at each `--worlds`;
               the median of 12 calls after 3.
  step         the GPT (4 x 256, seq 128) at dp 2, 2 micro-batches of 4, under DDP and under
               FSDP2 (its blocks as one unit, as `parallel.shard_unit_mib` groups them), with
               the per-tensor AdamW loop or the fused one, and gloo's reduce-scatter or
               baton's; per variant the median over steps of the first micro-batch, the last
               (with the reduction) and the optimizer step. Variants run in rounds whose order
               rotates; the step ratios are medians of each round's paired ratio.

    python benchmarks/fsdp_comm.py                      # both parts, 3 rounds
    python benchmarks/fsdp_comm.py --parts step --rounds 6
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results_io import write_result  # noqa: E402

# (name, wrapping, optimizer, reduce-scatter)
VARIANTS = [("ddp, loop", "ddp", "loop", None), ("ddp, fused", "ddp", "fused", None),
            ("zero3, loop, gloo rs", "full", "loop", "gloo"),
            ("zero3, fused, gloo rs", "full", "fused", "gloo"),
            ("zero3, fused, baton rs", "full", "fused", "baton")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))


def _send(out, value) -> None:
    """Put `value` and wait until it is written: the ranks end with os._exit."""
    out.put(value)
    out.close()
    out.join_thread()


def _collectives(rank: int, world: int, port: int, numel: int, out) -> None:
    from baton.parallel import comm

    _init(rank, world, port)
    shard = numel // world
    whole, part = torch.randn(shard * world), torch.randn(shard)
    ours = comm.fsdp_reduce_scatter()
    calls = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "gloo reduce_scatter": lambda: dist.reduce_scatter_single(output=part, input=whole),
        "baton reduce_scatter": lambda: ours(part, whole, dist.group.WORLD, dist.ReduceOp.SUM),
        "all_gather": lambda: dist.all_gather_single(whole, part),
    }
    ms = {}
    for name, call in calls.items():
        times = []
        for _ in range(15):
            dist.barrier()
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        ms[name] = round(statistics.median(times[3:]) * 1e3, 2)
    if rank == 0:
        _send(out, ms)
    dist.destroy_process_group()
    os._exit(0)  # see tests/unit/test_comm.py: gloo after torch._dynamo aborts at finalisation


def _step(rank: int, port: int, wrapping: str, optimizer: str, rs, steps: int, out) -> None:
    from baton.models import blocks
    from baton.models.gpt import build_gpt
    from baton.parallel import comm

    _init(rank, 2, port)
    torch.manual_seed(0)
    model = build_gpt(layers=4, width=256, heads=4, seq_len=128, vocab_size=256, dropout=0.0)
    if wrapping == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model)
        no_sync = run.no_sync
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        unit = blocks(model)
        fully_shard(unit, mesh=mesh, reshard_after_forward=False)  # the last unit: see sharding.py
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        if rs == "baton":
            for m in (unit[0], model):
                m.set_custom_reduce_scatter(comm.fsdp_reduce_scatter())
        run = model

        @contextlib.contextmanager
        def no_sync():  # as baton's ZeRO-3 with one unit: whole until the last backward
            model.set_requires_gradient_sync(False)
            model.set_reshard_after_backward(False)
            yield
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3,
                            **({"fused": True} if optimizer == "fused" else {"foreach": False}))
    gen = torch.Generator().manual_seed(rank)
    parts: dict[str, list[float]] = {"first": [], "last": [], "optimizer": [], "step": []}
    for step in range(steps):
        marks = [time.perf_counter()]
        for k in range(2):
            x = torch.randint(0, 256, (4, 128), generator=gen)
            with no_sync() if k == 0 else contextlib.nullcontext():
                logits = run(x)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
            marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(time.perf_counter())
        if step >= 5:
            for name, (a, b) in zip(parts, [(0, 1), (1, 2), (2, 3), (0, 3)]):
                parts[name].append(marks[b] - marks[a])
    if rank == 0:
        _send(out, {k: round(statistics.median(v) * 1e3, 2) for k, v in parts.items()})
    dist.destroy_process_group()
    os._exit(0)


def _spawn(target, world: int, *args):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get(timeout=600)
    for p in procs:
        p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", nargs="+", default=["collectives", "step"], choices=["collectives", "step"])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--out", default=str(HERE / "results" / "fsdp_comm_cpu.json"))
    args = ap.parse_args()
    result: dict = {"args": vars(args), "torch": torch.__version__}
    if "collectives" in args.parts:
        numel = 3_323_392  # the 4 x 256 GPT's parameters (12.7 MiB of fp32)
        result["collectives_ms"] = {}
        print(f"| ranks | {' | '.join(['all_reduce', 'gloo reduce_scatter', 'baton reduce_scatter', 'all_gather'])} |")
        for world in args.worlds:
            ms = _spawn(_collectives, world, world, _port(), numel)
            result["collectives_ms"][world] = ms
            print(f"| {world} | " + " | ".join(f"{v:.2f} ms" for v in ms.values()) + " |", flush=True)
    if "step" in args.parts:
        rounds: dict[str, list[dict]] = {v[0]: [] for v in VARIANTS}
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name, wrapping, optimizer, rs in order:
                rounds[name].append(_spawn(_step, 2, _port(), wrapping, optimizer, rs, args.steps))
                print(f"round {r + 1}: {name:24s} {rounds[name][-1]}", flush=True)
        result["step_ms_rounds"] = rounds
        base = "ddp, fused"
        print(f"\n| variant | first micro-batch | last | optimizer | step | step vs {base} |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, runs in rounds.items():
            med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            ratio = statistics.median(a["step"] / b["step"] for a, b in zip(runs, rounds[base]))
            print(f"| {name} | {med['first']:.1f} ms | {med['last']:.1f} ms | "
                  f"{med['optimizer']:.1f} ms | {med['step']:.1f} ms | {ratio:.3f} |")
        ours, theirs = rounds["zero3, fused, baton rs"], rounds["zero3, fused, gloo rs"]
        paired = [a["step"] / b["step"] for a, b in zip(ours, theirs)]
        result["baton_rs_vs_gloo_rs_step"] = {"rounds": [round(x, 3) for x in paired],
                                              "median": round(statistics.median(paired), 3)}
        print(f"\nZeRO-3's step with baton's reduce-scatter / with gloo's, paired: "
              f"{statistics.median(paired):.3f} (rounds {', '.join(f'{x:.3f}' for x in paired)})")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
