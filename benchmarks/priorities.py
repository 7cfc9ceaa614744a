"""How long a job of higher priority waits for room that a job of lower priority holds.

On an embedded 2-CPU Ray, workers of 1 CPU each, a job `hi` (dp 1, resources.priority 1)
starts three ways: on a free cluster; while an elastic job `lo` (min_dp 1, max_dp 2) holds
both CPUs at dp 2 (lo shrinks to dp 1 for it); and while a job `lo` that is not elastic holds
them (lo is suspended, and goes on once hi ends). Measured: hi's start, from `api.run` to its
first completed step (its phases), and what it costs lo: the stall of its shrink (the
`rescale` event, from the check that saw the claim to lo's next step), and how long it was
suspended and took to go on (its `resume` event). lo checks for claims every
`elastic.rescale_check_s` (1 s here; 10 s by default, which adds up to that to hi's wait).
A fourth way: hi at priority 0, which takes nothing, waits in line while lo (not elastic)
holds the CPUs, and starts when lo ends: measured from lo's last step to hi's first (the
hand-off: lo's last checkpoint and shutdown, hi's next look at the line, every second, and its
workers' start), beside hi's own start on a free cluster from its workers to its first step.

    python benchmarks/priorities.py --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from results_io import write_result  # noqa: E402

WAYS = ("free cluster", "lo shrinks", "lo suspended", "hi queued")


def job(tmp: str, name: str, steps: int, **sections) -> dict:
    spec = {
        "name": name,
        "model": {"name": "gpt", "layers": 2, "width": 64, "heads": 4, "seq_len": 64},
        "data": {"source": "parquet", "path": f"{tmp}/data"},
        "train": {"steps": steps, "global_batch": 16, "lr": 1e-3, "warmup_steps": 1, "seed": 0},
        "parallel": {"dp": 2, "timeout_s": 120},
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"path": f"{tmp}/ckpt-{name}", "every_steps": 1000, "keep": 1},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow-{name}.db", "experiment": "bench-priorities"},
    }
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


def after_tracking(start: dict) -> float:
    """A start's seconds from its workers to its first step (no data read, no MLflow)."""
    return sum(v for k, v in start["phases_s"].items() if k not in ("data", "tracking", "queued"))


def measure(tmp: str, way: str, r: int) -> dict:
    hi = spec_from_dict(job(tmp, f"hi-{r}-{way.split()[-1]}", 20, parallel={"dp": 1},
                            resources={"priority": 0 if way == "hi queued" else 1}))
    if way == "free cluster":
        result = api.run(hi, show_progress=False)
        return {"hi_start_s": result.start["total_s"], "hi_phases_s": result.start["phases_s"],
                "hi_workers_to_step_s": round(after_tracking(result.start), 3)}
    if way == "hi queued":
        return queued(tmp, hi, r)
    elastic = {"min_dp": 1, "max_dp": 2} if way == "lo shrinks" else {}
    lo = spec_from_dict(job(tmp, f"lo-{r}-{way.split()[-1]}", 2000,
                            elastic={**elastic, "rescale_check_s": 1.0}))
    ran, events = [], []
    hi_run = threading.Thread(target=lambda: ran.append(api.run(hi, show_progress=False)))

    def on_step(c):
        events[:] = c.events
        if not hi_run.ident and c.step >= 20 and c.dims.dp == 2:  # lo holds both CPUs
            hi_run.start()
        if hi_run.ident and (hi_run.is_alive() or c.dims.dp < 2):
            time.sleep(0.05)  # lo at a known pace until hi has ended and lo has its CPUs back
        if hi_run.ident and not hi_run.is_alive() and c.dims.dp == 2 and ran:
            raise _Done

    try:
        api.run(lo, show_progress=False, on_step=on_step)
    except _Done:
        pass
    hi_run.join()
    row = {"hi_start_s": ran[0].start["total_s"], "hi_phases_s": ran[0].start["phases_s"]}
    if way == "lo shrinks":
        shrink = next(e for e in events if e["kind"] == "rescale" and e.get("asked"))
        row["lo_stall_s"] = shrink["total_s"]
    else:
        resume = next(e for e in events if e["kind"] == "resume")
        row["lo_suspended_s"] = resume["suspended_s"]
        row["lo_resume_s"] = resume["total_s"]
    return row


def queued(tmp: str, hi, r: int) -> dict:
    """lo (dp 2, 60 steps) holds both CPUs; hi starts at lo's step 20 and waits in line; lo
    goes on once hi is in line, and ends."""
    from baton.checkpoint import CheckpointStore

    lo = spec_from_dict(job(tmp, f"lo-{r}-queued", 60))
    ran, at = [], {}

    def hi_step(c):
        at.setdefault("hi_first_step", time.monotonic())

    hi_run = threading.Thread(target=lambda: ran.append(api.run(hi, show_progress=False, on_step=hi_step)))

    def on_step(c):
        if c.step == 20:
            hi_run.start()
            while (CheckpointStore(hi.checkpoint_dir).read_status() or {}).get("state") != "queued":
                time.sleep(0.05)
        at["lo_last_step"] = time.monotonic()

    api.run(lo, show_progress=False, on_step=on_step)
    hi_run.join()
    return {"hi_start_s": ran[0].start["total_s"], "hi_phases_s": ran[0].start["phases_s"],
            "handoff_s": round(at["hi_first_step"] - at["lo_last_step"], 3)}


def rounds(name: str, ways: tuple[str, ...], measure, n: int) -> dict[str, list[dict]]:
    """`measure(tmp, way, round)` for each way, `n` rounds, the ways alternating in order, on
    an embedded 2-CPU Ray and the standard library's corpus in a temporary folder."""
    tmp = tempfile.mkdtemp(prefix=f"baton-bench-{name}-")
    prepare_stdlib(f"{tmp}/data", 64)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.data.DataContext.get_current().enable_progress_bars = False
    rows: dict[str, list[dict]] = {way: [] for way in ways}
    for r in range(n):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            rows[way].append(measure(tmp, way, r))
            print(f"round {r + 1} {way:13s} {rows[way][-1]}", flush=True)
    ray.shutdown()
    return rows


class _Done(Exception):
    """lo has its CPUs back: the measurement is over (its checkpoint and run are left)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "priorities_cpu.json"))
    args = parser.parse_args()

    rows = rounds("priorities", WAYS, measure, args.rounds)

    def med(way: str, key: str) -> float | None:
        values = [row[key] for row in rows[way] if key in row]
        return round(statistics.median(values), 2) if values else None

    print("\nhi (dp 1, priority 1) on a 2-CPU Ray held by lo; medians of "
          f"{args.rounds} round{'s' * (args.rounds > 1)}")
    print(f"{'':14s}{'hi: run to first step':>23s}{'lo: shrink stall':>18s}"
          f"{'lo: suspended':>15s}{'lo: resume':>12s}{'hand-off':>10s}")
    table = {}
    for way in WAYS:
        table[way] = {k: med(way, k) for k in ("hi_start_s", "lo_stall_s", "lo_suspended_s", "lo_resume_s",
                                               "handoff_s", "hi_workers_to_step_s")}
        cells = [f"{v:.2f} s" if v is not None else "-" for v in table[way].values()]
        print(f"{way:14s}{cells[0]:>23s}{cells[1]:>18s}{cells[2]:>15s}{cells[3]:>12s}{cells[4]:>10s}")
    free = table["free cluster"]["hi_start_s"]
    for way in WAYS[1:3]:
        print(f"hi's start, {way} / free cluster: {table[way]['hi_start_s'] / free:.2f}x")
    print(f"hand-off from lo's last step to hi's first: {table['hi queued']['handoff_s']:.2f} s; "
          f"hi's own start on a free cluster, workers to first step: "
          f"{table['free cluster']['hi_workers_to_step_s']:.2f} s")
    write_result(args.out, {"rounds": rows, "medians": table, "rescale_check_s": 1.0})


if __name__ == "__main__":
    main()
