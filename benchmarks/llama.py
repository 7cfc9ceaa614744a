"""The Llama-style model against the GPT on the quick start: the two job files as shipped
(`jobs/quickstart.yaml`, `jobs/llama.yaml`: 4 x 128, the same corpus, batch, schedule and
seed; the llama has 4 query heads on 2 key-value heads and a SwiGLU MLP of 344 units, so
fewer parameters), run in rotating order on one local Ray, and compared by the mean
training loss of their last 50 steps and their median tokens/s.

    python benchmarks/llama.py                  # 500 steps each, 2 rounds
    python benchmarks/llama.py --steps 200 --rounds 1
    python benchmarks/llama.py --profile        # where each model's step goes (one process)
    python benchmarks/llama.py --tp             # the llama at tp 2: one collective for the
                                                # layers that share an input, or one each
    python benchmarks/llama.py --experts        # the llama against a mixture of 4 experts
                                                # (2 a token) of the same active parameters
    python benchmarks/llama.py --ep             # a mixture of 8 experts at dp 2 under DDP,
                                                # expert parallelism (ep 2) and ZeRO-3

With --experts the two runs are `jobs/llama.yaml` and the same job whose blocks' MLPs are
mixtures of 4 experts of 176 hidden units, 2 a token (Mixtral's kind: a token meets 2% more
MLP weights than the dense 344 units, its parameters 1.7x), without
and with a load-balancing loss (model.options.router_aux_loss 0.02, Mixtral's), and each
mixture's load after training: the share of 16 x 128 tokens of the corpus each block's
router sends to each expert (balanced: 1/4 each).

With --ep, one mixture (8 experts of 176 units, 2 a token, load-balancing loss 0.02) at dp 2
in three layouts that compute the same updates: DDP (each worker holds every expert), expert
parallelism (parallel.ep 2: each holds 4 of each block's experts, tokens sent to their
holders and back) and ZeRO-3 (every parameter sharded over the 2 workers): their tokens/s
and the parameters, gradients and optimizer state each worker holds (measured from the live
tensors at the first step)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.models import build_model  # noqa: E402
from baton.spec import load_spec  # noqa: E402
from results_io import median_ratio, rotating, write_result  # noqa: E402

JOBS = {"gpt": HERE.parent / "jobs" / "quickstart.yaml", "llama": HERE.parent / "jobs" / "llama.yaml"}


# the mixture of --experts: the llama's job with each block's MLP 4 experts of 176 units
MIXTURE = ["model.options.experts=4", "model.options.experts_per_token=2", "model.options.hidden=176"]
VARIANTS = {"llama": [], "mixture": MIXTURE, "balanced": [*MIXTURE, "model.options.router_aux_loss=0.02"]}
# --ep's mixture and its three layouts
EIGHT = ["model.options.experts=8", "model.options.experts_per_token=2", "model.options.hidden=176",
         "model.options.router_aux_loss=0.02"]
LAYOUTS = {"ddp": EIGHT, "ep2": [*EIGHT, "parallel.ep=2"], "zero3": [*EIGHT, "parallel.shard=full"]}


def run(model: str, data: str, tmp: str, steps: int, extra: list[str] = ()) -> dict:
    job = JOBS.get(model, JOBS["llama"])
    spec = load_spec(job, [f"name=bench-{model}", f"train.steps={steps}",
                           "data.source=parquet", f"data.path={data}",
                           f"checkpoint.path={tmp}/ckpt", "checkpoint.every_steps=1000000",
                           f"tracking.uri=sqlite:///{tmp}/mlflow.db", *extra])
    result = api.run(spec, show_progress=False, log=lambda _: None)
    losses = [v for _, v in result.history("loss")]
    speeds = [v for _, v in result.history("tokens_per_s")]
    row = {"model": model, "steps": steps, "loss_last_50": round(sum(losses[-50:]) / len(losses[-50:]), 4),
           "tokens_per_s": round(statistics.median(speeds)),
           "parameters": sum(p.numel() for p in build_model(spec.model, 0).parameters()),
           "state_mib_per_worker": round(max(sum(b.values()) for b in result.state_bytes) / 2**20, 2)}
    if spec.model.options.get("experts") and model in VARIANTS:  # (not --ep's layouts)
        row["expert_shares"] = expert_shares(spec, data, result.step)
    print(f"{model:<6} {steps} steps: loss (last 50) {row['loss_last_50']}, "
          f"{row['tokens_per_s']:,} tokens/s (median)"
          + (f", expert shares {row['expert_shares']}" if "expert_shares" in row else ""), flush=True)
    return row


def expert_shares(spec, data: str, step: int, rows: int = 16) -> list[list[float]]:
    """Each block's share of the tokens of `rows` rows of the corpus that its router sends to
    each expert (a token's experts_per_token choices counted each), the trained model's."""
    import numpy as np
    import torch

    from baton.checkpoint import CheckpointStore
    from baton.data.local import read_corpus
    from baton.models import routed

    model = build_model(spec.model, 0)
    model.load_state_dict(CheckpointStore(spec.checkpoint_dir).read_model(step))
    model.train()(torch.from_numpy(np.array(read_corpus(data)[1][:rows, :-1])).long())  # (a
    # training forward, no backward: each block counts its choices, `load`; no dropout here)
    return [[round(float(c) / float(layer.load.sum()), 3) for c in layer.load] for layer in routed(model)]


def profile(model: str, passes: int = 10) -> dict:
    """torch's profiler over `passes` forward and backward passes of the job's model in this
    process (one thread, a micro-batch of 8 x 128), and the mean time of a pass over 3 x 30
    more: the self CPU time of the matrix products and of the elementwise multiplies."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile as profiled

    from baton.tasks import loss_sum

    torch.set_num_threads(1)
    net = build_model(load_spec(JOBS[model]).model, 0)
    x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss_sum(net(x[:, :-1]), x[:, 1:]).backward()
    for _ in range(3):
        step()
    with profiled(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(passes):
            step()
    ops = {e.key: e for e in p.key_averages()}
    ms = lambda *keys: round(sum(ops[k].self_cpu_time_total for k in keys if k in ops) / 1e3, 1)  # noqa: E731
    timed = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(30):
            step()
        timed.append((time.perf_counter() - t0) / 30 * 1e3)
    row = {"model": model, "passes": passes, "matmul_ms": ms("aten::mm", "aten::addmm"),
           "mul_ms": ms("aten::mul"), "mul_calls": ops["aten::mul"].count if "aten::mul" in ops else 0,
           "total_ms": round(sum(e.self_cpu_time_total for e in ops.values()) / 1e3, 1),
           "pass_ms": [round(t, 1) for t in timed]}
    print(f"{model:<6} over {passes} passes: matrix products {row['matmul_ms']} ms, aten::mul "
          f"{row['mul_ms']} ms in {row['mul_calls']} calls, all {row['total_ms']} ms; a pass "
          f"{', '.join(map(str, row['pass_ms']))} ms", flush=True)
    return row


def _tp_worker(rank: int, port: int, sequence: bool, rounds: int, passes: int, out: str) -> None:
    """One of two tp workers (gloo, one thread each): the job's llama split twice, as baton
    splits it (each block's q, k and v entering the split region through one collective,
    gate and up through another: `tp_entered`) and with a collective for each column layer
    (tp_entered emptied), forward and backward passes of a micro-batch of 8 x 128 timed in
    rounds that alternate which goes first; each pass's collectives counted."""
    import json
    import time

    import torch
    import torch.distributed as dist

    from baton.parallel.tensor import Shares, counted
    from baton.tasks import loss_sum

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    spec = load_spec(JOBS["llama"]).model
    nets = {}
    for way in ("once", "each"):
        net = build_model(spec, 0)
        if way == "each":
            for block in net[1:-1]:
                block.tp_entered = ()
        Shares(net, rank, 2, dist.group.WORLD, sequence=sequence)
        nets[way] = net
    x = torch.randint(0, 256, (8, 129), generator=torch.Generator().manual_seed(0))

    def step(net) -> None:
        loss_sum(net(x[:, :-1]), x[:, 1:]).backward()
    counts = {}
    for way, net in nets.items():
        with counted() as calls:
            step(net)
        counts[way] = dict(calls)
    times: dict = {way: [] for way in nets}
    for r in range(rounds):
        for way in (("once", "each") if r % 2 == 0 else ("each", "once")):
            for _ in range(3):
                step(nets[way])
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(passes):
                step(nets[way])
            times[way].append((time.perf_counter() - t0) / passes * 1e3)
    if rank == 0:
        Path(out).write_text(json.dumps({"counts": counts, "pass_ms": times}))
    dist.destroy_process_group()


def tensor_parallel(rounds: int = 5, passes: int = 20) -> list[dict]:
    """The llama's forward and backward pass at tp 2, plain and sequence parallel: its layers
    that share an input entering the split region through one collective against one each."""
    import json
    import socket

    import torch.multiprocessing as mp

    rows = []
    for sequence in (False, True):
        with socket.socket() as s, tempfile.TemporaryDirectory() as tmp:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_tp_worker, args=(port, sequence, rounds, passes, f"{tmp}/out.json"), nprocs=2)
            got = json.loads(Path(f"{tmp}/out.json").read_text())
        ratio = statistics.median(e / o for e, o in zip(got["pass_ms"]["each"], got["pass_ms"]["once"]))
        row = {"sequence_parallel": sequence, "collectives": got["counts"],
               "pass_ms": {k: [round(t, 1) for t in v] for k, v in got["pass_ms"].items()},
               "each_over_once": round(ratio, 3)}
        print(f"tp 2{' sp' if sequence else ''}: a pass {statistics.median(got['pass_ms']['once']):.1f} ms "
              f"with one collective per shared input ({got['counts']['once']}), "
              f"{statistics.median(got['pass_ms']['each']):.1f} ms with one per layer "
              f"({got['counts']['each']}): {ratio:.3f}x the time", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", help="the JSON written (default: results/llama_cpu.json, "
                    "with --experts results/llama_experts_cpu.json)")
    ap.add_argument("--profile", action="store_true", help="only profile each model's pass")
    ap.add_argument("--tp", action="store_true", help="only time the llama's pass at tp 2")
    ap.add_argument("--experts", action="store_true", help="the llama against a mixture of experts")
    ap.add_argument("--ep", action="store_true", help="a mixture under DDP, expert parallelism and ZeRO-3")
    args = ap.parse_args()
    if args.tp:
        write_result(HERE / "results" / "llama_tp_cpu.json", {"rows": tensor_parallel()})
        return
    if args.profile:
        rows = [profile(model) for model in JOBS]
        write_result(HERE / "results" / "llama_profile_cpu.json", {"rows": rows})
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = f"{tmp}/stdlib"
        prepare_stdlib(data, 128)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        ray.data.DataContext.get_current().enable_progress_bars = False

        def measure(model: str) -> dict:
            with tempfile.TemporaryDirectory(dir=tmp) as run_tmp:
                return run(model, data, run_tmp, args.steps, {**VARIANTS, **LAYOUTS}.get(model, []))
        variants = LAYOUTS if args.ep else VARIANTS if args.experts else JOBS
        runs = rotating(list(variants), args.rounds, measure)
        ray.shutdown()
    if args.experts:
        mixtures(runs, args)
        return
    if args.ep:
        layouts(runs, args)
        return
    speed = median_ratio(runs["llama"], runs["gpt"], "tokens_per_s")
    print(f"\n| model | parameters | loss, last 50 of {args.steps} steps (each round) | tokens/s (median of rounds) |")
    print("|---|---:|---|---:|")
    for model, rows in runs.items():
        print(f"| {model} | {rows[0]['parameters']:,} | {', '.join(str(r['loss_last_50']) for r in rows)} | "
              f"{statistics.median(r['tokens_per_s'] for r in rows):,.0f} |")
    print(f"\nllama / gpt tokens/s, median of each round's ratio: {speed:.3f}")
    write_result(args.out or HERE / "results" / "llama_cpu.json",
                 {"steps": args.steps, "rounds": args.rounds, "runs": runs,
                  "llama_over_gpt_tokens_per_s": round(speed, 3)})


def layouts(runs: dict, args) -> None:
    speeds = {m: median_ratio(runs[m], runs["ddp"], "tokens_per_s") for m in ("ep2", "zero3")}
    print(f"\n| layout (dp 2) | state per worker, MiB | loss, last 50 of {args.steps} steps (each round) "
          "| tokens/s (median of rounds) | tokens/s over DDP's (median of rounds' ratios) |")
    print("|---|---:|---|---:|---:|")
    for model, rows in runs.items():
        print(f"| {model} | {rows[0]['state_mib_per_worker']} | {', '.join(str(r['loss_last_50']) for r in rows)} | "
              f"{statistics.median(r['tokens_per_s'] for r in rows):,.0f} | {speeds.get(model, 1.0):.3f} |")
    write_result(args.out or HERE / "results" / "llama_ep_cpu.json",
                 {"steps": args.steps, "rounds": args.rounds, "runs": runs,
                  "over_ddp_tokens_per_s": {m: round(v, 3) for m, v in speeds.items()}})


def mixtures(runs: dict, args) -> None:
    speeds = {m: median_ratio(runs[m], runs["llama"], "tokens_per_s") for m in ("mixture", "balanced")}
    print(f"\n| model | parameters | loss, last 50 of {args.steps} steps (each round) | tokens/s (median of rounds) |")
    print("|---|---:|---|---:|")
    for model, rows in runs.items():
        print(f"| {model} | {rows[0]['parameters']:,} | {', '.join(str(r['loss_last_50']) for r in rows)} | "
              f"{statistics.median(r['tokens_per_s'] for r in rows):,.0f} |")
    for m, speed in speeds.items():
        print(f"{m} / llama tokens/s, median of each round's ratio: {speed:.3f}")
    for m in speeds:
        for i, shares in enumerate(runs[m][-1]["expert_shares"]):
            print(f"{m}, block {i + 1}: each expert's share of the tokens {shares}")
    write_result(args.out or HERE / "results" / "llama_experts_cpu.json",
                 {"steps": args.steps, "rounds": args.rounds, "runs": runs,
                  "over_llama_tokens_per_s": {m: round(v, 3) for m, v in speeds.items()}})


if __name__ == "__main__":
    main()
