"""Instruction tuning on examples packed into rows, with and without `data.document_mask`,
against one example a row (`baton data prepare text --one-per-row`): what each computes and
how well it learns the same examples.

Sums (`{"prompt": "864 + 394 = ", "response": "1258"}`, as in docs/data.md), a loss on the
responses alone (`data.loss_mask_column`), the quick start's GPT (4 x 128, dp 2) trained for
the same number of epochs over the same examples three ways:

- one a row: rows of 24 tokens (the longest example is 17 with its end), padded;
- packed: rows of 128, the examples end to end, each attending to those before it;
- packed + document_mask: the same rows, each example attending to itself alone, its
  positions counted from its start.

Each is evaluated at the end on held-out examples one a row (each alone: what a user's prompt
is at inference) and, for the packed ones, on held-out rows packed as they trained. Reported:
steps, tokens computed, seconds training, and the held-out losses (mean over the responses'
bytes).

    python benchmarks/documents.py                # 20,000 examples, 3 epochs
    python benchmarks/documents.py --examples 5000 --epochs 2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.text import prepare_text  # noqa: E402
from baton.spec import load_spec  # noqa: E402
from results_io import write_result  # noqa: E402

JOB = HERE.parent / "jobs" / "quickstart.yaml"
PACKED, ALONE = 128, 24  # rows' seq_len: packed, and one example a row (the longest is 17)
VARIANTS = {  # name: (seq_len, packed, document_mask)
    "one a row": (ALONE, False, False),
    "packed": (PACKED, True, False),
    "packed + document_mask": (PACKED, True, True),
}


def sums(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        out.append({"prompt": f"{a} + {b} = ", "response": str(a + b)})
    return out


def prepare(examples: list[dict], folder: Path, seq_len: int, packed: bool) -> dict:
    src = folder.with_suffix(".jsonl")
    src.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return prepare_text(str(src), str(folder), seq_len, column="response", on_ray=False,
                        prompt_column="prompt", one_per_row=not packed)


def train(name: str, tmp: Path, data: dict, epochs: int) -> dict:
    seq_len, packed, masked = VARIANTS[name]
    fmt = "packed" if packed else "alone"
    rows = data[(fmt, seq_len)]["samples"]
    steps = math.ceil(rows * epochs / 32)
    job = ["name=docs-" + "-".join(name.replace("+", "").split()), f"train.steps={steps}",
           f"train.warmup_steps={max(1, steps // 20)}", "data.source=parquet",
           f"data.path={tmp / f'{fmt}-{seq_len}'}", "data.loss_mask_column=loss_mask",
           f"data.document_mask={str(masked).lower()}", f"model.seq_len={seq_len}",
           "eval.every_steps=0", f"checkpoint.path={tmp / 'ckpt'}", "checkpoint.every_steps=1000000",
           f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]
    spec = load_spec(JOB, [*job, f"eval.path={tmp / f'held-alone-{seq_len}'}"])
    result = api.run(spec, show_progress=False, log=lambda _: None)
    row = {"variant": name, "seq_len": seq_len, "rows": rows, "steps": result.step,
           "tokens_computed": result.step * 32 * seq_len,
           "train_s": round(sum(result.step_times_s), 1),
           "tokens_per_s": round(result.tokens_per_s),
           "eval_loss_alone": round(result.eval["eval_loss"], 4)}
    if packed:  # its last checkpoint on held-out rows packed as it trained
        again = load_spec(JOB, [*job, f"eval.path={tmp / 'held-packed-128'}"])
        row["eval_loss_packed"] = round(
            api.evaluate(again, show_progress=False, log=lambda _: None).eval["eval_loss"], 4)
    print(f"{name}: {row}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=20_000)
    ap.add_argument("--held", type=int, default=2_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "documents_cpu.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        examples = sums(args.examples, 0)
        seen = {e["prompt"] for e in examples}  # held out: sums never trained on
        held = [e for e in sums(2 * args.held, 1) if e["prompt"] not in seen][:args.held]
        data = {("packed", PACKED): prepare(examples, tmp / "packed-128", PACKED, True),
                ("alone", ALONE): prepare(examples, tmp / "alone-24", ALONE, False)}
        prepare(held, tmp / "held-packed-128", PACKED, True)
        for seq_len in (PACKED, ALONE):
            prepare(held, tmp / f"held-alone-{seq_len}", seq_len, False)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        ray.data.DataContext.get_current().enable_progress_bars = False
        rows = [train(name, tmp, data, args.epochs) for name in VARIANTS]
        ray.shutdown()
    print(f"\n{args.examples:,} sums, {args.epochs} epochs, the quick start's GPT at dp 2; held-out "
          f"loss over {args.held:,} others' responses")
    print("| variant | rows | steps | tokens computed | s training | tokens/s | held-out loss, "
          "each alone | held-out loss, packed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['rows']:,} of {r['seq_len'] + 1} | {r['steps']:,} | "
              f"{r['tokens_computed']:,} | {r['train_s']} | {r['tokens_per_s']:,} | "
              f"{r['eval_loss_alone']} | {r.get('eval_loss_packed', '')} |")
    write_result(args.out, {"examples": args.examples, "held": args.held, "epochs": args.epochs,
                            "rows": rows})


if __name__ == "__main__":
    main()
