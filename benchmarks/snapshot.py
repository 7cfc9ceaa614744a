"""What a background save's copy costs the training thread: between two steps, against beside
the next step's forward and backward (workers/saves.py), side by side in one process.

One GPT (by default the 113 M-parameter one of benchmarks/checkpoint.py) with fused AdamW, one
thread for torch's ops as a baton worker with one CPU has, in rounds that alternate the two:
- between steps: the state copied into buffers already mapped, on the training thread, then
  the next step (what baton did before the pipelined copy);
- beside the next step: `BackgroundSaves.copy`, the next step's forward and backward while the
  copy runs on its thread, `fence` before the optimizer step.
Per save: training's wait (the copy, or the save call and the fence's wait) and the step's
time with it. `--shard full`: the model under FSDP2 (ZeRO-3) in a world of one, its state
DTensors, copied as a sharded save copies them (`BackgroundSaves.copy_shards`, against torch's
`_copy_state_dict` between steps, as baton did before).

    python benchmarks/snapshot.py --rounds 5
    python benchmarks/snapshot.py --rounds 5 --shard full
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton.models import build_model  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from baton.parallel.mesh import ParallelDims  # noqa: E402
from baton.training import local  # noqa: E402
from baton.workers.saves import BackgroundSaves, _copy_into, empty_like, empty_shards  # noqa: E402
from results_io import write_result  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--shard", choices=["none", "full"], default="none")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.out = args.out or str(HERE / "results" / f"snapshot{'' if args.shard == 'none' else '_' + args.shard}_cpu.json")
    torch.set_num_threads(1)
    spec = spec_from_dict({"name": "snapshot", "data": {"source": "stdlib"},
                           "model": {"name": "gpt", "layers": args.layers, "width": args.width,
                                     "heads": 12, "seq_len": args.seq_len},
                           "train": {"steps": 1, "global_batch": 1, "micro_batch": 1}})
    model = build_model(spec.model, 0)
    if args.shard == "full":
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from baton.parallel.sharding import WRAPPINGS
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        WRAPPINGS["full"](model, ParallelDims(dp=1).device_mesh("cpu", timeout_s=60), spec.train,
                          torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, spec.model.vocab_size, (1, args.seq_len + 1))

    def forward_backward():
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    forward_backward(), update()  # AdamW's state exists from here on
    params = {local(q).data_ptr() for q in model.parameters()}
    saves = BackgroundSaves(torch.device("cpu"))
    if args.shard == "full":
        from torch.distributed._state_dict_utils import _copy_state_dict

        def state():
            model_state, optim_state = get_state_dict(model, opt)
            return {"model": model_state, "optim": optim_state["state"]}
        buffers = empty_shards(state(), pin=False)
        copy_between = lambda: _copy_state_dict(state(), buffers)  # noqa: E731
        copy_beside = lambda: saves.copy_shards(state(), params, lambda c: c)  # noqa: E731
        first = state()
        saves.prestage(lambda: empty_shards(first, pin=False))
    else:
        state = lambda: (model.state_dict(), opt.state_dict())  # noqa: E731
        buffers = empty_like(state(), pin=False)
        copy_between = lambda: _copy_into(buffers, state())  # noqa: E731
        copy_beside = lambda: saves.copy(state(), params)  # noqa: E731
        _, later = BackgroundSaves.split(state(), params)
        saves.prestage(lambda: ({}, empty_like(later, pin=False)))
    runs = {"between steps": [], "beside the next step": []}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for how in order:
            t0 = time.perf_counter()
            if how == "between steps":
                copy_between()
                waited = time.perf_counter() - t0
                forward_backward()
            else:
                copy_beside()
                call = time.perf_counter() - t0
                forward_backward()
                saves.fence()
                waited = call + saves.stalls()  # the save call, and the fence's wait
            update()
            step = time.perf_counter() - t0
            runs[how].append({"waited_s": waited, "step_s": step})
            print(f"round {r + 1} {how}: training waited {waited:.3f} s, step with the save "
                  f"{step:.2f} s", flush=True)
    rows = {how: {"waited_s": round(statistics.median(x["waited_s"] for x in v), 4),
                  "step_s": round(statistics.median(x["step_s"] for x in v), 3)}
            for how, v in runs.items()}
    print(f"\n{sum(q.numel() for q in model.parameters()) / 1e6:.1f} M parameters, "
          f"shard {args.shard}, {args.rounds} rounds, medians")
    print("| the copy | training waited per save | step with the save |")
    print("|---|---:|---:|")
    for how, row in rows.items():
        print(f"| {how} | {row['waited_s']:.3f} s | {row['step_s']:.2f} s |")
    write_result(args.out, {"args": vars(args), "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
