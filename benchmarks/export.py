"""`baton export`'s memory and speed: a sharded checkpoint of a GPT-2-small-sized model (12 x
768, 85 M parameters, 340 MB of fp32), written as 4 workers write one (each its quarter of
every tensor, through DCP's two rounds), exported in one file, and in files of 50 MB (which
the exporter reads about a file's worth at a time). Each export runs in a fresh process;
printed: its peak resident memory over the process's imports, its seconds, and the files.

    python benchmarks/export.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import write_result  # noqa: E402

MODEL = {"name": "gpt", "layers": 12, "width": 768, "heads": 12, "seq_len": 1024, "vocab_size": 256}
WORKERS = 4

# Run in a child: the export, and the peak resident memory it added over the imports
# (VmHWM, this process's own peak: ru_maxrss carries the parent's across fork and exec)
CHILD = """
import json, sys, time
import baton, safetensors.torch, torch.distributed.checkpoint
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
job, out, most = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = hwm()
t0 = time.perf_counter()
about = baton.export(job, out, max_shard_bytes=most)
print(json.dumps({"seconds": time.perf_counter() - t0, "files": len(about["files"]),
                  "bytes": about["bytes"], "before_kib": before, "peak_kib": hwm()}))
"""


def write_checkpoint(root: Path) -> Path:
    """A committed sharded checkpoint of MODEL at step 1, in the layout 4 FSDP workers give
    it (each a quarter of every tensor's rows), and the job file that names it."""
    import torch
    import yaml

    from baton.checkpoint import CheckpointStore, sharded
    from baton.models import build_model
    from baton.spec import ModelSpec

    job = {"name": "export-bench", "model": MODEL, "data": {"source": "parquet", "path": str(root / "data")},
           "checkpoint": {"path": str(root / "ckpt")}, "tracking": {"uri": f"sqlite:///{root / 'm.db'}"}}
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    from baton import load

    spec = load(str(root / "job.yaml"))
    state = build_model(ModelSpec(**MODEL), 0).state_dict()
    store = CheckpointStore(spec.checkpoint_dir)
    store.begin(1)
    where = store.shards(1)

    def quarter(t: torch.Tensor, w: int):
        rows = -(-t.shape[0] // WORKERS)
        lo, hi = min(w * rows, t.shape[0]), min((w + 1) * rows, t.shape[0])
        return sharded.Pieces(list(t.shape), [([lo] + [0] * (t.dim() - 1), t[lo:hi])] if hi > lo else [])

    saves = [sharded.PlannedSave({"model": {n: quarter(t, w) for n, t in state.items()}}, where)
             for w in range(WORKERS)]
    plans, finish = sharded.plan_globally(where, [s.plan() for s in saves])
    written = [s.write(p) for s, p in zip(saves, plans)]
    parts = [p for _, records in written for p in records] + finish([r for r, _ in written])
    store.commit(1, {"step": 1, "layout": {"pp": 1}}, keep=1, parts=parts)
    return root / "job.yaml"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="baton-export-"))
    try:
        job = write_checkpoint(root)
        ways = {"one file": 5 * 10**9, "files of 50 MB": 50 * 10**6, "files of 20 MB": 20 * 10**6}
        runs: dict[str, list[dict]] = {w: [] for w in ways}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[1] / "platform"), os.environ.get("PYTHONPATH", "")])}
        for r in range(args.rounds):
            for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                out = root / f"out-{r}-{len(runs[way])}-{way[:3]}"
                done = subprocess.run([sys.executable, "-c", CHILD, str(job), str(out), str(ways[way])],
                                      env=env, capture_output=True, text=True, check=True)
                got = json.loads(done.stdout.strip().splitlines()[-1])
                got["added_mib"] = (got["peak_kib"] - got["before_kib"]) / 1024
                runs[way].append(got)
                print(f"round {r + 1} {way}: {got['files']} files, {got['seconds']:.2f} s, peak "
                      f"resident +{got['added_mib']:,.0f} MiB", flush=True)
                shutil.rmtree(out)
        model_mib = runs["one file"][0]["bytes"] / 2**20
        print(f"\nmodel: {model_mib:,.0f} MiB of fp32 parameters, checkpoint written by {WORKERS} workers\n")
        print("| export | files | seconds (median) | peak resident added, MiB (median) | of the model |")
        print("|---|---:|---:|---:|---:|")
        table = {}
        for way, outs in runs.items():
            added = statistics.median(o["added_mib"] for o in outs)
            secs = statistics.median(o["seconds"] for o in outs)
            table[way] = {"files": outs[0]["files"], "seconds": round(secs, 2),
                          "added_mib": round(added, 1), "of_model": round(added / model_mib, 3),
                          "rounds": outs}
            print(f"| {way} | {outs[0]['files']} | {secs:.2f} | {added:,.0f} | {added / model_mib:.2f} |")
        write_result(Path(__file__).parent / "results" / "export_cpu.json",
                     {"model": MODEL, "model_mib": round(model_mib, 1), "workers": WORKERS, "ways": table})
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
