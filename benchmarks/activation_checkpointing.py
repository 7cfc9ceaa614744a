"""What activation checkpointing (`train.activation_checkpointing`) saves and costs.

One process, no Ray: baton's GPT built as a job builds it, one micro-batch forward and
backward at a time, for each setting side by side in rotating order (this machine is shared
and noisy). Measured: the bytes autograd keeps for the backward (every saved tensor, counted
by a saved-tensors hook, as the pipeline's activation metric counts them: what a device must
hold for the backward, on top of the model) and the median time of a forward + backward over
`--repeats`. Time ratios are the median over rounds of each round's ratio to `none`.

    python benchmarks/activation_checkpointing.py
    python benchmarks/activation_checkpointing.py --models quickstart --repeats 20
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
from baton.parallel.activations import checkpoint_activations  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from results_io import median_ratio, rotating, write_result  # noqa: E402

MODELS = {  # name: (layers, width, heads, seq_len, micro_batch)
    "quickstart": (4, 128, 4, 128, 8),
    "deeper": (12, 256, 8, 256, 8),
}
SETTINGS = {"none": "none", "blocks": "blocks", "every 2": {"every": 2}}


def measure(model_name: str, setting, repeats: int) -> dict:
    layers, width, heads, seq_len, micro = MODELS[model_name]
    spec = spec_from_dict({"name": "ac", "model": {"layers": layers, "width": width, "heads": heads,
                                                   "seq_len": seq_len},
                           "train": {"activation_checkpointing": setting}})
    model = build_model(spec.model, 0)
    checkpoint_activations(model, spec.train.activation_checkpointing)
    tokens = torch.randint(0, 256, (micro, seq_len + 1), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return {"saved_mib": sum(saved) / 2**20, "step_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default: 1)")
    ap.add_argument("--out", default=str(HERE / "results" / "activation_checkpointing_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'model':<11} {'setting':<9} {'saved MiB':>10} {'x none':>7} {'step s':>8} {'x none':>7}")
    for name in args.models:
        per = rotating(list(SETTINGS), args.rounds,
                       lambda key: measure(name, SETTINGS[key], args.repeats))  # noqa: B023
        base_saved = per["none"][0]["saved_mib"]
        for key, runs in per.items():
            saved = runs[0]["saved_mib"]  # the same every round: what autograd keeps
            ratio_t = median_ratio(runs, per["none"])
            step = statistics.median(x["step_s"] for x in runs)
            rows.append({"model": name, "setting": key, "saved_mib": round(saved, 2),
                         "saved_vs_none": round(saved / base_saved, 3), "step_s": round(step, 4),
                         "time_vs_none": round(ratio_t, 3)})
            print(f"{name:<11} {key:<9} {saved:>10.1f} {saved / base_saved:>7.2f} {step:>8.3f} "
                  f"{ratio_t:>7.2f}")
    write_result(args.out, {"torch": torch.__version__, "threads": args.threads,
                            "rounds": args.rounds, "repeats": args.repeats, "models": MODELS,
                            "rows": rows})


if __name__ == "__main__":
    main()
