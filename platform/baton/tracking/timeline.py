"""A pipeline step's timeline: the bubble measured from it, a Chrome trace, a swimlane PNG.

Events come from `baton.parallel.pipeline` as (kind, micro-batch, stage, start, end) in
wall-clock seconds, kind one of F, B (compute), recv (waiting for a peer), send (posted until
seen complete). A lane is one worker, named by its (dp, pp) coordinates.
"""

from __future__ import annotations

import json
from typing import Iterable

Lane = tuple[int, int, list]  # (dp rank, pp rank, events)

COLOURS = {"F": "#4C72B0", "B": "#55A868", "recv": "#DDDDDD", "send": "#C44E52"}


def bubble(pipes: Iterable[list[dict]]) -> float:
    """Idle fraction of a step: for each pipeline (one per dp replica), 1 - busy / (p x span),
    span running from the first compute to the last on any of its ranks; averaged."""
    values = []
    for ranks in pipes:
        span = max(r["end"] for r in ranks) - min(r["start"] for r in ranks)
        if span > 0:
            values.append(1 - sum(r["busy_s"] for r in ranks) / (len(ranks) * span))
    return sum(values) / len(values) if values else 0.0


def chrome_trace(lanes: list[Lane], step: int, title: str = "") -> dict:
    """Chrome's trace-event format (chrome://tracing, https://ui.perfetto.dev): one process
    per data-parallel replica, one thread per pipeline rank, times in microseconds."""
    origin = min((e[3] for _, _, events in lanes for e in events), default=0.0)
    out = []
    for dp, pp, events in lanes:
        out.append({"name": "thread_name", "ph": "M", "pid": dp, "tid": pp,
                    "args": {"name": f"pp rank {pp}"}})
        for kind, mb, stage, t0, t1 in events:
            end = t1 if t1 is not None else t0
            out.append({"name": f"{kind} mb{mb}", "cat": kind, "ph": "X", "pid": dp, "tid": pp,
                        "ts": round((t0 - origin) * 1e6, 1),
                        "dur": round(max(0.0, end - t0) * 1e6, 1),
                        "args": {"micro_batch": mb, "stage": stage}})
    for dp in sorted({lane[0] for lane in lanes}):
        out.append({"name": "process_name", "ph": "M", "pid": dp,
                    "args": {"name": f"dp replica {dp}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"step": step, "title": title or f"pipeline step {step}"}}


def swimlane_png(lanes: list[Lane], path: str, title: str) -> None:
    """One row per worker; forward and backward boxes labelled with their micro-batch (and
    stage, where a rank holds several), receive waits in grey: the white space is the bubble."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.4), dpi=110)
    draw_swimlane(ax, lanes, title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def draw_swimlane(ax, lanes: list[Lane], title: str) -> None:
    import matplotlib.pyplot as plt

    lanes = sorted(lanes, key=lambda lane: (lane[0], lane[1]))
    origin = min((e[3] for _, _, events in lanes for e in events), default=0.0)
    for row, (dp, pp, events) in enumerate(lanes):
        several = len({e[2] for e in events if e[0] in ("F", "B")}) > 1  # interleaved chunks
        for kind, mb, stage, t0, t1 in events:
            if kind == "send" or t1 is None:
                continue
            x0, width = (t0 - origin) * 1e3, (t1 - t0) * 1e3
            height = 0.8 if kind in ("F", "B") else 0.3
            ax.broken_barh([(x0, width)], (row - height / 2, height), color=COLOURS[kind],
                           edgecolor="white" if kind in ("F", "B") else None, linewidth=0.5)
            if kind in ("F", "B") and width > 0:
                label = f"{kind}{mb}" + (f" s{stage}" if several else "")
                ax.text(x0 + width / 2, row, label, ha="center", va="center",
                        fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(len(lanes)), [f"dp{dp} pp{pp}" for dp, pp, _ in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first operation")
    ax.set_title(title, fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[k]) for k in ("F", "B", "recv")]
    ax.legend(handles, ["forward", "backward", "waiting for a peer"], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), fontsize=7, ncols=3, frameon=False)


def lanes_from_chrome(trace: dict) -> list[Lane]:
    """The lanes back from `chrome_trace`'s output (times in seconds from the step's start)."""
    lanes: dict[tuple[int, int], list] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0 = e["ts"] / 1e6
        lanes.setdefault((e["pid"], e["tid"]), []).append(
            (e["cat"], e["args"]["micro_batch"], e["args"]["stage"], t0, t0 + e["dur"] / 1e6))
    return [(dp, pp, events) for (dp, pp), events in sorted(lanes.items())]


def write_json(trace: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
