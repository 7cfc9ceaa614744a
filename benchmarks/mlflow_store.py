"""A new sqlite MLflow store: made by MLflow's own migrations against made from baton's cached
template (`baton.tracking.store_template`), each in a fresh process with MLflow imported
first, in alternating rounds. Prints CPU and wall seconds of the store's making alone and
writes JSON.

    python benchmarks/mlflow_store.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_io import write_result

CHILD = r'''
import json, sys, time
from pathlib import Path
from mlflow.tracking import MlflowClient
from baton.tracking import store_template
how, folder = sys.argv[1], Path(sys.argv[2])
template = store_template.cached(folder / "cache")  # made by the parent beforehand
db = folder / f"{how}.db"
c0, t0 = time.process_time(), time.perf_counter()
if how == "template":
    store_template.open_new(db, template)
else:
    MlflowClient(tracking_uri=f"sqlite:///{db}").get_experiment("0")
print(json.dumps({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0}))
'''


def once(how: str, folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, how, str(folder)], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/mlflow_store_cpu.json")
    args = p.parse_args()
    ways = ["migrations", "template"]
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    with tempfile.TemporaryDirectory() as tmp:
        from baton.tracking import store_template

        store_template.cached(Path(tmp) / "cache")  # what a machine's first run makes
        for r in range(args.rounds):
            for how in ways if r % 2 == 0 else ways[::-1]:
                folder = Path(tmp) / f"{how}-{r}"
                folder.mkdir()
                (folder / "cache").symlink_to(Path(tmp) / "cache")
                runs[how].append(once(how, folder))
    med = {w: {k: statistics.median(x[k] for x in runs[w]) for k in ("cpu_s", "wall_s")} for w in ways}
    print(f"{'new store':<12} {'CPU s':>7} {'wall s':>7}   (medians of {args.rounds} fresh processes)")
    for w in ways:
        print(f"{w:<12} {med[w]['cpu_s']:>7.2f} {med[w]['wall_s']:>7.2f}")
    write_result(args.out, {"rounds": args.rounds, "median": med, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
