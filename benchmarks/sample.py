"""`baton sample`'s speed with and without the key-value cache, side by side in one process:
tokens per second for each model below, a short prompt and as many tokens as fit the window
(every token cached), and the same past the window (which slides: each token runs the whole
window again either way). Greedy (temperature 0), so both ways must write the same tokens;
the table says whether they did.

    python benchmarks/sample.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / ".." / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402

from baton.models.gpt import build_gpt  # noqa: E402
from baton.sample import generate  # noqa: E402

MODELS = {
    "quickstart 4 x 128, seq 128": dict(layers=4, width=128, heads=4, seq_len=128, vocab_size=256),
    "6 x 384, seq 512": dict(layers=6, width=384, heads=6, seq_len=512, vocab_size=256),
    "GPT-2 small 12 x 768, seq 1024": dict(layers=12, width=768, heads=12, seq_len=1024, vocab_size=256),
}
PROMPT = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for name, shape in MODELS.items():
        torch.manual_seed(0)
        model = build_gpt(**shape).eval()
        prompt = torch.randint(0, 256, (PROMPT,)).tolist()
        seq = shape["seq_len"]
        for span, tokens in (("within the window", min(seq - PROMPT, 256)), ("past the window", 32)):
            start = prompt if span == "within the window" else torch.randint(0, 256, (seq,)).tolist()
            took: dict[bool, list[float]] = {True: [], False: []}
            outs = {}
            for r in range(args.rounds):
                for cache in ((True, False) if r % 2 == 0 else (False, True)):
                    t0 = time.perf_counter()
                    outs[cache] = generate(model, start, tokens, seq, temperature=0, cache=cache)
                    took[cache].append(time.perf_counter() - t0)
            cached, whole = (tokens / statistics.median(took[c]) for c in (True, False))
            rows.append({"model": name, "span": span, "tokens": tokens, "cached_tokens_s": cached,
                         "uncached_tokens_s": whole, "speedup": cached / whole,
                         "same_tokens": outs[True] == outs[False]})
            print(f"{name}, {span}: {cached:,.1f} vs {whole:,.1f} tokens/s", flush=True)
    print(f"\n{args.threads} threads, prompt {PROMPT} tokens, greedy, median of {args.rounds} "
          "rounds (cached and uncached alternating)\n")
    print("| model | tokens | cached, tokens/s | uncached, tokens/s | speed-up | same tokens |")
    print("|---|---|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']} {r['span']} | {r['cached_tokens_s']:,.1f} | "
              f"{r['uncached_tokens_s']:,.1f} | {r['speedup']:.1f}x | {r['same_tokens']} |")
    write_result(Path(__file__).parent / "results" / "sample_cpu.json",
                 {"rounds": args.rounds, "threads": args.threads, "prompt": PROMPT, "rows": rows})


if __name__ == "__main__":
    main()
