"""The ceiling: baton's own GPT trained by a plain PyTorch loop on one device, no Ray, no
baton runtime, in every variant worth trying. It is what baton's GPU throughput is held
against on the same machine (issue 18: at least 0.95x the best variant here).

Variants: eager or compiled (`torch.compile` of the whole model, static shapes), AdamW
foreach or fused, and each micro-batch size. One step is one micro-batch's forward and
backward in bf16 autocast (fp32 on CPU), gradient clipping at 1.0, and an optimizer step.
The tokens are random (throughput does not depend on what they say); each variant warms up
(compilation included) before it is timed, the device synchronised at both ends. MFU is
model FLOPs (baton.models.flops, PaLM's count) over the device's dense peak; peak memory is
torch's allocator peak on CUDA (none on CPU). A variant that runs out of memory is a row
saying so, and the others go on.

    python benchmarks/gpu_ceiling.py                  # CUDA: the gpt-small-gpu model (12 x 768, seq 1024)
    python benchmarks/gpu_ceiling.py --device cpu --layers 2 --width 64 --heads 2 \\
        --seq-len 64 --micro-batches 2 4 --steps 3    # a CPU smoke run of the script itself
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton.models import build_model, loss_sum  # noqa: E402
from baton.models.flops import gpt_flops_per_token, peak_flops  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from results_io import write_result  # noqa: E402


def model_spec(args):
    return spec_from_dict({
        "name": "ceiling",
        "model": {"name": "gpt", "layers": args.layers, "width": args.width, "heads": args.heads,
                  "seq_len": args.seq_len, "vocab_size": args.vocab_size},
        "data": {"source": "parquet", "path": "unused"},
        "train": {"steps": 1, "global_batch": 1, "micro_batch": 1},
    }).model


def run_variant(args, device: torch.device, compiled: bool, optimizer: str, micro_batch: int) -> dict:
    """Warm up, then time `args.steps` steps; returns tokens/s (median over the steps' rates
    in blocks of `args.block`) and the allocator's peak."""
    cuda = device.type == "cuda"
    bf16 = cuda and not args.fp32
    torch.manual_seed(0)
    model = build_model(model_spec(args), seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            **({"fused": True} if optimizer == "fused" else {"foreach": True}))
    step_model = torch.compile(model, dynamic=False) if compiled else model
    tokens = torch.randint(0, args.vocab_size, (micro_batch, args.seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step():
        with torch.autocast(device.type, torch.bfloat16, enabled=bf16):
            logits = step_model(x)
        loss = loss_sum(logits.float(), y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rates = []
    for start in range(0, args.steps, args.block):
        n = min(args.block, args.steps - start)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        rates.append(n * micro_batch * args.seq_len / (time.perf_counter() - t0))
    return {"tokens_per_s": statistics.median(rates), "warmup_s": round(warmup_s, 2),
            "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20) if cuda else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--optimizers", nargs="+", default=["foreach", "fused"], choices=["foreach", "fused"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--block", type=int, default=5, help="steps per timed block (the median is over blocks)")
    p.add_argument("--fp32", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}); use --device cpu", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    precision = "bf16" if device.type == "cuda" and not args.fp32 else "fp32"
    peak = peak_flops(name, precision)
    flops_per_token = gpt_flops_per_token(args.layers, args.width, args.seq_len, args.vocab_size)

    rows = []
    print(f"{name}, torch {torch.__version__}, {precision}; GPT {args.layers} x {args.width}, "
          f"seq {args.seq_len}; {args.steps} timed steps after {args.warmup}")
    print(f"{'mode':<9} {'adamw':<8} {'micro':>5} {'tokens/s':>11} {'MFU':>7} {'peak MiB':>9} {'warmup s':>9}")
    for mode in args.modes:
        for optimizer in args.optimizers:
            for micro in args.micro_batches:
                row = {"mode": mode, "optimizer": optimizer, "micro_batch": micro}
                try:
                    row |= run_variant(args, device, mode == "compiled", optimizer, micro)
                    row["mfu"] = row["tokens_per_s"] * flops_per_token / peak if peak else None
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                if "error" in row:
                    print(f"{mode:<9} {optimizer:<8} {micro:>5} {row['error']:>11}")
                    continue
                mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
                peak_mib = row["peak_mib"] if row["peak_mib"] is not None else "-"
                print(f"{mode:<9} {optimizer:<8} {micro:>5} {row['tokens_per_s']:>11,.0f} {mfu:>7} "
                      f"{peak_mib:>9} {row['warmup_s']:>9}")
    ran = [r for r in rows if "tokens_per_s" in r]
    best = max(ran, key=lambda r: r["tokens_per_s"]) if ran else None
    if best:
        print(f"best: {best['mode']}, {best['optimizer']} AdamW, micro-batch {best['micro_batch']}: "
              f"{best['tokens_per_s']:,.0f} tokens/s")
    out = args.out or HERE / "results" / f"gpu_ceiling_{device.type}.json"
    write_result(out, {"device": name, "torch": torch.__version__, "precision": precision,
                       "command": " ".join(sys.argv), "model": {"layers": args.layers, "width": args.width,
                       "heads": args.heads, "seq_len": args.seq_len, "vocab_size": args.vocab_size},
                       "flops_per_token": flops_per_token, "peak_flops": peak, "rows": rows,
                       "best": best})
    return 0


if __name__ == "__main__":
    sys.exit(main())
