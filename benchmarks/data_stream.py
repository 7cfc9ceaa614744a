"""The input stream: driver memory, object store, time to the first step and throughput as the
corpus grows, baton's streaming path against v0.5's in-memory one; and the cost of a seek.

For each corpus size (random byte tokens, 129-token rows, uncompressed, row groups of 4 MiB),
each system trains the quick-start model (GPT 4 x 128, dp 2, global batch 32) for `--steps`
steps in a child process of its own, on an embedded local Ray:

  stream   this tree
  v0.5     the last v0.5 commit (`--v05-ref`), checked out into a temporary git worktree and
           put first on PYTHONPATH (driver and workers); run only up to `--v05-max-gb`, since
           it holds the whole table in the driver (about 4 MiB per MiB of corpus)
  ray-train  the anchor users would pick instead: Ray Train's TorchTrainer, the corpus as
           `ray.data.read_parquet` handed to it as a dataset (which it splits with
           `streaming_split`), each worker iterating its shard; the same model, micro-batches,
           optimizer step and torch threads as baton, DDP from `prepare_model`. Its workers ask
           for 0.5 CPU each, so Ray Data's read tasks (1 CPU by default) can be scheduled
           beside them on 2 cores

Measured in each child: the driver's peak RSS over the run (the kernel's VmHWM, reset when the
run starts), the object store's peak (Ray's store stats, sampled every 0.25 s) and bytes
spilled, the time from `api.run` to the first completed step, the steady tokens/s (median of
the second half of the steps; for Ray Train, between step ends on rank 0, which include its
wait for data) and the median data-wait fraction. For the stream, also the time
for a fresh feed to have its first batch's row groups read at 0 % and at 50 % of an epoch.

    python benchmarks/data_stream.py                       # 0.2, 1 and 2 GB: about 10 minutes
    python benchmarks/data_stream.py --sizes-gb 0.2 1 2 10
    python benchmarks/data_stream.py --sizes-gb 1 --systems stream ray-train --rounds 5

With `--rounds N`, the systems run N times each per size, alternating which goes first, and
the ratios are taken round by round (each pair ran back to back) and summarised by their
median, min and max: one run of each is not enough on a shared 2-core machine (one such pair
measured 0.80, the next 1.01).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SEQ_LEN, ROW_GROUP_MIB, FILE_MIB = 128, 4, 256


def write_corpus(folder: Path, gb: float) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True)
    width, total_rows = SEQ_LEN + 1, int(gb * 1e9) // (SEQ_LEN + 1)
    rows_per_file = FILE_MIB * 2**20 // width
    rng, start, k = np.random.default_rng(0), 0, 0
    while start < total_rows:
        rows = min(rows_per_file, total_rows - start)
        tokens = pa.FixedSizeListArray.from_arrays(
            pa.array(rng.integers(0, 256, rows * width, dtype=np.uint8)), width)
        table = pa.table({"sample_id": pa.array(np.arange(start, start + rows)), "tokens": tokens})
        pq.write_table(table, folder / f"part-{k:05d}.parquet", compression="none",
                       row_group_size=ROW_GROUP_MIB * 2**20 // width)
        start, k = start + rows, k + 1


def spec_dict(data: Path, tmp: Path, steps: int) -> dict:
    return {"name": "stream", "data": {"source": "parquet", "path": str(data)},
            "model": {"name": "gpt", "layers": 4, "width": 128, "heads": 4, "seq_len": SEQ_LEN},
            "train": {"steps": steps, "global_batch": 32, "micro_batch": 8, "warmup_steps": 5},
            "parallel": {"dp": 2}, "resources": {"cpus_per_worker": 1},
            "checkpoint": {"path": str(tmp / "ckpt"), "every_steps": steps},
            "tracking": {"enabled": False}}


# -- in the child ---------------------------------------------------------------------------

def _hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _start_ray_and_watch_store() -> tuple[dict, threading.Event]:
    """An embedded local Ray, and a thread keeping the object store's peak use and spilled
    bytes (MiB, Ray's own store stats every 0.25 s) until the event is set."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    store, stop = {"used": 0.0, "spilled": 0.0}, threading.Event()

    def sample() -> None:
        address = get_state_from_address(ray.get_runtime_context().gcs_address)
        while not stop.is_set():
            stats = get_memory_info_reply(address).store_stats
            store["used"] = max(store["used"], stats.object_store_bytes_used / 2**20)
            store["spilled"] = max(store["spilled"], stats.spilled_bytes_total / 2**20)
            time.sleep(0.25)

    threading.Thread(target=sample, daemon=True).start()
    return store, stop


def child(data: Path, out: Path, steps: int, measure_seek: bool) -> None:
    import ray

    from baton import api
    from baton.spec import spec_from_dict

    store, stop = _start_ray_and_watch_store()
    first_step, waits = [], []

    def on_step(c) -> None:
        if not first_step:
            first_step.append(time.perf_counter() - t0)
        if "data_wait_fraction" in getattr(c, "last_metrics", {}):
            waits.append(c.last_metrics["data_wait_fraction"])

    with tempfile.TemporaryDirectory() as tmp:
        spec = spec_from_dict(spec_dict(data, Path(tmp), steps))
        Path("/proc/self/clear_refs").write_text("5")  # the peak of the run, not of ray.init
        t0 = time.perf_counter()
        result = api.run(spec, show_progress=False, on_step=on_step)
        driver = _hwm_mib()
    stop.set()
    import baton

    row = {"baton": str(Path(baton.__file__).parent), "driver_peak_mib": round(driver, 1), "store_peak_mib": round(store["used"], 1),
           "spilled_mib": round(store["spilled"], 1), "first_step_s": round(first_step[0], 2),
           "tokens_per_s": round(result.tokens_per_s, 1),
           "data_wait_fraction": round(statistics.median(waits), 4) if waits else None,
           "start_phases_s": getattr(result, "start", {}).get("phases_s")}  # v0.5 has none
    if measure_seek:
        row |= seek_times(spec)
    ray.shutdown()
    out.write_text(json.dumps(row))


def seek_times(spec) -> dict:
    """Seconds until a fresh feed has read the first batch's row groups, at 0 % and 50 %."""
    from baton.data import Cursor
    from baton.data.feed import DataFeed
    from baton.data.local import job_order
    from baton.data.manifest import Manifest
    from baton.data.source import columns

    manifest, order = Manifest.build(spec.data.path), job_order(spec)
    out = {}
    # the first read after the run starts Ray Data's task workers anew: an untimed warm-up at
    # 25 % keeps that out of whichever seek would come first
    warm = DataFeed(manifest, order, columns(spec))
    warm.prime(Cursor(0, manifest.num_samples // 4), spec.train.global_batch)
    warm.close()
    for label, at in (("seek_0pct_s", 0), ("seek_50pct_s", manifest.num_samples // 2)):
        feed = DataFeed(manifest, order, columns(spec))
        t0 = time.perf_counter()
        feed.prime(Cursor(0, at), spec.train.global_batch)
        out[label] = round(time.perf_counter() - t0, 2)
        out[label.replace("_s", "_rows_read")] = feed.rows_read
        feed.close()
    return out


def _ray_train_loop(config: dict) -> list[float]:
    """One worker of the anchor: baton's model and step on the rows of its streaming shard.
    Returns the wall-clock time of every step's end (rank 0's comes back from fit)."""
    import numpy as np
    import ray.train
    import ray.train.torch
    import torch

    from baton.models import build_model, loss_sum
    from baton.spec import spec_from_dict
    from baton.training import clip_and_norm, make_optimizer, set_lr

    torch.set_num_threads(1)
    spec = spec_from_dict(config["spec"])
    t, ctx = spec.train, ray.train.get_context()
    world = ctx.get_world_size()
    model = ray.train.torch.prepare_model(build_model(spec.model, t.seed))
    optimizer = make_optimizer(model, t)
    per_worker = t.global_batch // world
    batches = ray.train.get_dataset_shard("train").iter_batches(
        batch_size=per_worker, batch_format="pyarrow", drop_last=True)
    ends = []
    for step, table in zip(range(t.steps), batches):
        tokens = table.column("tokens").combine_chunks()
        rows = torch.from_numpy(np.asarray(tokens.flatten()).reshape(len(tokens), -1)).long()
        micro = rows.split(spec.micro_batch)
        scale = world / (t.global_batch * spec.model.seq_len)
        for i, data in enumerate(micro):
            with contextlib.nullcontext() if i == len(micro) - 1 else model.no_sync():
                (loss_sum(model(data[:, :-1]), data[:, 1:]) * scale).backward()
        set_lr(optimizer, t.lr_at(step))
        clip_and_norm(model, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.time())
    return ends


def ray_train_child(data: Path, out: Path, steps: int) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    store, stop = _start_ray_and_watch_store()
    with tempfile.TemporaryDirectory() as tmp:
        raw = spec_dict(data, Path(tmp), steps)
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.time()
        trainer = TorchTrainer(
            _ray_train_loop, train_loop_config={"spec": raw},
            datasets={"train": ray.data.read_parquet(str(data), columns=["tokens"])},
            scaling_config=ScalingConfig(num_workers=raw["parallel"]["dp"],
                                         resources_per_worker={"CPU": 0.5}),
            run_config=RunConfig(storage_path=f"{tmp}/ray_train", name="anchor"))
        ends = trainer.fit().return_value
        driver = _hwm_mib()
    stop.set()
    tokens = raw["train"]["global_batch"] * SEQ_LEN
    steady = [b - a for a, b in zip(ends, ends[1:])][len(ends) // 2:]
    row = {"driver_peak_mib": round(driver, 1), "store_peak_mib": round(store["used"], 1),
           "spilled_mib": round(store["spilled"], 1), "first_step_s": round(ends[0] - t0, 2),
           "tokens_per_s": round(tokens / statistics.median(steady), 1), "data_wait_fraction": None}
    ray.shutdown()
    out.write_text(json.dumps(row))


# -- the parent -----------------------------------------------------------------------------

def run_child(data: Path, steps: int, pythonpath: str | None, seek: bool, anchor: bool = False) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "disabled"))
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, __file__, "--child", str(data), out.name, "--steps", str(steps)]
        cmd += ["--seek"] if seek else []
        cmd += ["--ray-train"] if anchor else []
        subprocess.run(cmd, env=env, check=True, cwd=data.parent)
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-gb", type=float, nargs="+", default=[0.2, 1.0, 2.0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--v05-ref", default="f47cd5f")
    ap.add_argument("--v05-max-gb", type=float, default=2.0)
    ap.add_argument("--out", default=str(HERE / "results" / "data_stream_cpu.json"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--seek", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ray-train", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--anchor-max-gb", type=float, default=2.0,
                    help="run Ray Train's TorchTrainer + streaming_split up to this size")
    ap.add_argument("--systems", nargs="+", default=["stream", "v0.5", "ray-train"],
                    choices=["stream", "v0.5", "ray-train"])
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if args.child and args.ray_train:
        ray_train_child(Path(args.child[0]), Path(args.child[1]), args.steps)
        return
    if args.child:
        child(Path(args.child[0]), Path(args.child[1]), args.steps, args.seek)
        return

    sys.path.insert(0, str(HERE))
    from results_io import write_result

    rows = []
    with tempfile.TemporaryDirectory(prefix="baton-stream-") as tmp:
        v05 = Path(tmp) / "v05"
        if "v0.5" in args.systems:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(v05), args.v05_ref],
                           check=True, capture_output=True)
        try:
            for gb in args.sizes_gb:
                data = Path(tmp) / f"corpus-{gb:g}gb"
                write_corpus(data, gb)
                size_mib = sum(f.stat().st_size for f in data.iterdir()) / 2**20
                systems = [("stream", None)] + ([("v0.5", str(v05 / "platform"))]
                                                if gb <= args.v05_max_gb else [])
                systems += [("ray-train", None)] if gb <= args.anchor_max_gb else []
                systems = [s for s in systems if s[0] in args.systems]
                for r in range(args.rounds):
                    for system, path in systems[::-1] if r % 2 else systems:
                        anchor = system == "ray-train"
                        row = {"corpus_gb": gb, "corpus_mib": round(size_mib), "system": system,
                               "round": r, **run_child(data, args.steps, path,
                                                       seek=system == "stream" and r == 0, anchor=anchor)}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                for f in data.iterdir():
                    f.unlink()
        finally:
            if v05.exists():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(v05)],
                               capture_output=True)

    keys = ["corpus_gb", "system", "driver_peak_mib", "store_peak_mib", "spilled_mib",
            "first_step_s", "tokens_per_s", "data_wait_fraction", "seek_0pct_s", "seek_50pct_s"]
    print("\n" + " | ".join(keys))
    for row in rows:
        print(" | ".join(str(row.get(k, "")) for k in keys))
    ratios = {}
    for gb in args.sizes_gb:
        for other in ("v0.5", "ray-train"):
            per_round = []
            for r in range(args.rounds):
                pair = {x["system"]: x for x in rows if x["corpus_gb"] == gb and x["round"] == r}
                if "stream" in pair and other in pair:
                    per_round.append(pair["stream"]["tokens_per_s"] / pair[other]["tokens_per_s"])
            if per_round:
                ratios.setdefault(other, {})[f"{gb:g}gb"] = {
                    "median": round(statistics.median(per_round), 3), "min": round(min(per_round), 3),
                    "max": round(max(per_round), 3), "rounds": [round(x, 3) for x in per_round]}
    print(f"\nsteady tokens/s, stream / other, round by round: {json.dumps(ratios)}")
    write_result(args.out, {"benchmark": "data_stream", "steps": args.steps, "rounds": args.rounds, "rows": rows,
                            "tokens_per_s_ratio_stream_over": ratios,
                            "machine": {"cpus": os.cpu_count()}})


if __name__ == "__main__":
    main()
