"""The chaos soak: one run, many faults of mixed kinds at seeded random steps, on a simulated
cluster (`ray.cluster_utils.Cluster`: a head with no CPUs and three one-CPU worker nodes).

The faults are those of tests/faults (`helpers.Chaos`): a worker SIGKILLed, a worker's node
removed (and a fresh node added), a worker frozen with SIGSTOP (declared dead after
elastic.hang_timeout_s), a worker killed half-way through writing a checkpoint (the workers
pause 0.5 s after each model part, through a Ray worker set-up hook; `--async` writes the
checkpoints in the background), a worker's node drained for a preemption (the GCS asked, as
`ray start` asks on SIGTERM: the run moves off it, no failure), and a tracking outage (the
run's MLflow server, a real `mlflow server`, killed and started again on its database 3 steps
later).

Reported: the faults survived, the samples lost or trained twice within an epoch (the ledger
of the steps that made the final model), the steps whose metrics reached MLflow other than
once, the largest parameter difference from the same job run without faults (dp 2 throughout)
and from one process (another summation order, which AdamW amplifies), and per worker fault
the time the coordinator took to notice it, the recovery's time from there to the first step
completed after it (its phases are in the JSON's events), and the completed steps trained
again; per drain, when the run moved off the node and how long training stopped for it.

    python benchmarks/chaos.py                    # 20 faults, about 4 minutes on 2 cores
    python benchmarks/chaos.py --faults 5 --seed 5 --async
    python benchmarks/chaos.py --spares 1        # recoveries served by a warm standby worker
    python benchmarks/chaos.py --recovery continue   # the survivors go on while replacements start
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TESTS))

from baton import api, ray_settings  # noqa: E402
from baton.checkpoint import CheckpointStore  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from helpers import Chaos, TrackingServer, free_ports, reference_run, tiny_spec, write_dataset  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from results_io import write_result  # noqa: E402

SAMPLES, BATCH = 40, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async", dest="background", action="store_true",
                   help="checkpoints written in the background (checkpoint.async)")
    p.add_argument("--spares", type=int, default=0,
                   help="warm standby workers (elastic.spares); the cluster has room for one")
    p.add_argument("--recovery", choices=("replace", "continue"), default="replace",
                   help="elastic.recovery: continue goes on with the survivors while a replacement starts")
    p.add_argument("--inline-kib", type=float, default=1.0,
                   help="objects up to this size live in their owner's memory, larger ones in "
                        "a node's object store (Ray's max_direct_call_object_size, 100 KiB by "
                        "default): at 1 KiB the 40-row corpus's row groups are in the nodes' "
                        "stores, where a removed node takes them along, as a real corpus's are")
    p.add_argument("--out", default=str(HERE / "results" / "chaos_cpu.json"))
    args = p.parse_args()
    steps = 8 + 5 * args.faults  # room for the schedule: faults 3 to 5 steps apart

    system = {**ray_settings.SYSTEM_CONFIG, "max_direct_call_object_size": int(args.inline_kib * 1024)}
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False, "_system_config": system})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", runtime_env={
        "env_vars": {"PYTHONPATH": str(TESTS)},
        "worker_process_setup_hook": "fault_hooks.pause_between_checkpoint_parts"})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "mlflow-server.log", "w") as log:
            tmp = Path(tmp)
            server = TrackingServer(str(tmp / "tracking.db"), free_ports(1)[0], log)
            server.start()
            data = write_dataset(tmp / "data", SAMPLES, 32)
            raw = tiny_spec(
                tmp, data, name="chaos",
                train={"steps": steps, "global_batch": BATCH, "micro_batch": None},
                parallel={"dp": 2, "timeout_s": 30}, resources={"cpus_per_worker": 1},
                checkpoint={"every_steps": 2, "keep": 3, "async": args.background},
                elastic={"min_dp": 1, "max_failures": 4 * args.faults, "hang_timeout_s": 4,
                         "rescale_check_s": 1, "spares": args.spares, "recovery": args.recovery})
            # the same job without faults, at dp 2 throughout: what the faulted run should equal
            clean = spec_from_dict({**raw, "name": "chaos-clean",
                                    "checkpoint": {**raw["checkpoint"], "path": str(tmp / "clean")}})
            api.run(clean, show_progress=False)
            unfaulted = CheckpointStore(clean.checkpoint_dir).read_model(steps)
            spec = spec_from_dict({**raw, "tracking": {
                "uri": f"http://127.0.0.1:{server.port}", "experiment": "chaos", "flush_every_s": 0.01}})
            chaos = Chaos(cluster, faults=args.faults, steps=steps, every_steps=2, seed=args.seed,
                          checkpoint_dir=spec.checkpoint_dir, tracking=server)
            t0 = time.monotonic()
            try:
                result = api.run(spec, record_samples=True, show_progress=False, on_step=chaos)
                wall_s = time.monotonic() - t0
                chaos.finish()
                logged = Counter(m.step for m in MlflowClient(spec.tracking.uri).get_metric_history(
                    result.run_id, "loss"))
            finally:
                server.kill()
            got = CheckpointStore(spec.checkpoint_dir).read_model(steps)
            want, _, _ = reference_run(spec, data, steps=steps)
    finally:
        ray.shutdown()
        cluster.shutdown()

    per_epoch = SAMPLES // BATCH
    seen = Counter((step // per_epoch, i) for step, _, ids in result.ledger for i in ids)
    twice = sum(n - 1 for n in seen.values() if n > 1)
    lost = sum(SAMPLES - sum(1 for (e, _) in seen if e == epoch) for epoch in range(steps // per_epoch))
    worst = max(float((got[n] - w).abs().max()) for n, w in want.items())
    off_unfaulted = max(float((got[n] - w).abs().max()) for n, w in unfaulted.items())
    by_step = Counter(step for step, _, _ in result.ledger)
    bad_epochs = sorted({e for (e, _), n in seen.items() if n > 1})
    print(f"steps in the ledger: {len(by_step)} of {steps}; entries per step {sorted(set(by_step.values()))}; "
          f"epochs with a sample twice: {bad_epochs}")
    recoveries = [e for e in result.events if e["kind"] == "recovery"]
    moves = [e for e in result.events if e["kind"] == "move"]
    failures = [e for e in result.events if e["kind"] == "failure"]
    rows = []
    not_once = [step for step in range(1, steps + 1) if logged[step] != 1]
    print(f"steps whose metrics reached MLflow other than once: {not_once}")
    for fault in chaos.injected:  # the first recovery that followed it
        if fault["kind"] == "tracking":
            print(f"step {fault['step']:3d} tracking: the MLflow server killed, back {Chaos.OUTAGE_STEPS} "
                  "steps later")
            rows.append(fault)
            continue
        if fault["kind"] == "drain":  # no failure: the move off the node, and what it stopped
            notice = next(e for e in result.events if e["kind"] == "drain" and e["wall_time"] >= fault["at"])
            move = next((m for m in moves if m["resumed_from_step"] >= notice["step"]), None)
            rows.append({**fault, "recovered_s": move and round(move["total_s"], 2),
                         "detect_s": round(notice["wall_time"] - fault["at"], 2),
                         "steps_retrained": 0 if move else None, "state_from": move and "move"})
            print(f"step {fault['step']:3d} drain  rank {fault['rank']}: moved at step "
                  f"{notice['step']}, {rows[-1]['detect_s']} s after the notice (its replacement "
                  f"started meanwhile), training stopped {rows[-1]['recovered_s']} s, 0 completed "
                  "steps trained again")
            continue
        after = next((r for r in recoveries if r["after_failure_at_step"] > fault["step"]), None)
        seen_at = next((f["at"] for f in failures if f["at"] >= fault["at"]), None)
        rows.append({**fault, "recovered_s": after and round(after["total_s"], 2),
                     # from the fault to the coordinator's noticing it (a frozen worker: the
                     # hang timeout); recovered_s is counted from there
                     "detect_s": seen_at and round(seen_at - fault["at"], 2),
                     # the failure's step was running: the one before it had completed
                     "steps_retrained": after and after["after_failure_at_step"] - 1 - after["resumed_from_step"],
                     "state_from": after and after["state_from"]})
        print(f"step {fault['step']:3d} {fault['kind']:6s} rank {fault['rank']}: noticed after "
              f"{rows[-1]['detect_s']} s, {rows[-1]['recovered_s']} s from there to the next step, "
              f"{rows[-1]['steps_retrained']} "
              f"completed steps trained again (state from {rows[-1]['state_from']})")
    timed = [r for r in rows if r["kind"] != "tracking"]
    mean_s = sum(r["recovered_s"] or 0 for r in timed) / len(timed)
    mean_detect_s = sum(r["detect_s"] or 0 for r in timed) / len(timed)
    by_kind = {kind: round(statistics.median(r["recovered_s"] or 0 for r in timed if r["kind"] == kind), 2)
               for kind in sorted({r["kind"] for r in timed})}
    print("median recovery by kind of fault (s): " + ", ".join(f"{k} {v}" for k, v in by_kind.items()))
    print("\n| faults | failures seen | finished | samples lost | samples twice | steps not logged once "
          "| largest difference from the unfaulted run (dp 2) | from one process | mean time lost per "
          "worker fault | wall |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {len(chaos.injected)} | {len(failures)} | {result.state == 'finished'} | {lost} | {twice} | "
          f"{len(not_once)} | {off_unfaulted:.2g} | {worst:.2g} | {mean_s:.1f} s | {wall_s:.0f} s |")
    write_result(args.out, {"args": vars(args), "steps": steps, "finished": result.state == "finished",
                            "failures": len(failures), "samples_lost": lost, "samples_twice": twice,
                            "steps_not_logged_once": not_once,
                            "max_param_diff": worst, "max_param_diff_unfaulted": off_unfaulted, "mean_time_lost_s": mean_s,
                            "mean_detect_s": mean_detect_s, "median_recovery_by_kind_s": by_kind,
                            "wall_s": wall_s,
                            "faults": rows, "events": result.events,
                            "ledger": [(step, rank, list(map(int, ids))) for step, rank, ids in result.ledger]})
    return 0 if result.state == "finished" and not lost and not twice and not not_once else 1


if __name__ == "__main__":
    raise SystemExit(main())
