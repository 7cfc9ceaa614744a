"""A worker's host memory while it builds its part of the model: layer by layer (a built-in
model starts on the meta device and each layer gets its values when the worker keeps it,
`baton.models.layers`) against the whole model built first (every worker before), side by side.

Each measurement is a fresh pair of processes (gloo, no Ray) that builds the engine a worker's
`setup` builds (`baton.workers.engines`) for one layout: ZeRO-3 over dp 2 and 4, ZeRO-2 over dp 2,
and the two stages of pp 2. "whole" is the same code with the model built whole before it is cut or
sharded (`build_lazily` replaced by `build_model` and a `fill` that does nothing: the code
before the change). Printed per rank: the peak resident memory the build added over the
process's imports (`ru_maxrss` after, minus the resident memory before), what the rank keeps
(its parameters' bytes) and the build's seconds.

    python benchmarks/build_memory.py --rounds 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402

LAYOUTS = {"zero3-dp2": {"dp": 2, "shard": "full"}, "zero3-dp4": {"dp": 4, "shard": "full"},
           "zero2-dp2": {"dp": 2, "shard": "grads"}, "pp2": {"dp": 1, "pp": 2}}


def _rank(rank: int, port: int, job: dict, way: str, out) -> None:
    import resource
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from baton.models import build_model
    from baton.spec import spec_from_dict
    from baton.tasks import make_task
    from baton.workers import engines, host
    from baton.workers.worker import _shapes

    torch.set_num_threads(1)
    host.keep_freed_memory()  # the allocator's settings a worker runs with (workers/host.py)
    spec = spec_from_dict(job)
    dims = spec.dims()
    if way == "whole":  # the code before: the whole model built, then cut or sharded
        engines.build_lazily = lambda model, seed: (build_model(model, seed), lambda layers: None)
    store = dist.TCPStore("127.0.0.1", port, dims.world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=dims.world_size,
                            timeout=timedelta(seconds=60))
    before = host.resident_bytes()
    start = time.perf_counter()
    device, task = torch.device("cpu"), make_task(spec)
    if dims.pp == 1:
        engine = engines.DataParallelEngine(spec, dims, device, task)
    else:
        half = spec.model.layers + 2  # embedding, blocks, head
        engine = engines.PipelineEngine(spec, dims, rank, device, [half // 2, half - half // 2],
                                        task, _shapes(spec, None))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    from torch.distributed.tensor import DTensor

    kept = sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in engine.module.parameters())
    out.put({"rank": rank, "added_peak_mib": (peak - before) / 2**20, "kept_mib": kept / 2**20,
             "build_s": seconds})
    dist.barrier()
    dist.destroy_process_group()


def measure(job: dict, way: str) -> list[dict]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = ctx.Queue()
    world = job["parallel"].get("dp", 1) * job["parallel"].get("pp", 1)
    procs = [ctx.Process(target=_rank, args=(r, port, job, way, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=600) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank exited with {p.exitcode}")
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "build_memory_cpu.json"))
    args = ap.parse_args()
    model = {"name": "gpt", "layers": args.layers, "width": args.width, "heads": args.heads,
             "seq_len": args.seq_len}
    n_params = 12 * args.layers * args.width**2 + 2 * 256 * args.width + args.seq_len * args.width
    print(f"GPT {args.layers} x {args.width} (about {n_params / 1e6:.0f} M parameters, "
          f"{n_params * 4 / 2**20:,.0f} MiB in fp32)")
    runs: dict[str, dict[str, list]] = {}
    for layout in args.layouts.split(","):
        job = {"name": "build-memory", "model": model,
               "data": {"source": "parquet", "path": "/nonexistent"},
               "train": {"steps": 1, "global_batch": 8, "micro_batch": 2},
               "parallel": {"timeout_s": 60, **LAYOUTS[layout]}}
        runs[layout] = {"layers": [], "whole": []}
        for r in range(args.rounds):
            for way in (("layers", "whole") if r % 2 == 0 else ("whole", "layers")):
                ranks = measure(job, way)
                runs[layout][way].append(ranks)
                print(f"{layout:10s} {way:7s} round {r + 1}: " + "; ".join(
                    f"rank {x['rank']} +{x['added_peak_mib']:,.0f} MiB peak, keeps "
                    f"{x['kept_mib']:,.0f} MiB, {x['build_s']:.2f} s" for x in ranks), flush=True)
    summary = {}
    print("\n| layout | rank | peak added, layer by layer | whole first | kept | build s, layer by layer | whole first |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for layout, ways in runs.items():
        for rank in range(len(ways["layers"][0])):
            def med(way, key):
                return statistics.median(rounds[rank][key] for rounds in ways[way])
            row = {w: {k: med(w, k) for k in ("added_peak_mib", "kept_mib", "build_s")} for w in ways}
            summary[f"{layout}/rank{rank}"] = row
            print(f"| {layout} | {rank} | {row['layers']['added_peak_mib']:,.0f} MiB | "
                  f"{row['whole']['added_peak_mib']:,.0f} MiB | {row['layers']['kept_mib']:,.0f} MiB | "
                  f"{row['layers']['build_s']:.2f} | {row['whole']['build_s']:.2f} |")
    write_result(args.out, {"args": vars(args), "parameters": n_params, "runs": runs,
                            "medians": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
