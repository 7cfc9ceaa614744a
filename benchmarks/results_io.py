"""Where benchmark scripts put their results: JSON under benchmarks/results/, each with the
machine and the command that measured it."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def machine() -> dict:
    """What measured it: the command, the CPUs, and torch's version and accelerator when the
    script imported torch (never imported here just to say so)."""
    out = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
           "cpus": os.cpu_count(), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["device"] = torch.cuda.get_device_name()
    return out


def write_result(path: str | Path, result: dict, announce: bool = True) -> Path:
    """`announce`: say where it went (off for the partial results a script writes after each
    run, so that a run cut short by a time limit keeps what it measured)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "machine": result.get("machine") or machine()}, indent=2) + "\n")
    if announce:
        print(f"\nwrote {out}")
    return out
