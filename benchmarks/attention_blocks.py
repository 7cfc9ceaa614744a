"""What one worker's attention a block at a time saves, against the whole row's mask.

Under a document mask (`data.document_mask`) or a sliding window the row passes, one
worker's attention on a CPU runs a block at a time (`models.documents.Alone`: pieces of
`--blocks` positions, the blocks no query sees left out, no mask over the row made); before,
it handed `scaled_dot_product_attention` a boolean mask of rows x T x T. Each case is the
attention op alone (the llama's shapes: grouped-query heads), forward and backward, in a
process of its own on one thread, the two ways side by side in each round (their order
rotating), measured:
- step: the median over rounds of the forward and backward's wall time;
- peak RSS: the process's high-water mark above what it held after a call on a short row
  (the kernels loaded): the gradients, the mask where one is made, the kernels' buffers.
Causal rows of one document each run torch's causal kernel either way (no blocks).

    python benchmarks/attention_blocks.py
    python benchmarks/attention_blocks.py --seq-lens 1024 4096 --document-lens 128 1024 --blocks 128 256 512
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "platform")]


def _case(how: str, T: int, document_len: int, window: int, block: int, args) -> dict:
    """One way (`whole` mask or `blocks` of `block`) on one case, in this process."""
    import torch

    from baton.models import documents as module

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 100, (args.rows, T), generator=g)
    if document_len:
        tokens[:, document_len - 1::document_len] = 0
    docs = module.documents(tokens, 0) if document_len else None
    shape = (args.rows, args.heads, T, args.head_width)
    q = torch.randn(*shape, generator=g, requires_grad=True)
    k, v = (torch.randn(args.rows, args.kv_heads, T, args.head_width, generator=g,
                        requires_grad=True) for _ in range(2))
    dy = torch.randn(*shape, generator=g)
    if how == "whole":
        module._in_blocks = lambda *a: False  # (the path before: the whole row's mask)
    module.BLOCK = block
    small = [t[..., :256, :].detach().requires_grad_() for t in (q, k, v)]
    module.attention(*small, module.documents(tokens[:, :256], 0) if document_len else None,
                     0, 0.0, gqa=True, window=window or None).sum().backward()  # (the kernels loaded)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.reps + 1):
        d = module.documents(tokens, 0) if document_len else None  # (a micro-batch's, fresh)
        for t in (q, k, v):
            t.grad = None
        t0 = time.perf_counter()
        module.attention(q, k, v, d, 0, 0.0, gqa=True, window=window or None).backward(dy)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[1:]),
            "peak_rss_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}


def _in_process(how: str, T: int, document_len: int, window: int, block: int, args) -> dict:
    cmd = [sys.executable, __file__, "--one", json.dumps([how, T, document_len, window, block])]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k in ("rows", "heads", "kv_heads", "head_width", "reps")]
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def main() -> int:
    from results_io import rotating, write_result

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--document-lens", type=int, nargs="+", default=[128, 512, 0],
                   help="documents of this many tokens a row, kept apart; 0: none (the window alone)")
    p.add_argument("--windows", type=int, nargs="+", default=[0, 512],
                   help="sliding windows (0: none); a case of no documents and no window is left out")
    p.add_argument("--blocks", type=int, nargs="+", default=[256])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-width", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE / "results" / "attention_blocks_cpu.json"))
    args = p.parse_args()
    if args.one:
        print(json.dumps(_case(*json.loads(args.one), args)))
        return 0
    rows = []
    for T in args.seq_lens:
        for document_len in args.document_lens:
            for window in args.windows:
                if (not document_len and not window) or document_len >= T or window >= T:
                    continue
                ways = [("whole", 0)] + [("blocks", b) for b in args.blocks]
                runs = rotating(ways, args.rounds,
                                lambda w: _in_process(w[0], T, document_len, window, w[1], args))
                whole = runs[("whole", 0)]
                for (how, block), got in runs.items():
                    step = statistics.median(r["step_s"] for r in got)
                    rows.append({"seq_len": T, "document_len": document_len, "window": window,
                                 "how": how, "block": block, "step_s": step,
                                 "vs_whole": statistics.median(
                                     r["step_s"] / w["step_s"] for r, w in zip(got, whole)),
                                 "peak_rss_mib": max(r["peak_rss_mib"] for r in got)})
                    r = rows[-1]
                    print(f"T {T:>5} documents {document_len or '-':>5} window {window or '-':>5} "
                          f"{how:>6} {block or '':>4}: {step * 1e3:8.1f} ms ({r['vs_whole']:.3f}x) "
                          f"peak +{r['peak_rss_mib']:.0f} MiB", flush=True)
    print(f"\nattention alone, forward and backward: {args.rows} row(s), {args.heads} heads "
          f"({args.kv_heads} key-value) of {args.head_width}, one thread")
    print("| T | documents | window | way | step ms | vs whole mask | peak RSS + MiB |")
    print("|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        way = "whole mask" if r["how"] == "whole" else f"blocks of {r['block']}"
        print(f"| {r['seq_len']:,} | {r['document_len'] or '-'} | {r['window'] or '-'} | {way} "
              f"| {r['step_s'] * 1e3:,.1f} | {r['vs_whole']:.3f} | {r['peak_rss_mib']:,.0f} |")
    write_result(args.out, {"args": {k: v for k, v in vars(args).items() if k != "one"}, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
