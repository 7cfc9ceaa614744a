"""What lending room out of turn (backfill) gains and costs, side by side with a line that lends nothing.

On an embedded 2-CPU Ray, workers of 1 CPU each, all three jobs of one priority: `a` (dp 1)
holds one CPU; `x` (dp 2) comes and waits in line, one CPU being too little for it; `y`
(dp 1) comes after x. With backfill, y starts on the idle CPU out of turn once it has been
idle for 3 s (`priorities.BACKFILL_AFTER_S`), and gives it back when a ends (a checkpoint,
suspended; it goes on once x ends). Without (BACKFILL_AFTER_S set to infinity in this
process), y waits behind x. a and y are paced to 0.1 s a step (a job of longer steps than
this tiny model's); every job checks for claims each second (`elastic.rescale_check_s`).
Measured: when all three have ended and when y has (from y's arrival), the steps y trained
out of turn, and x's hand-off (from a's last step to x's first), which the backfill
lengthens by y's suspension.

    python benchmarks/backfill.py --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api  # noqa: E402
from baton.checkpoint import CheckpointStore  # noqa: E402
from baton.coordinator import priorities as line  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from priorities import job, rounds  # noqa: E402
from results_io import write_result  # noqa: E402

WAYS = ("backfill", "no backfill")
PACE_S = 0.1  # a's and y's step, at least


def measure(tmp: str, way: str, r: int) -> dict:
    line.BACKFILL_AFTER_S = 3.0 if way == "backfill" else float("inf")
    tag = f"{r}-{way.split()[0]}"
    checks = {"elastic": {"rescale_check_s": 1.0}}
    specs = {"a": spec_from_dict(job(tmp, f"a-{tag}", 150, parallel={"dp": 1}, **checks)),
             "x": spec_from_dict(job(tmp, f"x-{tag}", 40, **checks)),
             "y": spec_from_dict(job(tmp, f"y-{tag}", 200, parallel={"dp": 1}, **checks))}
    at, results = {}, {}

    def on_step(name, c):
        at.setdefault(f"{name}_first", time.monotonic())
        at[f"{name}_last"] = time.monotonic()
        if name in ("a", "y"):
            time.sleep(PACE_S)
        if name == "a" and c.step == 5 and "x" not in threads_started:
            start("x")
            _until(specs["x"], "queued")
            at["y_arrives"] = time.monotonic()
            start("y")

    def run(name):
        results[name] = api.run(specs[name], show_progress=False, on_step=lambda c: on_step(name, c))
        at[f"{name}_done"] = time.monotonic()

    threads_started: dict[str, threading.Thread] = {}

    def start(name):
        threads_started[name] = threading.Thread(target=run, args=(name,))
        threads_started[name].start()

    run("a")
    for t in threads_started.values():
        t.join()
    assert {n: r.state for n, r in results.items()} == {"a": "finished", "x": "finished", "y": "finished"}
    y_events = [e["kind"] for e in results["y"].events]
    assert y_events == (["backfill", "suspend", "resume"] if way == "backfill" else []), y_events
    t0 = at["y_arrives"]
    return {"all_done_s": round(max(at[f"{n}_done"] for n in specs) - t0, 3),
            "y_done_s": round(at["y_done"] - t0, 3),
            "y_out_of_turn_steps": next((e["step"] for e in results["y"].events if e["kind"] == "suspend"), 0),
            "x_handoff_s": round(at["x_first"] - at["a_last"], 3)}


def _until(spec, state: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (CheckpointStore(spec.checkpoint_dir).read_status() or {}).get("state") != state:
        assert time.monotonic() < deadline, f"{spec.name} never {state}"
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "backfill_cpu.json"))
    args = parser.parse_args()

    rows = rounds("backfill", WAYS, measure, args.rounds)

    keys = ("all_done_s", "y_done_s", "y_out_of_turn_steps", "x_handoff_s")
    table = {way: {k: round(statistics.median(row[k] for row in rows[way]), 2) for k in keys} for way in WAYS}
    print(f"\na (dp 1) holds one of 2 CPUs, x (dp 2) waits in line, y (dp 1) comes after it; "
          f"medians of {args.rounds} round{'s' * (args.rounds > 1)}, from y's arrival")
    print(f"{'':13s}{'all three done':>16s}{'y done':>10s}{'y steps out of turn':>21s}{'x hand-off':>12s}")
    for way, m in table.items():
        print(f"{way:13s}{m['all_done_s']:>14.2f} s{m['y_done_s']:>8.2f} s{m['y_out_of_turn_steps']:>21.0f}"
              f"{m['x_handoff_s']:>10.2f} s")
    lend, wait = table["backfill"], table["no backfill"]
    print(f"backfill / no backfill: all done {lend['all_done_s'] / wait['all_done_s']:.2f}x, "
          f"y done {lend['y_done_s'] / wait['y_done_s']:.2f}x, "
          f"x hand-off {lend['x_handoff_s'] - wait['x_handoff_s']:+.2f} s")
    write_result(args.out, {"rounds": rows, "medians": table, "pace_s": PACE_S, "rescale_check_s": 1.0,
                            "backfill_after_s": 3.0})


if __name__ == "__main__":
    main()
