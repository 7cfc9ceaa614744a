"""What the built-in classifier's AUROC costs an evaluation batch: `Classification.loss` on
4 micro-batches of 32 rows, summed in `Sums`, then `Sums.out()` pickled (what a worker sends
back), without the counts (gradients on, as a training step runs) and with them (as an
evaluation runs), for 2, 10 and 1,000 classes; the fastest of `--rounds` rounds each, and
the pickled result's size, sparse as sent and as it would be sent whole (every bin).

    python benchmarks/eval_counts.py --out benchmarks/results/eval_counts_cpu.json
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / ".." / "platform"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "eval_counts_cpu.json"))
    args = p.parse_args()
    import torch

    from baton.tasks import VALID, Classification, Sums

    task, rows = Classification(), []
    print("| classes | without counts | with counts | result bytes | counts sent whole |")
    print("|---:|---:|---:|---:|---:|")
    for classes in (2, 10, 1000):
        g = torch.Generator().manual_seed(0)
        timed = {}
        for counted in (False, True):
            best = float("inf")
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                sums = Sums()
                with torch.set_grad_enabled(not counted):
                    for _ in range(4):
                        batch = {"label": torch.randint(0, classes, (32,), generator=g),
                                 VALID: torch.ones(32, dtype=torch.bool)}
                        loss, metrics = task.loss(torch.randn(32, classes, generator=g), batch)
                        sums.add(task, loss, metrics, batch)
                out = sums.out()
                blob = pickle.dumps(out)
                best = min(best, time.perf_counter() - t0)
            timed[counted] = (best * 1e6, len(blob))
        whole = len(pickle.dumps({**out, "counts": {k: [c.kind, c.positives.tolist(), c.negatives.tolist()]
                                                    for k, c in sums.counts.items()}}))
        row = {"classes": classes, "without_us": round(timed[False][0]), "with_us": round(timed[True][0]),
               "bytes_without": timed[False][1], "bytes": timed[True][1], "bytes_whole": whole}
        rows.append(row)
        print(f"| {classes:,} | {row['without_us']:,} us ({row['bytes_without']} bytes) | {row['with_us']:,} us "
              f"| {row['bytes']:,} | {whole:,} |")
    write_result(args.out, {"rows": rows, "rounds": args.rounds})


if __name__ == "__main__":
    main()
