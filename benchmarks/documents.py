"""Instruction tuning on examples packed into rows, with and without `data.document_mask`,
against one example a row (`baton data prepare text --one-per-row`): what each computes and
how well it learns the same examples.

Sums (`{"prompt": "864 + 394 = ", "response": "1258"}`, as in docs/data.md), a loss on the
responses alone (`data.loss_mask_column`), the quick start's GPT (4 x 128, dp 2) trained on
the same examples three ways, for the same epochs in the same steps of about 32 examples each
(32 rows of one, or 4 packed rows of about 8):

- one a row: rows of 24 tokens (the longest example is 17 with its end), padded;
- packed: rows of 128, the examples end to end, each attending to those before it;
- packed + document_mask: the same rows, each example attending to itself alone, its
  positions counted from its start.

Each is evaluated at the end on held-out examples one a row (each alone: what a user's prompt
is at inference) and, for the packed ones, on held-out rows packed as they trained. Reported:
steps, tokens computed, seconds training, the held-out losses (mean over the responses'
bytes) and the share of 500 held-out prompts, each alone, whose greedy answer is the sum.

    python benchmarks/documents.py                # 20,000 examples, 3 epochs, seed 0
    python benchmarks/documents.py --seeds 0 1 2  # each variant three times
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
from baton.checkpoint import CheckpointStore  # noqa: E402
from baton.models import build_model  # noqa: E402
from baton.sample import generate  # noqa: E402
from baton.data.text import prepare_text  # noqa: E402
from baton.spec import load_spec  # noqa: E402
from results_io import write_result  # noqa: E402

JOB = HERE.parent / "jobs" / "quickstart.yaml"
PACKED, ALONE = 128, 24  # rows' seq_len: packed, and one example a row (the longest is 17)
EXAMPLES_A_STEP = 32  # the quick start's global batch, in examples
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


def exact(spec, step: int, held: list[dict], most: int = 500) -> float:
    """The share of the first `most` held-out prompts, each alone, whose greedy answer (up to
    the end of document) is the sum."""
    model = build_model(spec.model, 0)
    model.load_state_dict(CheckpointStore(spec.checkpoint_dir).read_model(step))
    model.eval()
    right = 0
    for e in held[:most]:
        out = generate(model, list(e["prompt"].encode()), 6, spec.model.seq_len, temperature=0,
                       stop=0)
        right += bytes(out).decode(errors="replace") == e["response"]
    return round(right / min(most, len(held)), 3)


def train(name: str, tmp: Path, data: dict, examples: int, epochs: int, held: list[dict],
          seed: int = 0) -> dict:
    seq_len, packed, masked = VARIANTS[name]
    fmt = "packed" if packed else "alone"
    rows = data[(fmt, seq_len)]["samples"]
    # the same steps for each, of about EXAMPLES_A_STEP examples: rows of one, or packed rows
    steps = math.ceil(examples * epochs / EXAMPLES_A_STEP)
    batch = (max(2, round(EXAMPLES_A_STEP * rows / examples)) // 2 * 2  # (even: dp 2)
             if packed else EXAMPLES_A_STEP)
    job = ["name=docs-" + "-".join(name.replace("+", "").split()) + f"-{seed}", f"train.seed={seed}",
           f"train.steps={steps}",
           f"train.global_batch={batch}", f"train.micro_batch={batch // 2}",
           f"train.warmup_steps={max(1, steps // 20)}", "data.source=parquet",
           f"data.path={tmp / f'{fmt}-{seq_len}'}", "data.loss_mask_column=loss_mask",
           f"data.document_mask={str(masked).lower()}", f"model.seq_len={seq_len}",
           "eval.every_steps=0", f"checkpoint.path={tmp / 'ckpt'}", "checkpoint.every_steps=1000000",
           f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}"]
    spec = load_spec(JOB, [*job, f"eval.path={tmp / f'held-alone-{seq_len}'}"])
    result = api.run(spec, show_progress=False, log=lambda _: None)
    row = {"variant": name, "seed": seed, "seq_len": seq_len, "rows": rows, "global_batch": batch,
           "examples_a_step": round(batch * examples / rows, 1), "steps": result.step,
           "tokens_computed": result.step * batch * (seq_len + 1),
           "train_s": round(sum(result.step_times_s), 1),
           "tokens_per_s": round(result.tokens_per_s),
           "eval_loss_alone": round(result.eval["eval_loss"], 4)}
    row["exact_alone"] = exact(spec, result.step, held)
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
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="train.seed of each run of each variant (its weights and its order)")
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
        rows = [train(name, tmp, data, args.examples, args.epochs, held, seed)
                for seed in args.seeds for name in VARIANTS]
        ray.shutdown()
    print(f"\n{args.examples:,} sums, {args.epochs} epochs, the quick start's GPT at dp 2; held-out "
          f"loss over {args.held:,} others' responses")
    print("| variant | seed | rows | rows (examples) a step | steps | tokens computed | s training | "
          "tokens/s | held-out loss, each alone | held-out loss, packed | sums right, each alone |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {r['seed']} | {r['rows']:,} of {r['seq_len'] + 1} | {r['global_batch']} "
              f"({r['examples_a_step']}) | {r['steps']:,} | "
              f"{r['tokens_computed']:,} | {r['train_s']} | {r['tokens_per_s']:,} | "
              f"{r['eval_loss_alone']} | {r.get('eval_loss_packed', '')} | {r['exact_alone']:.1%} |")
    write_result(args.out, {"examples": args.examples, "held": args.held, "epochs": args.epochs,
                            "seeds": args.seeds, "rows": rows})


if __name__ == "__main__":
    main()
