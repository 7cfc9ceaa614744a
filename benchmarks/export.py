"""`baton export`'s memory and speed: a sharded checkpoint of a GPT-2-small-sized model (12 x
768, 85 M parameters, 340 MB of fp32), written as 4 workers write one (each its quarter of
every tensor, through DCP's two rounds), exported in one file, and in files of 50 and 20 MB
(which the exporter reads about a file's worth at a time), to a local folder and to S3
(moto's server on 127.0.0.1, in memory: the local network and moto's own speed, not a
cloud's); then `baton.load_model` (what `model.init_from` and `baton sample` read) of the
one-file export from each, and of one in files of 20 MB from S3 (moto reads a whole object
for each ranged request: a 1 MiB range of a 4, 64 and 256 MiB object took 4, 38 and 136 ms
here, so a large file's reads cost it what they would not cost S3). Each runs in a fresh process; printed: its peak resident memory
over the process's imports, its seconds, and the files.

    python benchmarks/export.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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
import baton, baton.checkpoint.export, pyarrow.fs, torch.distributed.checkpoint, baton.models.gpt
def hwm():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
job, out, most = sys.argv[1], sys.argv[2], int(sys.argv[3])
before = hwm()
t0 = time.perf_counter()
if job == "load":
    model = baton.load_model(out)
    got = {"files": len(baton.checkpoint.export.read_about(out)["files"]),
           "bytes": sum(t.numel() * 4 for t in model.state_dict().values())}
else:
    about = baton.export(job, out, max_shard_bytes=most)
    got = {"files": len(about["files"]), "bytes": about["bytes"]}
print(json.dumps({"seconds": time.perf_counter() - t0, **got, "before_kib": before, "peak_kib": hwm()}))
"""


def moto(root: Path):
    """moto's S3 server on 127.0.0.1 (the test extra's), a bucket `bench` in it; the query
    that reaches it and the server's process."""
    import pyarrow.fs as pafs

    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_EC2_METADATA_DISABLED="true")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=open(root / "moto.log", "w"), stderr=subprocess.STDOUT)
    query = f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
    for _ in range(100):
        try:
            fs, _ = pafs.FileSystem.from_uri(f"s3://bench?{query}&allow_bucket_creation=true")
            fs.create_dir("bench")
            return query, server
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("moto_server did not start")


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
    server = None
    try:
        job = write_checkpoint(root)
        query, server = moto(root)
        # way -> (where: local or s3, the job or "load", the most bytes a file holds)
        ways = {"one file": ("local", str(job), 5 * 10**9),
                "files of 50 MB": ("local", str(job), 50 * 10**6),
                "files of 20 MB": ("local", str(job), 20 * 10**6),
                "one file to S3": ("s3", str(job), 5 * 10**9),
                "files of 50 MB to S3": ("s3", str(job), 50 * 10**6),
                "load_model, local": ("local", "load", 0),
                "load_model, S3": ("s3", "load", 0),
                "load_model, S3, files of 20 MB": ("s3 in 20 MB", "load", 0)}
        # what the loads read: a one-file export in each place, and one in files of 20 MB
        sources = {"local": str(root / "source"), "s3": f"s3://bench/source?{query}",
                   "s3 in 20 MB": f"s3://bench/source-20?{query}"}
        for key, where in sources.items():
            subprocess.run([sys.executable, "-c", CHILD, str(job), where,
                            str(20 * 10**6 if "20 MB" in key else 5 * 10**9)],
                           env=_env(), capture_output=True, text=True, check=True)
        runs: dict[str, list[dict]] = {w: [] for w in ways}
        for r in range(args.rounds):
            for way in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
                where, what, most = ways[way]
                name = f"out-{r}-{list(ways).index(way)}"
                out = (sources[where] if what == "load" else
                       str(root / name) if where == "local" else f"s3://bench/{name}?{query}")
                done = subprocess.run([sys.executable, "-c", CHILD, what, out, str(most)],
                                      env=_env(), capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{way}: {done.stderr[-2000:]}")
                got = json.loads(done.stdout.strip().splitlines()[-1])
                got["added_mib"] = (got["peak_kib"] - got["before_kib"]) / 1024
                runs[way].append(got)
                print(f"round {r + 1} {way}: {got['files']} files, {got['seconds']:.2f} s, peak "
                      f"resident +{got['added_mib']:,.0f} MiB", flush=True)
                if what != "load" and where == "local":
                    shutil.rmtree(out)
        model_mib = runs["one file"][0]["bytes"] / 2**20
        print(f"\nmodel: {model_mib:,.0f} MiB of fp32 parameters, checkpoint written by {WORKERS} workers\n")
        print("| export or load | files | seconds (median) | peak resident added, MiB (median) | of the model |")
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
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1] / "platform"), os.environ.get("PYTHONPATH", "")])}


if __name__ == "__main__":
    main()
