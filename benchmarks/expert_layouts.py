"""Expert parallelism's layouts that CI leaves out for their cost, each against one process.

Each layout trains the tests' small Mixtral-kind llama (2 blocks, 4 experts, 2 a token, the
load-balancing loss) on a local Ray, then compares every parameter with one plain process
(`helpers.reference_run`: the CI tests' reference) and prints the largest difference; the
`kill` layouts SIGKILL rank 1 after step 3 and also report where the recovery took its state
from and whether every sample was trained once. CI runs dp 2, cp 2, pp 2 x tp 2, ZeRO-3 at
dp 4, dp 4 x pp 2 under ZeRO-2, dp 2 x tp 2 under ZeRO-3 and a killed holder under DDP
(`tests/integration/test_sharding.py`); these are the rest.

    python benchmarks/expert_layouts.py
    python benchmarks/expert_layouts.py --layouts zero2 kill-pp
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path[:0] = [str(HERE), str(TESTS), str(HERE.parent / "platform")]

MIXTRAL = {"name": "llama", "layers": 2, "width": 32, "heads": 4, "seq_len": 32,
           "options": {"kv_heads": 2, "hidden": 32, "experts": 4, "experts_per_token": 2,
                       "router_aux_loss": 0.1}}
# name: (parallel, steps, global batch)
LAYOUTS = {
    "zero2": ({"dp": 2, "ep": 2, "shard": "grads"}, 2, 16),
    "zero3-cp2": ({"dp": 2, "ep": 2, "cp": 2, "shard": "full"}, 2, 16),
    "pp2-cp2": ({"dp": 2, "ep": 2, "pp": 2, "cp": 2}, 2, 16),
    "pp2-zero3": ({"dp": 2, "ep": 2, "pp": 2, "shard": "full"}, 2, 16),
    "pp2-zero3-dp4": ({"dp": 4, "ep": 2, "pp": 2, "shard": "full"}, 2, 16),
    "pp2-tp2": ({"dp": 2, "ep": 2, "pp": 2, "tp": 2, "sequence_parallel": True}, 2, 16),
    "cp2-tp2": ({"dp": 2, "ep": 2, "cp": 2, "tp": 2, "sequence_parallel": True, "cp_attention": "ring"}, 2, 16),
    "pp2-tp2-zero3": ({"dp": 2, "ep": 2, "pp": 2, "tp": 2, "shard": "full"}, 2, 16),
    "kill-pp": ({"dp": 4, "ep": 2, "pp": 2}, 5, 16),
    "kill-pp-zero3": ({"dp": 4, "ep": 2, "pp": 2, "shard": "full"}, 5, 16),
    "kill-tp2": ({"dp": 4, "ep": 2, "tp": 2, "sequence_parallel": True}, 5, 16),
}


def _run(name: str, data: Path, tmp: Path) -> dict:
    import torch

    from baton import api
    from baton.checkpoint import CheckpointStore
    from baton.spec import spec_from_dict
    from helpers import killed_run, reference_run, tiny_spec

    parallel, steps, batch = LAYOUTS[name]
    kill = name.startswith("kill")
    model = dict(MIXTRAL, options=dict(MIXTRAL["options"]))
    if kill:  # (each forward slowed, so that the kill lands in step 4's first forward)
        model.update(name="helpers:slow_llama")
        model["options"]["seconds"] = 0.4
    raw = tiny_spec(tmp / name, data, name=name, model=model,
                    train={"steps": steps, "global_batch": batch, "micro_batch": 2,
                           "schedule": "constant"},
                    parallel={**parallel, "timeout_s": 60}, resources={"cpus_per_worker": 0.25},
                    checkpoint={"every_steps": 2, "keep": 10},
                    **({"elastic": {"max_failures": 1, "min_dp": parallel["dp"]}} if kill else {}))
    spec = spec_from_dict(raw)
    result = killed_run(spec, after=3, rank=1) if kill else api.run(spec, show_progress=False)
    row = {"layout": name, "parallel": parallel, "workers": len(result.workers),
           "state": result.state}
    if kill:
        recovery = next(e for e in result.events if e["kind"] == "recovery")
        ids = sorted(i for _, _, part in result.ledger for i in part)
        row.update(state_from=recovery["state_from"], resumed_from=recovery["resumed_from_step"],
                   every_sample_once=len(ids) == len(set(ids)) == steps * batch)
        spec = dataclasses.replace(spec, model=dataclasses.replace(
            spec.model, options={**spec.model.options, "seconds": 0}))
    got = CheckpointStore(spec.checkpoint_dir).read_model(steps)
    want, _, _ = reference_run(spec, data, steps=steps)
    row["largest_difference"] = max(float((got[n] - t).abs().max()) for n, t in want.items())
    row["bound"] = "rtol 1e-5, atol 4e-5 (the tests' default)"
    row["within"] = all(torch.allclose(got[n], t, rtol=1e-5, atol=4e-5) for n, t in want.items())
    return row


def main() -> int:
    import ray

    from helpers import write_dataset
    from results_io import write_result

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default=str(HERE / "results" / "expert_layouts_cpu.json"))
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="baton-ep-"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    data = write_dataset(tmp / "data", num_samples=96, seq_len=32)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}})
    try:
        rows = [_run(name, data, tmp) for name in args.layouts]
    finally:
        ray.shutdown()
    print("\n| layout | workers | largest parameter difference | within the tests' bound | recovery |")
    print("|---|---:|---:|---|---|")
    for r in rows:
        recovery = (f"{r['state_from']}, from step {r['resumed_from']}, every sample once: "
                    f"{r['every_sample_once']}" if "state_from" in r else "-")
        print(f"| {r['layout']} | {r['workers']} | {r['largest_difference']:.2g} | {r['within']} | {recovery} |")
    write_result(args.out, {"args": vars(args), "rows": rows})
    return 0 if all(r["within"] and r["state"] == "finished" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
