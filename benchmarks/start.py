"""From the command to the first completed training step: `baton run` against Ray Train's
`TorchTrainer`, the quick-start model on 2 workers, side by side in alternating rounds.

baton: `baton run jobs/quickstart.yaml --set train.steps=2` in a fresh folder each round (a
new user: a new MLflow store, the corpus already prepared), timed from the process's launch
to the "start: first step done" line, with the phases that line gives (from the run's start:
data, tracking, workers, form, load, first_step; the rest is Python's and baton's imports and
`ray.init`).

Ray Train: a fresh Python process that imports Ray and torch, starts a local Ray (2 CPUs, no
dashboard, as baton's embedded one), and fits a TorchTrainer of 2 workers whose loop builds
the same model, wraps it with `prepare_model` (DDP over gloo), reads its first batch from the
same Parquet corpus and takes one optimizer step; timed from the launch to that step's end
(a timestamp the loop writes).

    python benchmarks/start.py --rounds 3

`--baseline DIR` adds a third system, in the same alternating rounds: baton from another
checkout (its `platform/` first on PYTHONPATH, for the command and its Ray workers), to
measure a change side by side with the code before it:

    git worktree add /tmp/before <commit> && python benchmarks/start.py --rounds 5 --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from results_io import write_result  # noqa: E402

PHASES = re.compile(r"after ([\d.]+) s \((.*)\)")


def baton_start(data: str, work: Path, source: str | None = None) -> dict:
    """`source`: another checkout's `platform/` to run baton from (the baseline)."""
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": source} if source else None
    job = work / "job.yaml"
    job.write_text((REPO / "jobs" / "quickstart.yaml").read_text())
    t0 = time.monotonic()
    # `python -m baton.cli`: the `baton` command's code, whichever checkout is on the path
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "run", str(job), "--set",
                             "train.steps=2", "--set", f"data.path={data}"], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = {}
    for line in proc.stdout:
        if line.startswith("start:") and "to_first_step_s" not in out:
            out["to_first_step_s"] = round(time.monotonic() - t0, 2)
            out["cpu_s"] = cpu_seconds(proc.pid)
            total, phases = PHASES.search(line).groups()
            out["run_s"] = float(total)
            out["phases_s"] = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s", phases)}
        if ": finished at step " in line:
            finished = time.monotonic()
    proc.wait()
    assert proc.returncode == 0 and out, f"baton run failed ({proc.returncode})"
    out["before_run_s"] = round(out["to_first_step_s"] - out["run_s"], 2)  # imports, ray.init
    # the end: from the run's last line to the process's exit (Ray stopped before that line)
    out["finished_to_exit_s"] = round(time.monotonic() - finished, 2)
    out["to_exit_s"] = round(time.monotonic() - t0, 2)
    return out


def cpu_seconds(pid: int) -> dict:
    """CPU seconds (user + system) used so far by a process and everything it started (the
    embedded Ray's services and workers), by kind: what the start costs the machine."""
    import psutil

    root = psutil.Process(pid)
    used: dict[str, float] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            # a Ray worker's process title is ray::Worker.<method>, or ray::IDLE before its actor
            kind = ("driver" if p.pid == pid else
                    "workers" if p.cmdline()[:1] and p.cmdline()[0].startswith("ray::Worker") else
                    "ray_services")
            t = p.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        used[kind] = round(used.get(kind, 0.0) + t.user + t.system, 2)
    return used | {"total": round(sum(used.values()), 2)}


RAY_TRAIN_CHILD = r'''
import sys, time
import ray, torch, torch.nn.functional as F
import pyarrow.parquet as pq
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer, prepare_model
from baton.models import build_model
from baton.spec import load_spec

data, stamp, storage, job = sys.argv[1:5]

def loop(config):
    torch.set_num_threads(1)
    spec = load_spec(config["job"])
    model = prepare_model(build_model(spec.model, 0))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rank = ray.train.get_context().get_world_rank()
    import glob
    first = sorted(glob.glob(config["data"] + "/**/*.parquet", recursive=True))[0]
    rows = pq.ParquetFile(first).read_row_group(0, columns=["tokens"]).column(0)
    tokens = torch.tensor(rows.slice(rank * 16, 16).to_pylist())
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    opt.step()
    if rank == 0:
        open(config["stamp"], "w").write(repr(time.time()))

ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
TorchTrainer(loop, train_loop_config={"data": data, "stamp": stamp, "job": job},
             scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
             run_config=RunConfig(storage_path=storage, name="start")).fit()
'''


def ray_train_start(data: str, work: Path) -> dict:
    work.mkdir()
    stamp = work / "first_step"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-c", RAY_TRAIN_CHILD, data, str(stamp),
                           str(work / "storage"), str(REPO / "jobs" / "quickstart.yaml")],
                          cwd=work, capture_output=True, text=True)
    assert proc.returncode == 0 and stamp.exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    return {"to_first_step_s": round(float(stamp.read_text()) - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "start_cpu.json"))
    ap.add_argument("--baseline", help="another checkout of baton, run as a third system")
    args = ap.parse_args()
    runs = {"baton": [], "ray_train": []}
    starts = {"baton": baton_start, "ray_train": ray_train_start}
    if args.baseline:
        runs["baseline"] = []
        platform = str(Path(args.baseline).resolve() / "platform")
        starts["baseline"] = lambda data, work: baton_start(data, work, platform)
    with tempfile.TemporaryDirectory() as tmp:
        env_home = Path(tmp) / "home"
        env_home.mkdir()
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        data = f"{tmp}/stdlib-128"
        subprocess.run(["baton", "data", "prepare", "stdlib", "--out", data], check=True,
                       capture_output=True)
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for who in order:
                out = starts[who](data, Path(tmp) / f"{who}-{r}")
                runs[who].append(out)
                print(f"round {r + 1} {who}: {out['to_first_step_s']} s to the first step"
                      + (f" (before the run {out['before_run_s']} s, then {out['phases_s']}; "
                         f"CPU seconds {out['cpu_s']}); from its last line to its exit "
                         f"{out['finished_to_exit_s']} s" if who != "ray_train" else ""), flush=True)
    med = {k: statistics.median(x["to_first_step_s"] for x in v) for k, v in runs.items()}

    def paired(a: str, b: str) -> float:
        return round(statistics.median(x["to_first_step_s"] / y["to_first_step_s"]
                                       for x, y in zip(runs[a], runs[b])), 3)

    result = {"rounds": args.rounds, "median_s": med, "baton_vs_ray_train": paired("baton", "ray_train"),
              "runs": runs}
    ends = {k: statistics.median(x["finished_to_exit_s"] for x in v) for k, v in runs.items()
            if k != "ray_train"}
    result["median_finished_to_exit_s"] = ends
    print(f"\nmedian to the first step: baton {med['baton']:.1f} s, Ray Train {med['ray_train']:.1f} s; "
          f"baton / Ray Train (paired) {result['baton_vs_ray_train']:.2f}; baton's last line to "
          f"its exit {ends['baton']:.2f} s")
    if args.baseline:
        result |= {"baseline": args.baseline, "baton_vs_baseline": paired("baton", "baseline")}
        print(f"baseline ({args.baseline}) {med['baseline']:.1f} s; baton / baseline (paired) "
              f"{result['baton_vs_baseline']:.2f}; its last line to its exit {ends['baseline']:.2f} s")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
