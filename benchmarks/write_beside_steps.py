"""A background save's write beside a host-bound step: what the writing thread costs training.

On a GPU a small model's step is host work (the 113 M GPT's two 128-token rows: 69-74 ms of
launching kernels on an H200), and a background save's write (serialising, checksumming and
fsyncing 1.37 GB on the worker's writing thread) shares the process with it: the
interpreter's lock, the host's cores, its memory bandwidth and disk. On the H200 such saves
still cost 1.67 s each (docs/checkpoints.md); this measures the write's share alone, in one
process without Ray or a coordinator. A loop of small ops (on the device, or on the CPU),
each step ended by reading a value back as a step reads its loss, runs by itself, then beside
a write of the 113 M GPT's state with AdamW's two moments through
`CheckpointStore.write_tensors` on another thread: at `SCHED_IDLE`, as a worker's writing
thread runs (`saves._yield_to_training`), and at the thread's default priority. Rounds
alternate the order. Per write: its time, the steps beside it, their median against the loop
alone, and the stall (the steps' time beside the write over the loop alone's median, summed
over the write).

    python benchmarks/write_beside_steps.py --rounds 3
    python benchmarks/write_beside_steps.py --device cuda --rounds 3   # gpu_suite.sh's step
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton.checkpoint import CheckpointStore  # noqa: E402
from baton.models import build_model  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from baton.workers.saves import _yield_to_training  # noqa: E402
from results_io import write_result  # noqa: E402

WRITERS = {"idle": _yield_to_training, "default": lambda: None}  # the writing thread's priority


def gpt_state(layers: int, width: int, pin: bool) -> dict:
    """The GPT's parameters and AdamW's two moments, in host memory (page-locked on a GPU, as
    a worker's copy is): what a replica's background save writes."""
    spec = spec_from_dict({"name": "w", "data": {"source": "stdlib"},
                           "model": {"name": "gpt", "layers": layers, "width": width, "heads": 12,
                                     "seq_len": 128},
                           "train": {"steps": 1, "global_batch": 1, "micro_batch": 1}})
    params = dict(build_model(spec.model, 0).named_parameters())

    def host(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t.detach())
    model = {k: host(v) for k, v in params.items()}
    moments = {i: {"step": torch.tensor(10.0), "exp_avg": host(torch.randn_like(v) * 1e-3),
                   "exp_avg_sq": host(torch.rand_like(v) * 1e-6)}
               for i, v in enumerate(params.values())}
    return {"model": model, "optim": {"state": moments, "param_groups": [{"params": list(moments)}]}}


def make_step(device: torch.device, ops: int):
    x = torch.randn(64, 64, device=device)

    def step() -> float:
        y = x
        for _ in range(ops):
            y = y * 0.999 + 0.001
        return y.sum().item()  # the step's one read back, as a loss's
    return step


def alone(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def beside_write(step, state: dict, folder: str, priority) -> tuple[float, list[float]]:
    """The loop's steps while a thread writes `state` as a worker's save does; (the write's
    seconds, the steps' seconds)."""
    store, took, done = CheckpointStore(folder), [], threading.Event()

    def write() -> None:
        priority()
        t = time.perf_counter()
        try:
            store.begin(1)
            store.write_tensors(1, "model-0000.pt", state)
        finally:
            took.append(time.perf_counter() - t)
            done.set()
    thread = threading.Thread(target=write, name="baton-save")
    thread.start()
    steps = []
    while not done.is_set():
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
    thread.join()
    return took[0], steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, default=16, help="the GPT's (16 x 768: 113 M parameters)")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--ops", type=int, default=None,
                   help="small ops per step (default: 2000 on cuda, 1000 on cpu)")
    p.add_argument("--alone-steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = args.out or HERE / "results" / f"write_beside_steps_{args.device}.json"
    device = torch.device(args.device)
    torch.set_num_threads(1)  # a worker with one CPU
    args.ops = args.ops or (2000 if args.device == "cuda" else 1000)
    step = make_step(device, args.ops)
    state = gpt_state(args.layers, args.width, pin=args.device == "cuda")
    gb = sum(t.numel() * t.element_size() for t in tree_leaves(state) if isinstance(t, torch.Tensor)) / 1e9
    alone(step, 10)  # warm-up
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:  # where benchmarks/checkpoint.py writes too
        for r in range(args.rounds):
            names = list(WRITERS) if r % 2 == 0 else list(WRITERS)[::-1]
            for name in names:
                base = statistics.median(alone(step, args.alone_steps))
                write_s, steps = beside_write(step, state, f"{tmp}/{r}-{name}", WRITERS[name])
                run = {"round": r + 1, "writer": name, "write_s": round(write_s, 3),
                       "alone_median_s": round(base, 5), "steps": len(steps),
                       "beside_median_s": round(statistics.median(steps), 5),
                       "beside_max_s": round(max(steps), 5),
                       "stall_s": round(sum(steps) - base * len(steps), 3)}
                runs.append(run)
                print(f"round {r + 1} {name:7s}: write {write_s:.2f} s, {len(steps)} steps, median "
                      f"{run['beside_median_s'] * 1e3:.1f} ms against {base * 1e3:.1f} ms alone, "
                      f"stall {run['stall_s']:.2f} s", flush=True)
                write_result(out, {"args": vars(args), "state_gb": round(gb, 3), "runs": runs,
                                   "complete": False}, announce=False)
    rows = []
    print(f"\n{gb:.2f} GB written through CheckpointStore.write_tensors beside a loop of "
          f"{args.ops} small ops a step on {args.device}, {args.rounds} rounds (medians)")
    print("| writer | write s | steps beside it | step beside / alone | stall per write | stall / write |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in WRITERS:
        mine = [x for x in runs if x["writer"] == name]
        row = {"writer": name,
               "write_s": statistics.median(x["write_s"] for x in mine),
               "steps": statistics.median(x["steps"] for x in mine),
               "step_ratio": round(statistics.median(x["beside_median_s"] / x["alone_median_s"]
                                                     for x in mine), 3),
               "stall_s": statistics.median(x["stall_s"] for x in mine)}
        rows.append(row)
        print(f"| {name} | {row['write_s']:.2f} | {row['steps']:.0f} | {row['step_ratio']:.3f}x | "
              f"{row['stall_s']:.2f} s | {row['stall_s'] / row['write_s']:.1%} |")
    write_result(out, {"args": vars(args), "state_gb": round(gb, 3), "rows": rows, "runs": runs,
                       "complete": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
