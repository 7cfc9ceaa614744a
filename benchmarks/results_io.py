"""Where benchmark scripts put their results: JSON under benchmarks/results/."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(path: str | Path, result: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    return out
