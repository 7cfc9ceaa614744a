"""What writing a checkpoint costs a worker's CPU, by part, this checkout against another.

A background save takes training's copy of the state off the training thread; what is left
competes with training for the host's cores: the write itself (serialising, the page cache,
fsync), the checksum each part's record carries, and, where replicas are compared, the
parameters' digest (on the training thread). On a 2-core machine two workers' writes used
about 2.4 s of CPU each per save of the 113 M GPT (docs/checkpoints.md), which is what keeps a
save every 10 steps below 0.97x of no checkpoints there.

Each round runs, in a fresh process for each checkout (alternating which goes first), with one
thread for torch's ops as a baton worker has, the 113 M GPT after one fused-AdamW step:
- replica: `CheckpointStore.write_tensors` of the model's and the optimizer's state dicts (a
  DDP or pipeline worker's parts);
- sharded: `sharded.save` of the same state in a world of one (a ZeRO worker's DCP files),
  with the records the commit needs;
- digest: `training.param_digest`, the replicas' comparison (on the training thread);
- verify: `CheckpointStore.verify` of both checkpoints, what a resume or a recovery from a
  checkpoint reads first.
CPU is the calling thread's (`time.thread_time`: every write here runs on it) and wall is
elapsed. Also the two checksums' speed on one core, over one 64 MiB buffer.

    python benchmarks/write_cost.py --rounds 3
    git worktree add /tmp/before <commit> && python benchmarks/write_cost.py --rounds 3 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KEYS = ("replica_cpu_s", "replica_wall_s", "sharded_cpu_s", "sharded_wall_s", "digest_s", "verify_s")


def one_round(layers: int, width: int) -> dict:
    """One round in this process (a child of `main`: PYTHONPATH picks the checkout)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from baton.checkpoint import CheckpointStore, sharded
    from baton.models import build_model
    from baton.spec import spec_from_dict
    from baton.training import param_digest

    torch.set_num_threads(1)
    spec = spec_from_dict({"name": "write-cost", "data": {"source": "stdlib"},
                           "model": {"name": "gpt", "layers": layers, "width": width, "heads": 12,
                                     "seq_len": 128},
                           "train": {"steps": 1, "global_batch": 1, "micro_batch": 1}})
    model = build_model(spec.model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, spec.model.vocab_size, (1, 129))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    out: dict = {"state_gb": round(sum(t.numel() * t.element_size() for t in model.state_dict().values())
                                   * 3 / 1e9, 3)}  # parameters and AdamW's two moments
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as root:
        store = CheckpointStore(root)
        store.begin(1)
        c0, t0 = time.thread_time(), time.perf_counter()
        parts = [store.write_tensors(1, "model-0000.pt", model.state_dict()),
                 store.write_tensors(1, "optim-0000.pt", opt.state_dict())]
        out |= {"replica_cpu_s": time.thread_time() - c0, "replica_wall_s": time.perf_counter() - t0}
        store.commit(1, {"step": 1, "layout": {"dp": 1, "pp": 1}}, keep=2, parts=parts)

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        model_state, optim_state = get_state_dict(model, opt)
        store.begin(2)
        c0, t0 = time.thread_time(), time.perf_counter()
        records = sharded.save({"model": model_state, "optim": optim_state["state"]}, store.shards(2))
        if records and isinstance(records[0], str):  # a checkout before 2026-11-26 returns the
            records = store.records(2, [f"shards/{n}" for n in records])  # names; its worker read them back
        out |= {"sharded_cpu_s": time.thread_time() - c0, "sharded_wall_s": time.perf_counter() - t0}
        dist.destroy_process_group()
        store.commit(2, {"step": 2, "layout": {"dp": 1, "pp": 1, "shard": "full"}}, keep=2, parts=records)

        t0 = time.perf_counter()
        param_digest(model)
        out["digest_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert store.verify(1) is None and store.verify(2) is None
        out["verify_s"] = time.perf_counter() - t0
    return out


def checksum_speeds() -> dict:
    import hashlib
    import zlib

    data = memoryview(os.urandom(64 << 20))
    speeds = {}
    for name, fn in [("sha256", lambda b: hashlib.sha256(b).digest()), ("crc32", zlib.crc32)] * 2:
        t0 = time.thread_time()
        for _ in range(4):
            fn(data)
        speeds[name] = round(4 * len(data) / (time.thread_time() - t0) / 1e9, 2)  # the second pass
    return speeds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--baseline", help="another checkout of baton, measured in the same rounds")
    p.add_argument("--out", default=str(HERE / "results" / "write_cost_cpu.json"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_round(args.layers, args.width)))
        return
    sys.path.insert(0, str(HERE))
    from results_io import write_result

    systems = {"baton": ROOT / "platform"}
    if args.baseline:
        systems["baseline"] = Path(args.baseline).resolve() / "platform"
    runs: dict = {name: [] for name in systems}
    for r in range(args.rounds):
        for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
            env = {**os.environ, "PYTHONPATH": str(systems[name])}
            done = subprocess.run([sys.executable, __file__, "--child", "--layers", str(args.layers),
                                   "--width", str(args.width)], env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {runs[name][-1][k]:.2f}" for k in KEYS), flush=True)
    rows = {name: {k: round(statistics.median(x[k] for x in v), 3) for k in KEYS} for name, v in runs.items()}
    speeds = checksum_speeds()
    gb = runs["baton"][0]["state_gb"]
    print(f"\n{gb:.2f} GB of state (parameters and AdamW's moments), {args.rounds} rounds, medians; "
          f"one core checksums SHA-256 at {speeds['sha256']} GB/s, CRC-32 at {speeds['crc32']} GB/s")
    print("| checkout | replica write: CPU, wall | sharded write and records: CPU, wall | digest | verify both |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['replica_cpu_s']:.2f} s, {row['replica_wall_s']:.2f} s | "
              f"{row['sharded_cpu_s']:.2f} s, {row['sharded_wall_s']:.2f} s | {row['digest_s']:.3f} s | "
              f"{row['verify_s']:.2f} s |")
    write_result(args.out, {"args": vars(args), "state_gb": gb, "checksum_gb_per_s": speeds,
                            "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
