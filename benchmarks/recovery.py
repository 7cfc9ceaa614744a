"""Recovery from a failure: baton against Ray Train's TorchTrainer, on one simulated cluster.

The cluster is `ray.cluster_utils.Cluster` on this machine: a head with no CPUs for training and
three worker nodes of one CPU each. Both systems train the same 2-worker data-parallel GPT on
the stdlib corpus, with the same batches, optimizer and a checkpoint every 5 steps. After step
12 a fault is injected from outside the training code:

  kill  SIGKILL to the process of worker rank 1
  node  the node holding worker rank 1 is removed from the cluster
  stop  SIGSTOP to the process of worker rank 1 (frozen: baton's elastic.hang_timeout_s is
        HANG_TIMEOUT_S for this fault; Ray Train has no heartbeat, so its survivor would
        wait out the collective's timeout, and it is not run with this fault)

Measured, per run: recovery time, from the fault to the first training step completed after
it; work lost, in steps (steps that had completed and were trained again); for baton, the
phases of its recovery (detect = from the fault to the coordinator declaring it). Ray Train
uses FailureConfig(max_failures=3): it restarts the whole worker group from the last reported
checkpoint. Systems alternate within each round; the machine is shared and noisy, so the ratio
is the median of each round's paired ratio.

Also measured for baton: scale-up latency, from a node joining a running dp=1 job (elastic
max_dp 2, rescale_check_s at its default of 10 s) to the first step completed at dp=2.

    python benchmarks/recovery.py                 # 2 rounds, about 6 minutes
    python benchmarks/recovery.py --faults stop --systems baton,baton_spare --out X.json
    python benchmarks/recovery.py --rounds 0 --systems baton --out X.json   # the scale-up alone

baton_continue is elastic.recovery continue (min_dp 1, no spare): its recovery time is to the
first step of the smaller world; what the smaller world and the growth back cost is
`benchmarks/recovery_continue.py`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray
import torch
from ray.cluster_utils import Cluster

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton import api, ray_settings  # noqa: E402
from baton.data import Cursor  # noqa: E402
from baton.data.local import job_order  # noqa: E402
from baton.data.corpus import prepare_stdlib  # noqa: E402
from baton.models import build_model, loss_sum  # noqa: E402
from baton.parallel import ParallelDims  # noqa: E402
from baton.spec import spec_from_dict  # noqa: E402
from baton.training import clip_and_norm, make_optimizer, set_lr  # noqa: E402
from results_io import write_result  # noqa: E402

FAULT_AFTER_STEP, EVERY = 12, 5
HANG_TIMEOUT_S = 4.0  # a frozen worker declared dead after this (the fault tests' figure)


def job(args, tmp: str, name: str, **extra) -> dict:
    return {
        "name": name,
        "model": {"name": "gpt", "layers": args.layers, "width": args.width, "heads": 4,
                  "seq_len": args.seq_len},
        "data": {"source": "parquet", "path": f"{tmp}/data"},
        "train": {"steps": args.steps, "global_batch": 16, "lr": 1e-3, "warmup_steps": 2, "seed": 0},
        "parallel": {"dp": 2, "timeout_s": 60},
        "resources": {"cpus_per_worker": 1},
        "checkpoint": {"path": f"{tmp}/ckpt-{time.time_ns()}", "every_steps": EVERY, "keep": 2},
        "tracking": {"uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "bench-recovery"},
        **extra,
    }


# -- the cluster --------------------------------------------------------------------------------

def start_cluster(workers_path: Path, logging_level: str = "WARNING") -> Cluster:
    """A head with no CPUs and three one-CPU worker nodes, with this process connected. The
    workers import from `workers_path`, after the caller's PYTHONPATH (a baseline's first)."""
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False,
                                      "_system_config": dict(ray_settings.SYSTEM_CONFIG)})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level=logging_level,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(
                 [p for p in (os.environ.get("PYTHONPATH"), str(workers_path)) if p])}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    return cluster


def worker_nodes(cluster: Cluster) -> list:
    return [n for n in cluster.list_all_nodes() if not n.head]


def set_worker_nodes(cluster: Cluster, n: int) -> None:
    nodes = worker_nodes(cluster)
    while len(nodes) > n:
        cluster.remove_node(nodes.pop())
    while len(nodes) < n:
        nodes.append(cluster.add_node(num_cpus=1))
    cluster.wait_for_nodes()
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU", 0) < n - 1e-9 and time.monotonic() < deadline:
        time.sleep(0.2)


def inject(cluster: Cluster, fault: str, pid: int, node_id: str) -> float:
    """The fault; returns its wall-clock time."""
    if fault in ("kill", "stop"):
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    else:
        (node,) = [n for n in worker_nodes(cluster) if n.node_id == node_id]
        cluster.remove_node(node)
    return time.time()


# -- baton --------------------------------------------------------------------------------------

def run_baton(cluster: Cluster, args, tmp: str, fault: str, spares: int = 0,
              recovery: str = "replace", on_step=None) -> dict:
    """baton; with `spares`, elastic.spares (checked every second): the third node holds a
    warm standby worker, which the fault is injected only once it is ready. With `recovery`
    continue (min_dp 1, no spare): the survivor trains on alone while its replacement starts.
    `fault` none: no fault (a reference run). `on_step(coordinator)` is called at every step."""
    elastic = {"max_failures": 3, **({"spares": spares, "rescale_check_s": 1} if spares else {}),
               **({"min_dp": 1, "recovery": recovery} if recovery != "replace" else {}),
               **({"hang_timeout_s": HANG_TIMEOUT_S} if fault == "stop" else {})}
    spec = spec_from_dict(job(args, tmp, f"baton-{fault}", elastic=elastic))
    seen: dict = {}

    def hook(c) -> None:
        if on_step:
            on_step(c)
        if fault == "none":
            return
        if spares and c.step == FAULT_AFTER_STEP - 4 and "spare" not in seen:
            # the spare ready well before the fault, so that waiting here shifts nothing
            deadline = time.monotonic() + 60
            while len(c.group.spares) < spares and time.monotonic() < deadline:
                time.sleep(0.1)
            seen["spare"] = ray.get([a.ready.remote() for a in c.group.spares], timeout=60)
        if c.step == FAULT_AFTER_STEP and "fault_at" not in seen:
            seen["done_before"] = c.step
            seen["fault_at"] = inject(cluster, fault, c.workers[1]["pid"], c.workers[1]["node"])
        elif "fault_at" in seen and "first_step_at" not in seen and any(
                e["kind"] == "recovery" for e in c.events):
            seen["first_step_at"] = time.time()
            seen["first_step"] = c.step

    result = api.run(spec, show_progress=False, log=lambda _: None, on_step=hook)
    if fault == "none":
        return {"events": result.events}
    failure = next(e for e in result.events if e["kind"] == "failure")
    recovery = next(e for e in result.events if e["kind"] == "recovery")
    return {"recovery_s": seen["first_step_at"] - seen["fault_at"], "fault_at": seen["fault_at"],
            "detect_s": failure["at"] - seen["fault_at"], "dp_history": result.dp_history,
            "phases_s": recovery["phases_s"], "cause": failure["cause"],
            "workers_reused": recovery["workers_reused"],
            "workers_from_spares": recovery.get("workers_from_spares", 0),
            "work_lost_steps": seen["done_before"] - recovery["resumed_from_step"]}


# -- Ray Train ----------------------------------------------------------------------------------

def _ray_train_loop(config: dict) -> None:
    """A plain DDP loop as a Ray Train user writes it: resume from the last checkpoint, report a
    checkpoint every `every` steps. Rank 0 logs each completed step to a file."""
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    from dp_throughput import load_tokens

    torch.set_num_threads(1)
    spec = spec_from_dict(config["spec"])
    t, log = spec.train, Path(config["log"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    (log / f"worker-{rank}.json").write_text(json.dumps(
        {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id()}))
    model = ray.train.torch.prepare_model(build_model(spec.model, t.seed))
    optimizer = make_optimizer(model, t)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(f"{d}/state.pt", weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
    tokens = load_tokens(config["data"], spec.model.seq_len)
    order, cursor, dims = job_order(spec), Cursor(), ParallelDims(world)
    for _ in range(start):
        order.next_batch(cursor, t.global_batch)
    for step in range(start, t.steps):
        batch = order.next_batch(cursor, t.global_batch)
        data = torch.from_numpy(tokens[dims.replica_part(batch, rank)]).long()
        loss = loss_sum(model(data[:, :-1]), data[:, 1:]) * world / (len(batch) * spec.model.seq_len)
        loss.backward()
        set_lr(optimizer, t.lr_at(step))
        clip_and_norm(model, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            with open(log / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "t": time.time(), "pid": os.getpid()}) + "\n")
        if (step + 1) % config["every"] == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(),
                                "step": step + 1}, f"{d}/state.pt")
                ray.train.report({"step": step + 1},
                                 checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)


def _steps(log: Path) -> list[dict]:
    path = log / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_ray_train(cluster: Cluster, args, tmp: str, fault: str) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    log = Path(tempfile.mkdtemp(prefix="rt-", dir=tmp))
    seen: dict = {}

    def injector() -> None:
        while not any(s["step"] >= FAULT_AFTER_STEP for s in _steps(log)):
            time.sleep(0.005)
        done = _steps(log)
        seen["done_before"], seen["pid0"] = done[-1]["step"], done[-1]["pid"]
        worker = json.loads((log / "worker-1.json").read_text())
        seen["fault_at"] = inject(cluster, fault, worker["pid"], worker["node"])

    if fault == "stop":
        raise SystemExit("recovery.py: Ray Train is not run with a frozen worker (--systems "
                         "baton,baton_spare): nothing of its own notices one")
    thread = threading.Thread(target=injector, daemon=True)
    thread.start()
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"spec": job(args, tmp, "rt"), "data": f"{tmp}/data", "log": str(log),
                           "every": EVERY},
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=f"{tmp}/ray_train", name=f"rt-{time.time_ns()}",
                             failure_config=FailureConfig(max_failures=3)))
    trainer.fit()
    thread.join(timeout=5)
    after = [s for s in _steps(log) if s["pid"] != seen["pid0"]]
    return {"recovery_s": after[0]["t"] - seen["fault_at"],
            "work_lost_steps": seen["done_before"] - (after[0]["step"] - 1)}


# -- scale-up -----------------------------------------------------------------------------------

def run_scale_up(cluster: Cluster, args, tmp: str) -> dict:
    set_worker_nodes(cluster, 1)
    raw = job(args, tmp, "baton-grow", elastic={"min_dp": 1, "max_dp": 2})
    raw["train"]["steps"] = args.grow_steps  # long enough to outlast a rescale check (every 10 s)
    spec = spec_from_dict(raw)
    seen: dict = {}

    def hook(c) -> None:
        if c.step == 5 and "joined_at" not in seen:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            seen["joined_at"], seen["joined_step"] = time.time(), c.step
        elif "joined_at" in seen and c.dims.dp == 2 and "first_step_at" not in seen:
            seen["first_step_at"], seen["grown_step"] = time.time(), c.step

    result = api.run(spec, show_progress=False, log=lambda _: None, on_step=hook)
    rescale = next((e for e in result.events if e["kind"] == "rescale"), None)
    if rescale is None:
        raise SystemExit(f"recovery.py: the scale-up run ended at step {result.step} before it "
                         "grew: raise --grow-steps")
    # training stops for the rescale's phases only (`stall_s`), less the steps that were
    # queued when it came due, which it trains first; the steps from the join to the growth's
    # first step are trained at dp 1 (`steps_meanwhile`, that first one included)
    return {"latency_s": seen["first_step_at"] - seen["joined_at"], "phases_s": rescale["phases_s"],
            "stall_s": rescale["total_s"] - rescale["phases_s"].get("queued_steps", 0.0),
            "steps_meanwhile": seen["grown_step"] - seen["joined_step"],
            "dp_history": result.dp_history}


# -- driver -------------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--grow-steps", type=int, default=1000,
                   help="the scale-up run's steps: enough to outlast a rescale check and a start")
    p.add_argument("--faults", default="kill,node")
    p.add_argument("--systems", default="baton,baton_spare,ray_train",
                   help="which to run (the ratios need ray_train)")
    p.add_argument("--out", default="benchmarks/results/recovery_cpu.json")
    args = p.parse_args()

    tmp = tempfile.mkdtemp(prefix="baton-bench-recovery-")
    os.environ.setdefault("RAY_TMPDIR", f"{tmp}/ray")
    prepare_stdlib(f"{tmp}/data", args.seq_len)
    cluster = start_cluster(HERE)
    systems = {"baton": run_baton, "baton_spare": lambda *a: run_baton(*a, spares=1),
               "baton_continue": lambda *a: run_baton(*a, recovery="continue"),
               "ray_train": run_ray_train}
    systems = {name: systems[name] for name in args.systems.split(",")}
    runs: dict = {f: {s: [] for s in systems} for f in args.faults.split(",")}
    try:
        for r in range(args.rounds):
            for fault in runs:
                order = list(systems) if r % 2 == 0 else list(systems)[::-1]
                for name in order:
                    set_worker_nodes(cluster, 3)
                    out = systems[name](cluster, args, tmp, fault)
                    runs[fault][name].append(out)
                    print(f"round {r + 1}: {fault:4s} {name:14s} recovery {out['recovery_s']:5.1f} s, "
                          f"work lost {out['work_lost_steps']} steps"
                          + (f", phases {out['phases_s']}" if "phases_s" in out else ""), flush=True)
        grow = run_scale_up(cluster, args, tmp) if "baton" in systems else None
        if grow:
            print(f"scale-up: {grow['latency_s']:.1f} s from a node joining to a step at dp=2, "
                  f"{grow['steps_meanwhile']} steps meanwhile; training stopped {grow['stall_s']:.2f} s "
                  f"(phases {grow['phases_s']})", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    print(f"\n{'fault':6s} {'system':10s} {'recovery s (median)':>20s} {'work lost (steps)':>18s} "
          f"{'baton / Ray Train':>18s}")
    summary: dict = {}
    runs = {fault: by for fault, by in runs.items() if all(by.values())}  # --rounds 0: none
    for fault, by in runs.items():
        ratios = {name: statistics.median(b["recovery_s"] / t["recovery_s"]
                                          for b, t in zip(by[name], by["ray_train"]))
                  for name in ("baton", "baton_spare", "baton_continue") if name in by and "ray_train" in by}
        for name, outs in by.items():
            med = statistics.median(o["recovery_s"] for o in outs)
            lost = statistics.median(o["work_lost_steps"] for o in outs)
            summary.setdefault(fault, {})[name] = {"recovery_s_median": med, "work_lost_median": lost}
            print(f"{fault:6s} {name:12s} {med:>18.2f} {lost:>18g} "
                  f"{(f'{ratios[name]:.2f}' if name in ratios else ''):>18s}")
        for name, ratio in ratios.items():
            summary[fault][f"{name}_vs_ray_train"] = ratio
    baton_phases = {f"{f} {name}": {k: statistics.median(o["phases_s"][k] for o in by[name])
                                    for k in by[name][0]["phases_s"]}
                    for f, by in runs.items() for name in ("baton", "baton_spare", "baton_continue")
                    if name in by}
    detect = {f: statistics.median(o["detect_s"] for o in by.get("baton") or by["baton_spare"])
              for f, by in runs.items() if "baton" in by or "baton_spare" in by}
    print(f"baton phases (median s): {baton_phases}; detect: {detect}")
    print(f"checkpoint every {EVERY} steps; fault after step {FAULT_AFTER_STEP}")
    write_result(args.out, {"config": vars(args), "ray": ray.__version__, "torch": torch.__version__,
                            "runs": runs, "summary": summary, "baton_phases_median_s": baton_phases,
                            "baton_detect_median_s": detect, "scale_up": grow,
                            "checkpoint_every": EVERY, "fault_after_step": FAULT_AFTER_STEP})
    return 0


if __name__ == "__main__":
    sys.exit(main())
