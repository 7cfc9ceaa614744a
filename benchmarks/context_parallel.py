"""What context parallelism (`parallel.cp`) saves each worker, and what it costs a step.

One row of a long sequence through the built-in llama, its positions split over cp workers
(gloo groups of cp processes on this machine, the parts baton's engine uses:
`parallel.context.SequenceSplit`, `tasks.SequencePart`), forward and backward, for each cp
given and each form of attention (`--attention`: parallel.cp_attention's all_to_all, heads
exchanged; all_gather, keys and values gathered; ring, keys and values passed around). Per
worker, measured:
- activations: the bytes the forward keeps for the backward (every tensor autograd saves,
  through `torch.autograd.graph.saved_tensors_hooks`, each storage counted once, the model's
  own weights left out): what a sequence too long for one worker runs out of;
- peak RSS: the process's high-water mark after the steps (torch's runtime, the model, its
  gradients and the activations);
- step: the median of the steps' wall time (the slowest worker's), and tokens/s of the whole
  row over it. With more workers than cores (cp 4 on 2 cores) the time says nothing of a
  machine with a core (or a GPU) a worker.

    python benchmarks/context_parallel.py --cps 1 2 4 --seq-len 4096 --attention all_to_all all_gather ring
    python benchmarks/context_parallel.py --cps 1 2 --document-len 512 --attention all_to_all ring
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "platform")]


def _worker(rank: int, port: int, cp: int, attention: str, args, out: dict) -> None:
    import resource

    import torch
    import torch.distributed as dist

    from baton.models import build_model
    from baton.models.documents import attend_within, attending, sequence_part
    from baton.parallel.context import SequenceSplit
    from baton.spec import ModelSpec
    from baton.tasks import VALID, LanguageModel, SequencePart

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    try:
        spec = ModelSpec(name="llama", layers=args.layers, width=args.width, heads=args.heads,
                         seq_len=args.seq_len, vocab_size=args.vocab,
                         options={"kv_heads": args.kv_heads})
        model = build_model(spec, 0)
        task = LanguageModel(args.seq_len, eod=0 if args.document_len else None)
        split = SequenceSplit(dist.group.WORLD, rank, cp, attention)
        part = SequencePart(task, split) if cp > 1 else task
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(1, args.vocab, (1, args.seq_len + 1), generator=g)
        if args.document_len:  # (documents of --document-len tokens, each ending in token 0)
            tokens[:, args.document_len - 1::args.document_len] = 0
        batch = {"tokens": tokens, VALID: torch.ones(1, dtype=torch.bool)}
        if args.document_len:
            attend_within(attending(model), part.documents(batch))
        elif cp > 1:
            attend_within(attending(model), sequence_part(split, 1, args.seq_len, None))
        saved: dict = {}
        weights = {q.untyped_storage().data_ptr() for q in model.parameters()}

        def keep(t):  # (the weights a layer keeps for its backward are the model's, not counted)
            if t.untyped_storage().data_ptr() not in weights:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        times = []
        for step in range(args.steps):
            saved.clear()
            dist.barrier()
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                loss, _ = part.loss(model(part.inputs(batch)), batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        out[rank] = {"activations_mib": sum(saved.values()) / 2**20,
                     "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                     "step_s": statistics.median(times[1:] or times)}
    finally:
        dist.destroy_process_group()


def _run(cp: int, attention: str, args) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, cp, attention, args, out), nprocs=cp)
    rows = [out[r] for r in range(cp)]
    step_s = max(r["step_s"] for r in rows)
    return {"cp": cp, "attention": attention if cp > 1 else "-", "activations_mib": max(r["activations_mib"] for r in rows),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rows), "step_s": step_s,
            "tokens_per_s": args.seq_len / step_s}


def main() -> int:
    from results_io import write_result

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--document-len", type=int, default=0,
                   help="documents of this many tokens a row, kept apart (data.document_mask); 0: one")
    p.add_argument("--attention", nargs="+", default=["all_to_all"],
                   choices=["all_to_all", "all_gather", "ring"])
    p.add_argument("--out", default=str(HERE / "results" / "context_parallel_cpu.json"))
    args = p.parse_args()
    rows = [_run(cp, a, args) for cp in args.cps for a in (args.attention if cp > 1 else ["-"])]
    base = rows[0]
    print(f"\nllama {args.layers} x {args.width}, {args.heads} heads ({args.kv_heads} key-value), "
          f"one row of {args.seq_len:,} positions"
          + (f", documents of {args.document_len:,} kept apart" if args.document_len else ""))
    print("| cp | attention | activations MiB a worker | vs first | peak RSS MiB a worker | step s | tokens/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['cp']} | {r['attention']} | {r['activations_mib']:,.1f} | {r['activations_mib'] / base['activations_mib']:.3f} "
              f"| {r['peak_rss_mib']:,.0f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |")
    write_result(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
