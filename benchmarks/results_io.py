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


def rotating(keys: list, rounds: int, measure) -> dict:
    """Rounds of `measure(key)` for every key, in an order that rotates from round to round
    (round r starts with key r), so that no setting always runs first or after another on a
    shared, noisy machine; each key's results in round order."""
    runs: dict = {key: [] for key in keys}
    for r in range(rounds):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            runs[key].append(measure(key))
    return runs


def median_ratio(runs: list[dict], base: list[dict], field: str = "step_s") -> float:
    """The median over rounds of each round's `field` over the base setting's in that round."""
    import statistics

    return statistics.median(a[field] / b[field] for a, b in zip(runs, base))


def alternate(ways: tuple[str, str], rounds: int, measure) -> dict[str, list[dict]]:
    """Rounds of `measure(way)` for each of two ways, in an order that alternates from round
    to round. Each result holds `peak_rss_mib` and `step_s`, printed as it comes."""
    runs: dict[str, list[dict]] = {way: [] for way in ways}
    for r in range(rounds):
        for way in (ways if r % 2 == 0 else ways[::-1]):
            out = measure(way)
            runs[way].append(out)
            print(f"round {r + 1} {way}: peak resident {out['peak_rss_mib']:,.0f} MiB, "
                  f"step {out['step_s'] * 1000:.0f} ms", flush=True)
    return runs


def memory_table(runs: dict[str, list[dict]], label: str) -> dict:
    """Print each way's peak resident memory (each round and the median) and median step as
    a Markdown table; return the same as a dict for the JSON."""
    import statistics

    print(f"| {label} | peak resident memory, MiB (each round) | median | step, ms (median) |")
    print("|---|---|---:|---:|")
    table = {}
    for way, outs in runs.items():
        rss = [round(o["peak_rss_mib"]) for o in outs]
        steps = [o["step_s"] * 1000 for o in outs]
        table[way] = {"peak_rss_mib": rss, "median_peak_rss_mib": statistics.median(rss),
                      "median_step_ms": round(statistics.median(steps), 1)}
        print(f"| {way} | {', '.join(f'{x:,}' for x in rss)} | {statistics.median(rss):,.0f} | "
              f"{statistics.median(steps):.0f} |")
    return table
