"""Disk footprint of full mlflow against mlflow-skinny + sqlalchemy + alembic, beyond what
baton needs anyway (ray[data,default], torch, pyarrow, pandas, numpy, pyyaml).

Measures the installed environment: install both first (`pip install -e '.[ui]'` brings full
mlflow beside the skinny set), then

    python benchmarks/mlflow_footprint.py
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from results_io import write_result

DISTS = {d.metadata["Name"].lower().replace("_", "-"): d for d in md.distributions()}


def size_bytes(name: str) -> int:
    d = DISTS[name]
    return sum(os.path.getsize(p) for f in d.files or [] if os.path.exists(p := d.locate_file(f)))


def closure(names: list[str], extras: tuple[str, ...] = ("",)) -> set[str]:
    """The installed distributions these need, following requirements (and `extras` of the
    named ones)."""
    seen, stack = set(), [(n, extras) for n in names]
    while stack:
        name, wanted = stack.pop()
        name = name.lower().replace("_", "-")
        if name in seen or name not in DISTS:
            continue
        seen.add(name)
        for text in DISTS[name].requires or []:
            req = Requirement(text)
            if not req.marker or any(req.marker.evaluate({"extra": e}) for e in wanted):
                stack.append((req.name, ("",)))
    return seen


def main() -> int:
    missing = [n for n in ("mlflow", "mlflow-skinny", "ray", "torch") if n not in DISTS]
    if missing:
        print(f"install these first: {', '.join(missing)} (pip install -e '.[ui]')", file=sys.stderr)
        return 2
    base = closure(["ray"], ("", "data", "default")) | closure(["torch", "pyarrow", "pandas", "numpy", "pyyaml"])
    options = {"mlflow": closure(["mlflow"]) - base,
               "mlflow-skinny+sqlalchemy+alembic": closure(["mlflow-skinny", "sqlalchemy", "alembic"]) - base}
    result = {}
    print(f"{'option':34s} {'packages':>9s} {'MB':>7s}")
    for label, names in options.items():
        mb = sum(size_bytes(n) for n in names) / 1e6
        result[label] = {"packages": len(names), "mb": round(mb, 1), "names": sorted(names)}
        print(f"{label:34s} {len(names):>9d} {mb:>7.0f}")
    write_result("benchmarks/results/mlflow_footprint.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
