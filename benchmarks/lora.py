"""What low-rank adapters (`model.lora`) save and cost against training the whole model, and
what an average of the weights (`train.ema`) costs beside either.

One process, no Ray: baton's GPT built as a job builds it (adapters attached, the rest
frozen, the optimizer over what trains: `baton.training.make_optimizer`), one micro-batch's
forward, backward and AdamW step at a time, each setting side by side in rotating order (this
machine is shared and noisy). Measured: the parameters that train, the bytes of gradients and
of the optimizer's state (AdamW's moments, and the average) a worker holds after a step (what
sharding would otherwise split), the median time of a step over `--repeats`, and the bytes
and time of a checkpoint's model and optimizer files as a job started from an export writes
them (`CheckpointStore.write_tensors`, durable: fsync'd; the frozen weights left out:
`baton.models.frozen.from_start`); time ratios are the median over rounds of each round's
ratio to the whole model's.

    python benchmarks/lora.py
    python benchmarks/lora.py --models quickstart --repeats 20
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton.checkpoint import CheckpointStore  # noqa: E402
from baton.models import build_model, loss_sum  # noqa: E402
from baton.models.frozen import from_start  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from baton.training import make_optimizer  # noqa: E402
from results_io import median_ratio, rotating, write_result  # noqa: E402

MODELS = {  # name: (layers, width, heads, seq_len, micro_batch)
    "quickstart": (4, 128, 4, 128, 8),
    "deeper": (12, 256, 8, 256, 8),
}
SETTINGS = {  # name: (model.lora, train.ema) (None, None: the whole model trains, no average)
    "whole": (None, None),
    "whole + ema": (None, 0.999),
    "lora r8 all": ({"rank": 8}, None),
    "lora r8 + ema": ({"rank": 8}, 0.999),
    "lora r8 attn": ({"rank": 8, "targets": ["*.qkv", "*.proj"]}, None),
}


def measure(model_name: str, setting: tuple, repeats: int) -> dict:
    layers, width, heads, seq_len, micro = MODELS[model_name]
    lora, ema = setting
    model_section = {"layers": layers, "width": width, "heads": heads, "seq_len": seq_len}
    if lora is not None:
        model_section["lora"] = lora
    spec = spec_from_dict({"name": "lora", "model": model_section, "train": {"ema": ema}})
    model = build_model(spec.model, 0)
    optimizer = make_optimizer(model, spec.train)
    tokens = torch.randint(0, 256, (micro, seq_len + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()

    step()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))
    optimizer.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        optimizer.zero_grad(set_to_none=True)
    params = list(model.parameters())
    return {"trained": sum(p.numel() for p in params if p.requires_grad),
            "params": sum(p.numel() for p in params), "grad_mib": grads / 2**20,
            "optim_mib": state / 2**20, "step_s": statistics.median(times),
            **_checkpoint(spec, model, optimizer)}


def _checkpoint(spec, model, optimizer) -> dict:
    """The bytes and seconds of a checkpoint's model and optimizer files, as a job started
    from an export (`model.init_from`: only its name matters here) writes them."""
    left_out = set(from_start(dataclasses.replace(spec.model, init_from="export")))
    state = {n: t for n, t in model.state_dict().items() if n not in left_out}
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root)
        t0 = time.perf_counter()
        store.begin(1)
        parts = [store.write_tensors(1, "model-0000.pt", state),
                 store.write_tensors(1, "optim-0000.pt", optimizer.state_dict())]
        seconds = time.perf_counter() - t0
    return {"ckpt_mib": sum(p["size"] for p in parts) / 2**20, "ckpt_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a worker's default: 1)")
    ap.add_argument("--out", default=str(HERE / "results" / "lora_cpu.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'model':<11} {'setting':<14} {'trained':>11} {'of':>11} {'grads MiB':>10} "
          f"{'optim MiB':>10} {'step s':>8} {'x whole':>8} {'ckpt MiB':>9} {'ckpt s':>7}")
    for name in args.models:
        per = rotating(list(SETTINGS), args.rounds,
                       lambda key: measure(name, SETTINGS[key], args.repeats))  # noqa: B023
        for key, runs in per.items():
            first = runs[0]  # the counts and bytes are the same every round
            ratio = median_ratio(runs, per["whole"])
            step = statistics.median(x["step_s"] for x in runs)
            rows.append({"model": name, "setting": key, "lora": SETTINGS[key][0], "ema": SETTINGS[key][1],
                         "trained": first["trained"], "params": first["params"],
                         "grad_mib": round(first["grad_mib"], 3), "optim_mib": round(first["optim_mib"], 3),
                         "step_s": round(step, 4), "time_vs_whole": round(ratio, 3),
                         "checkpoint_mib": round(first["ckpt_mib"], 3),
                         "checkpoint_s": round(statistics.median(x["ckpt_s"] for x in runs), 4)})
            print(f"{name:<11} {key:<14} {first['trained']:>11,} {first['params']:>11,} "
                  f"{first['grad_mib']:>10.2f} {first['optim_mib']:>10.2f} {step:>8.3f} {ratio:>8.2f} "
                  f"{rows[-1]['checkpoint_mib']:>9.2f} {rows[-1]['checkpoint_s']:>7.3f}")
    write_result(args.out, {"torch": torch.__version__, "threads": args.threads,
                            "rounds": args.rounds, "repeats": args.repeats, "models": MODELS,
                            "rows": rows})


if __name__ == "__main__":
    main()
