"""Pipeline parallelism: measured bubble against theory, activation memory per schedule, and
throughput against torch.distributed.pipelining running the same stages, in one run.

  bubble      Equal-cost stages whose forward and backward each sleep a fixed time (an
              emulated device: on this 2-core machine, four CPU-bound stages would time-share
              the cores and no schedule would show its shape). Every schedule, p in {2, 4},
              m in {4, 8, 16}; the idle fraction measured by baton's runtime each step (median
              after warm-up) against the papers' formula and baton's own simulator.
  memory      The GPT on real data: bytes autograd keeps for backward (activations, parameters
              excluded), peak per stage, and the most micro-batches alive at once.
  throughput  The GPT cut into the same 2 stages, trained by baton (Ray actors) and by a plain
              torch.distributed.pipelining script (processes, no Ray) with the same schedule,
              micro-batches, optimizer and global-norm clipping; rounds alternate the order and
              the ratio is the median of per-round paired ratios.

    python benchmarks/pipeline.py                    # all three parts, CPU
    python benchmarks/pipeline.py --parts bubble     # one part
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from baton import api
from baton.models import build_model, loss_sum, sequential
from baton.parallel import schedule as sched
from baton.parallel.partition import bounds, plan_stages
from baton.spec import spec_from_dict
from results_io import write_result

HERE = Path(__file__).resolve().parent


def make_data(folder: Path, samples: int, seq_len: int, seed: int = 0) -> str:
    """Random byte tokens: timing and memory do not depend on what the text says."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 256, size=(samples, seq_len + 1), dtype=np.uint8)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), seq_len + 1)
    pq.write_table(pa.table({"sample_id": np.arange(samples), "tokens": tokens}),
                   folder / "part-0.parquet")
    return str(folder)


def spec_dict(name: str, model: dict, data: str, tmp: str, *, steps: int, global_batch: int,
              parallel: dict, cpus: float) -> dict:
    return {"name": name, "model": model, "data": {"source": "parquet", "path": data},
            "train": {"steps": steps, "global_batch": global_batch, "lr": 1e-3, "min_lr": 1e-4,
                      "warmup_steps": 2},
            "parallel": {"dp": 1, "timeout_s": 120, **parallel},
            "resources": {"cpus_per_worker": cpus},
            "checkpoint": {"path": f"{tmp}/ckpt", "every_steps": 10**9},
            "tracking": {"enabled": False}}


def run_baton(d: dict, tmp: str):
    shutil.rmtree(f"{tmp}/ckpt", ignore_errors=True)
    return api.run(spec_from_dict(d), show_progress=False, log=lambda _: None)


# -- bubble ---------------------------------------------------------------------------------------


def part_bubble(args, tmp: str) -> list[dict]:
    seq_len, width = 16, 16
    data = make_data(Path(tmp, "tiny"), 512, seq_len)
    rows = []
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        v = 2 if schedule == "interleaved-1f1b" else 1
        for p in (2, 4):
            for m in (4, 8, 16):
                model = {"name": "sleepy:build", "layers": p * v, "width": width,
                         "seq_len": seq_len,
                         "options": {"fwd_s": args.fwd_ms / 1e3 / v, "bwd_s": 2 * args.fwd_ms / 1e3 / v}}
                d = spec_dict("bench-bubble", model, data, tmp, steps=args.bubble_steps,
                              global_batch=m, parallel={"pp": p, "schedule": schedule,
                                                        "microbatches": m, "chunks": v},
                              cpus=2 / p)
                result = run_baton(d, tmp)
                measured = statistics.median(result.bubbles[2:])
                sim = sched.simulate(sched.build(schedule, p, m, v), p, v, 1.0, 2.0).bubble
                rows.append({"schedule": schedule, "p": p, "m": m, "v": v,
                             "textbook": sched.textbook_bubble(schedule, p, m, v),
                             "simulated": sim, "measured": measured,
                             "measured_steps": result.bubbles})
                r = rows[-1]
                print(f"  {schedule:17s} p={p} m={m:2d} v={v}  textbook {r['textbook']:.3f}  "
                      f"simulated {sim:.3f}  measured {measured:.3f}  "
                      f"(diff {measured - r['textbook']:+.3f})", flush=True)
    return rows


# -- memory ---------------------------------------------------------------------------------------


def gpt(args) -> dict:
    return {"name": "gpt", "layers": args.layers, "width": args.width, "heads": args.heads,
            "seq_len": args.seq_len}


def part_memory(args, tmp: str, data: str) -> list[dict]:
    rows = []
    m = 8
    for p in (2, 4):
        for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
            v = 2 if schedule == "interleaved-1f1b" else 1
            if args.layers + 2 < p * v:
                continue
            d = spec_dict("bench-memory", gpt(args), data, tmp, steps=2, global_batch=m * 2,
                          parallel={"pp": p, "schedule": schedule, "microbatches": m,
                                    "chunks": v}, cpus=2 / p)
            result = run_baton(d, tmp)
            peaks = result.pipeline_peaks
            rows.append({"schedule": schedule, "p": p, "m": m, "v": v,
                         "activation_mib": [x["activation_bytes"] / 2**20 for x in peaks],
                         "live": [x["live"] for x in peaks],
                         "simulated_live": sched.simulate(sched.build(schedule, p, m, v), p, v).peak_live})
            r = rows[-1]
            print(f"  {schedule:17s} p={p} m={m}  live micro-batches per stage {r['live']} "
                  f"(simulated {r['simulated_live']})  activation MiB "
                  f"{[round(x, 1) for x in r['activation_mib']]}", flush=True)
    return rows


# -- throughput: torch.distributed.pipelining on the same stages ---------------------------------


def _torch_pipe_worker(rank: int, world: int, port: int, d: dict, stage_layers: list, out: str,
                       tokens_path: str, steps: int) -> None:
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    torch.set_num_threads(1)
    spec = spec_from_dict(d)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    full = sequential(build_model(spec.model, spec.train.seed), spec.model.name)
    spans = bounds(stage_layers)
    v, m = spec.chunks, spec.microbatches
    idx = [sched.stage_of(rank, c, world) for c in range(v)]
    mods = [full[slice(*spans[i])] for i in idx]
    stages = [PipelineStage(mod, i, world * v, torch.device("cpu")) for mod, i in zip(mods, idx)]
    params = [q for mod in mods for q in mod.parameters()]
    from baton.training import make_optimizer
    optimizer = make_optimizer(torch.nn.ModuleList(mods), spec.train)
    tokens = torch.from_numpy(np.load(tokens_path)).long()
    scale = 1.0 / (spec.train.global_batch * spec.model.seq_len)

    def loss_fn(out_, target):
        return loss_sum(out_, target) * scale

    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
            "interleaved-1f1b": ScheduleInterleaved1F1B}[spec.parallel.schedule]
    schedule = kind(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn,
                    scale_grads=False)
    times = []
    B = spec.train.global_batch
    for step in range(steps):
        t0 = time.perf_counter()
        batch = tokens[(step * B) % (len(tokens) - B):][:B]
        if rank == 0:
            schedule.step(batch[:, :-1])
        elif rank == world - 1:
            schedule.step(target=batch[:, 1:])
        else:
            schedule.step()
        sq = torch.zeros(())  # global-norm clipping over all stages, as baton does
        for q in params:
            sq += torch.linalg.vector_norm(q.grad) ** 2
        dist.all_reduce(sq)
        coef = min(1.0, spec.train.grad_clip / (float(sq) ** 0.5 + 1e-6))
        for q in params:
            q.grad.mul_(coef)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def run_torch_pipelining(d: dict, stage_layers: list, tmp: str, tokens: np.ndarray,
                         steps: int) -> list[float]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    np.save(f"{tmp}/tokens.npy", tokens)
    out = f"{tmp}/torch_times.json"
    mp.spawn(_torch_pipe_worker, args=(d["parallel"]["pp"], port, d, stage_layers, out,
                                       f"{tmp}/tokens.npy", steps),
             nprocs=d["parallel"]["pp"], join=True)
    return json.loads(Path(out).read_text())


def part_throughput(args, tmp: str, data: str) -> list[dict]:
    import pyarrow.dataset as pads

    table = pads.dataset(data).to_table().sort_by("sample_id")
    tokens = table.column("tokens").combine_chunks().flatten().to_numpy().reshape(table.num_rows, -1)
    rows = []
    p, m = 2, 8
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        v = 2 if schedule == "interleaved-1f1b" else 1
        d = spec_dict("bench-pp", gpt(args), data, tmp, steps=args.steps, global_batch=m * 4,
                      parallel={"pp": p, "schedule": schedule, "microbatches": m, "chunks": v},
                      cpus=1)
        spec = spec_from_dict(d)
        stage_layers = plan_stages(spec, lambda: None)
        tps = spec.train.global_batch * spec.model.seq_len
        rates = {"baton": [], "torch": []}
        for r in range(args.rounds):
            order = ["baton", "torch"] if r % 2 == 0 else ["torch", "baton"]
            for name in order:
                if name == "baton":
                    times = run_baton(d, tmp).step_times_s
                else:
                    times = run_torch_pipelining(d, stage_layers, tmp, tokens, args.steps)
                steady = times[args.warmup:]
                rates[name].append(len(steady) * tps / sum(steady))
                print(f"  {schedule:17s} round {r + 1}: {name:6s} {rates[name][-1]:>9,.0f} tokens/s",
                      flush=True)
        ratio = statistics.median(a / b for a, b in zip(rates["baton"], rates["torch"]))
        rows.append({"schedule": schedule, "p": p, "m": m, "v": v, "stage_layers": stage_layers,
                     "rounds_tokens_per_s": rates,
                     "median_tokens_per_s": {k: statistics.median(x) for k, x in rates.items()},
                     "baton_vs_torch": ratio})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="bubble,memory,throughput")
    ap.add_argument("--fwd-ms", type=float, default=20.0, help="emulated forward per stage (bubble)")
    ap.add_argument("--bubble-steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/pipeline_cpu.json")
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    import ray

    tmp = tempfile.mkdtemp(prefix="baton-bench-pp-")
    # the workers import the emulated-device model (benchmarks/sleepy.py) by name
    ray.init(address="local", include_dashboard=False, logging_level="WARNING",
             num_cpus=os.cpu_count(), runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    sys.path.insert(0, str(HERE))
    data = make_data(Path(tmp, "gpt"), 2048, args.seq_len)
    result = {"config": vars(args), "torch": torch.__version__, "ray": ray.__version__,
              "cpus": os.cpu_count()}
    if "bubble" in parts:
        print("bubble (idle fraction), emulated equal stages, F = "
              f"{args.fwd_ms:g} ms and B = {2 * args.fwd_ms:g} ms per micro-batch:")
        result["bubble"] = part_bubble(args, tmp)
    if "memory" in parts:
        print("activation memory, GPT:")
        result["memory"] = part_memory(args, tmp, data)
    if "throughput" in parts:
        print("throughput, GPT, p=2, m=8:")
        result["throughput"] = part_throughput(args, tmp, data)
    ray.shutdown()
    summary(result)
    write_result(args.out, result)
    return 0


def summary(result: dict) -> None:
    if "bubble" in result:
        print(f"\n{'schedule':17s} {'p':>2s} {'m':>3s} {'textbook':>9s} {'simulated':>10s} "
              f"{'measured':>9s} {'diff':>7s}")
        for r in result["bubble"]:
            print(f"{r['schedule']:17s} {r['p']:>2d} {r['m']:>3d} {r['textbook']:>9.3f} "
                  f"{r['simulated']:>10.3f} {r['measured']:>9.3f} {r['measured'] - r['textbook']:>+7.3f}")
        worst = max(abs(r["measured"] - r["textbook"]) for r in result["bubble"])
        print(f"largest |measured - textbook|: {worst:.3f} (target 0.05)")
    if "memory" in result:
        print(f"\n{'schedule':17s} {'p':>2s} {'m':>3s}  {'live micro-batches per stage':30s} "
              "activation MiB per stage")
        for r in result["memory"]:
            print(f"{r['schedule']:17s} {r['p']:>2d} {r['m']:>3d}  {str(r['live']):30s} "
                  f"{[round(x, 1) for x in r['activation_mib']]}")
    if "throughput" in result:
        print(f"\n{'schedule':17s} {'baton tokens/s':>15s} {'torch.pipelining':>17s} {'ratio':>7s}")
        for r in result["throughput"]:
            med = r["median_tokens_per_s"]
            print(f"{r['schedule']:17s} {med['baton']:>15,.0f} {med['torch']:>17,.0f} "
                  f"{r['baton_vs_torch']:>7.3f}")
        print("(ratio: median over rounds of each round's paired baton / torch ratio)")


if __name__ == "__main__":
    sys.exit(main())
