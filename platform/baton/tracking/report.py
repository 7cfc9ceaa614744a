"""`baton report`: a run's pictures, from what MLflow holds of it.

One PNG (and an HTML page embedding it): the loss curve with the held-out loss beside it
(eval_loss, and each mixed corpus's, eval_loss/NAME), throughput, the world size over time
with failure and rescale markers, the largest worker's memory (runs that logged it), and the
pipeline swimlane of a traced step (pp > 1). The
coordinator logs the same files as MLflow artifacts (report/) when a run ends, so a run's
pictures are beside its metrics, and the traced step's swimlane beside its Chrome trace;
`baton report` rebuilds them for any run, running or done.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from baton.errors import BatonError
from baton.tracking import timeline
from baton.tracking.metrics import MEMORY_LABEL, MEMORY_MIB

RUN_ID = re.compile(r"[0-9a-f]{32}")
ARTIFACT_DIR = "report"
_EVENT_KEYS = ("cause", "message", "from_dp", "dp", "state_from", "total_s", "why", "loss",
               "median", "rewound_to", "batches_skipped")  # shown per event
SOURCE_COLORS = ["#8C564B", "#E377C2", "#17BECF", "#BCBD22", "#9467BD"]  # a mix's held-out losses


@dataclass
class Report:
    png: str
    html: str
    run_id: str
    points: dict[str, int] = field(default_factory=dict)  # plotted points per series
    trace: Optional[tuple] = field(default=None, repr=False)  # (step, lanes, title) drawn
    sweep: bool = False  # a sweep's picture (points: per trial)

    @property
    def swimlane_step(self) -> Optional[int]:
        return self.trace[0] if self.trace else None


def find_run(client, run: str):
    """An MLflow run by id, or the newest run whose name is `run` (baton names a run after
    its job)."""
    if RUN_ID.fullmatch(run):
        try:
            return client.get_run(run)
        except Exception as e:  # MlflowException: not found
            raise BatonError(f"no MLflow run {run} at {client.tracking_uri} ({e})") from None
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, filter_string=f"attributes.run_name = '{run}'",
                              order_by=["attributes.start_time DESC"], max_results=1) \
        if experiments else []
    if not runs:
        raise BatonError(f"no MLflow run named {run!r} (a job name) or with that id at "
                         f"{client.tracking_uri}; set --tracking-uri or $MLFLOW_TRACKING_URI")
    return runs[0]


def _history(client, run_id: str, key: str) -> tuple[list[int], list[float]]:
    points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
    return [s for s, _ in points], [v for _, v in points]


def _events(client, run_id: str) -> list[dict]:
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = client.download_artifacts(run_id, "events.json", tmp)
            with open(path) as f:
                return json.load(f)
    except Exception:  # no events.json: a run without failures or rescales
        return []


def _trace(client, run_id: str, step: Optional[int]) -> Optional[tuple[int, list, str]]:
    """The traced step `step` (or the first traced step): (step, its lanes, its title)."""
    try:
        found = [a.path for a in client.list_artifacts(run_id, "pipeline")]
    except Exception:
        return None
    steps = sorted(int(p.rsplit("_", 1)[1]) for p in found if re.search(r"step_\d+$", p))
    if not steps:
        return None
    if step is None:
        step = steps[0]
    elif step not in steps:
        raise BatonError(f"step {step} has no pipeline trace; traced steps: {steps} "
                         "(tracking.trace_step chooses one)")
    with tempfile.TemporaryDirectory() as tmp:
        path = client.download_artifacts(run_id, f"pipeline/step_{step:06d}/trace.json", tmp)
        with open(path) as f:
            trace = json.load(f)
    title = trace.get("otherData", {}).get("title", f"pipeline step {step}")
    return step, timeline.lanes_from_chrome(trace), title


def build(client, run, out_dir: str, swimlane_step: Optional[int] = None) -> Report:
    """Draw `run` (an MLflow Run) into out_dir/report.png and out_dir/report.html."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_id = run.info.run_id
    name = run.info.run_name or run_id
    loss = _history(client, run_id, "loss")
    # the held-out losses: over all held-out data, and each source's of a mix (eval_loss/NAME);
    # with train.ema, the average of the weights' (eval_ema_loss)
    held = {key: _history(client, run_id, key) for key in sorted(run.data.metrics)
            if key in ("eval_loss", "eval_ema_loss") or key.startswith("eval_loss/")}
    tps = _history(client, run_id, "tokens_per_s")
    world = _history(client, run_id, "world_size")
    memory = {kind: _history(client, run_id, name) for kind, name in MEMORY_MIB.items()}
    memory = {kind: points for kind, points in memory.items() if points[0]}
    events = _events(client, run_id)
    trace = _trace(client, run_id, swimlane_step)
    if not loss[0]:
        raise BatonError(f"run {run_id} ({name}) has no logged steps yet")

    heights = [1, 1, 0.8] + ([0.8] if memory else []) + ([1.3] if trace else [])
    fig, axes = plt.subplots(len(heights), 1, figsize=(11, 2.6 * len(heights) + (0.5 if trace else 0)),
                             dpi=100, gridspec_kw={"height_ratios": heights})
    ax_loss, ax_tps, ax_world = axes[:3]
    plotted = [ax_loss, ax_tps, ax_world]
    if memory:
        ax_memory = axes[3]
        for kind, (steps, mib) in memory.items():
            ax_memory.plot(steps, mib, lw=1.0, label=MEMORY_LABEL[kind])
        ax_memory.set_ylabel("MiB, largest\nworker")
        ax_memory.set_ylim(0, 1.15 * max(max(mib) for _, mib in memory.values()))  # off the frame
        ax_memory.legend(loc="lower right", fontsize=7, frameon=False, ncols=len(memory))
        plotted.append(ax_memory)
    ax_loss.plot(*loss, color="#4C72B0", lw=1.2, marker="." if len(loss[0]) <= 60 else None,
                 label="loss" if held else None)
    sources = iter(SOURCE_COLORS * len(held))
    for key, (steps, values) in held.items():
        whole = key in ("eval_loss", "eval_ema_loss")
        ax_loss.plot(steps, values, lw=1.0, marker="o", ms=3,
                     ls="-" if key == "eval_loss" else "--" if whole else ":",
                     color="#222222" if whole else next(sources),
                     label=key.replace("eval_ema_loss", "held-out, average").replace("eval_loss", "held-out", 1))
    if held:
        ax_loss.legend(loc="upper right", fontsize=7, frameon=False, ncols=len(held) + 1)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{name}: {len(loss[0])} steps, final loss {loss[1][-1]:.4f}  "
                      f"(MLflow run {run_id[:8]})", loc="left", fontsize=10)
    ax_tps.plot(*tps, color="#55A868", lw=1.0)
    # (a task other than next-token prediction counts samples: tokens_per_s is samples/s)
    ax_tps.set_ylabel("tokens/s" if run.data.params.get("task", "language_model") == "language_model"
                      else "samples/s")
    ax_world.step(*world, where="mid", color="#8172B2", lw=1.5)  # step s's world, around s
    ax_world.set_ylabel("workers")
    ax_world.set_xlabel("step")
    ax_world.set_ylim(0, max(world[1] or [1]) + 1)
    marked = set()
    for e in events:
        # between two steps: a failure during step s (at s - 0.5), a recovery or a rescale
        # that resumed from step s (at s + 0.5)
        kind = e["kind"]
        if "step" in e:
            step = e["step"] - 0.5
        elif "resumed_from_step" in e:
            step = e["resumed_from_step"] + 0.5
        else:
            continue
        style = {"failure": ("#C44E52", "--"), "rescale": ("#DD8452", ":"),
                 "recovery": ("#937860", "-."), "early_stop": ("#000000", "-"),
                 "spike": ("#DA8BC3", "--")}.get(kind, ("grey", ":"))
        label = None if kind in marked else kind
        marked.add(kind)
        for ax in plotted:
            ax.axvline(step, color=style[0], ls=style[1], lw=1, label=label if ax is ax_world else None)
    if marked:
        ax_world.legend(loc="lower right", fontsize=7, frameon=False, ncols=len(marked))
    for ax in plotted:
        ax.grid(alpha=0.3)
    if trace:
        step, lanes, _ = trace
        timeline.draw_swimlane(axes[-1], lanes, f"pipeline step {step}")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "report.png")
    fig.savefig(png)
    points = {"loss": len(ax_loss.lines[0].get_xdata()), "tokens_per_s": len(ax_tps.lines[0].get_xdata()),
              "world_size": len(ax_world.lines[0].get_xdata()),
              **{MEMORY_MIB[kind]: len(series[0]) for kind, series in memory.items()},
              **{key: len(series[0]) for key, series in held.items()}}
    plt.close(fig)
    page = os.path.join(out_dir, "report.html")
    with open(page, "w") as f:
        f.write(_html(name, run, png, events))
    return Report(png=png, html=page, run_id=run_id, points=points,
                  trace=trace)


def _html(name: str, run, png: str, events: list[dict]) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in sorted(run.data.params.items())[:200])
    listed = "".join(
        f"<tr><td>{html.escape(e['kind'])}</td>"
        f"<td>{e.get('step', e.get('resumed_from_step', ''))}</td>"
        f"<td>{html.escape(', '.join(f'{k}: {v}' for k, v in e.items() if k in _EVENT_KEYS))}</td></tr>"
        for e in events)
    return _page(name, run, png, "loss, throughput, world size, memory",
                 (f"<h2>Events</h2><table><tr><th>event</th><th>step</th><th>what</th></tr>"
                  f"{listed}</table>" if events else "")
                 + f"<h2>Parameters</h2><table>{rows}</table>")


def _page(name: str, run, png: str, alt: str, body: str) -> str:
    """A report's HTML page: its title, the run, the picture (embedded), then `body`."""
    with open(png, "rb") as f:
        image = base64.b64encode(f.read()).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>baton report: "
            f"{html.escape(name)}</title></head><body style='font-family:sans-serif'>"
            f"<h1>{html.escape(name)}</h1><p>MLflow run {run.info.run_id}, status "
            f"{run.info.status}</p><img alt='{html.escape(alt)}' "
            f"src='data:image/png;base64,{image}' style='max-width:100%'>{body}</body></html>")


def build_any(client, run, out_dir: str, swimlane_step: Optional[int] = None) -> Report:
    """`build` for a job's run, `build_sweep` for a sweep's (tracking/sweep.py)."""
    from baton.tracking.sweep import TAG

    if run.data.tags.get(TAG):
        return build_sweep(client, run, out_dir)
    return build(client, run, out_dir, swimlane_step)


def _sweep_trials(client, run) -> list[dict]:
    """A sweep's trials as its end recorded them (`sweep.json`: best first), or, while it
    runs, the runs nested under it so far (by name, with their state unknown)."""
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with open(client.download_artifacts(run.info.run_id, "sweep.json", tmp)) as f:
                return json.load(f)["trials"]
    except Exception:  # not ended yet (or by a version that wrote none)
        nested = client.search_runs([run.info.experiment_id],
                                    filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")
        return [{"name": r.info.run_name, "run_id": r.info.run_id, "state": "?"} for r in nested]


def build_sweep(client, run, out_dir: str) -> Report:
    """A sweep's picture (out_dir/report.png and report.html): the sweep's metric over the
    steps, a line a trial (those cut short dashed, each ending in a dot where it stopped, the
    best thick), and its trials' table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_id, name = run.info.run_id, run.info.run_name or run.info.run_id
    metric = run.data.tags.get("metric", "loss")
    trials = _sweep_trials(client, run)
    best = run.data.tags.get("best_trial")
    curves = {t["name"]: _history(client, t["run_id"], metric) for t in trials if t.get("run_id")}
    curves = {trial: points for trial, points in curves.items() if points[0]}
    if not curves:
        raise BatonError(f"sweep run {run_id} ({name}) has no trial with a logged {metric} yet")
    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    last = max(steps[-1] for steps, _ in curves.values())
    for t in trials:
        if t["name"] not in curves:
            continue
        steps, values = curves[t["name"]]
        top = t["name"] == best
        line, = ax.plot(steps, values, lw=2.4 if top else 1.0, alpha=1.0 if top else 0.75,
                        ls="-" if steps[-1] == last else "--", zorder=3 if top else 2,
                        label=f"{t['name']} (best)" if top else None)
        ax.plot(steps[-1:], values[-1:], "o", ms=4, color=line.get_color(), zorder=3)
    if best in curves:
        ax.legend(loc="upper right", fontsize=8, frameon=False)
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{name}: {len(curves)} trials, {metric} over the steps each trained; dashed: cut "
                 f"short  (MLflow run {run_id[:8]})", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "report.png")
    fig.savefig(png)
    plt.close(fig)
    keys = ["name", "values", "bracket", "state", "step", metric, "run_id"]
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(t.get(k, '')))}</td>" for k in keys) + "</tr>"
                   for t in trials)
    page = os.path.join(out_dir, "report.html")
    with open(page, "w") as f:
        f.write(_page(name, run, png, f"each trial's {metric}", "<h2>Trials, best first</h2><table><tr>"
                      + "".join(f"<th>{html.escape(k)}</th>" for k in keys) + f"</tr>{rows}</table>"))
    return Report(png=png, html=page, run_id=run_id, sweep=True,
                  points={trial: len(points[0]) for trial, points in curves.items()})


def log_to_run(client, run_id: str) -> Optional[Report]:
    """Build the report of `run_id` and log it as its artifacts (report/), and the traced
    step's swimlane beside its Chrome trace (pipeline/step_N/swimlane.png); nothing for a run
    that ended before its first step."""
    from baton.tracking.sweep import TAG

    run = client.get_run(run_id)
    if not run.data.tags.get(TAG) and not client.get_metric_history(run_id, "loss"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        rep = build_any(client, run, tmp)
        client.log_artifacts(run_id, tmp, ARTIFACT_DIR)
    if rep.trace:
        step, lanes, title = rep.trace
        with tempfile.TemporaryDirectory() as tmp:
            timeline.swimlane_png(lanes, f"{tmp}/swimlane.png", title)
            client.log_artifacts(run_id, tmp, f"pipeline/step_{step:06d}")
    return rep
