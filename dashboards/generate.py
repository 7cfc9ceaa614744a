"""Writes baton's Grafana dashboards (the JSON files beside this script) from one description.

    python dashboards/generate.py          # rewrite them
    python dashboards/generate.py --check  # exit 1 if a committed file differs (the tests do this)

Every query names metrics from `baton.tracking.metrics` (`ray_baton_*`, as Ray exports them)
and filters on the `job_name` variable; the Prometheus data source is the `datasource` variable.
Gauges of a resumed job come from a new driver process (a new WorkerId label), so panels take
`max by (job_name)` rather than the raw series.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "platform"))

from baton.tracking.metrics import METRICS  # noqa: E402

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = '{job_name=~"$job_name"}'
RATE = "$__rate_interval"


def m(name: str, suffix: str = "") -> str:
    """The exported series of metric `name` (checked against the registry)."""
    assert name in METRICS, name
    return f"ray_{name}{suffix}"


def gauge(name: str) -> str:
    return f"max by (job_name) ({m(name)}{SEL})"


def by_rank(name: str, *more: str) -> str:
    """A worker's series (`baton_rank_*`): one line a rank, on whichever driver exported it."""
    return f"max by ({', '.join(('job_name', 'rank', 'node', *more))}) ({m(name)}{SEL})"


def quantile(q: float, name: str, by: str = "job_name") -> str:
    return (f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({m(name, '_bucket')}{SEL}[{RATE}])))")


def mean(name: str, by: str = "job_name") -> str:
    return (f"sum by ({by}) (rate({m(name, '_sum')}{SEL}[{RATE}])) / "
            f"sum by ({by}) (rate({m(name, '_count')}{SEL}[{RATE}]))")


# Rare events (failures, recoveries, rescales, checkpoint loads) are drawn over the whole run,
# not as rates: Ray exports a series first with its first event, so a window never sees it
# rise from 0 (increase() is 0 and a quantile of rate() NaN for the first failure of each
# cause; found by a real Prometheus answering these queries in the tests)
def quantile_so_far(q: float, name: str, by: str = "job_name") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) ({m(name, '_bucket')}{SEL}))"


def mean_so_far(name: str, by: str = "job_name") -> str:
    return (f"sum by ({by}) ({m(name, '_sum')}{SEL}) / "
            f"sum by ({by}) ({m(name, '_count')}{SEL})")


def total(name: str, by: str) -> str:
    return f"sum by (job_name, {by}) ({m(name, '_total')}{SEL})"


def timeseries(title: str, description: str, targets: list[tuple[str, str]], unit: str = "short",
               w: int = 12, h: int = 8, bars: bool = False, max_: float | None = None) -> dict:
    custom = {"drawStyle": "bars" if bars else "line", "lineWidth": 1,
              "fillOpacity": 80 if bars else 10, "showPoints": "never" if not bars else "auto",
              "spanNulls": False}
    defaults = {"unit": unit, "custom": custom}
    if max_ is not None:
        defaults.update({"min": 0, "max": max_})
    return {"type": "timeseries", "title": title, "description": description, "datasource": DS,
            "gridPos": {"w": w, "h": h},
            "targets": [{"refId": chr(65 + i), "datasource": DS, "expr": expr,
                         "legendFormat": legend, "range": True}
                        for i, (expr, legend) in enumerate(targets)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True,
                                   "calcs": []},
                        "tooltip": {"mode": "multi", "sort": "desc"}}}


def stat(title: str, description: str, expr: str, unit: str = "short", w: int = 4,
         decimals: int | None = None) -> dict:
    defaults: dict = {"unit": unit}
    if decimals is not None:
        defaults["decimals"] = decimals
    return {"type": "stat", "title": title, "description": description, "datasource": DS,
            "gridPos": {"w": w, "h": 4},
            "targets": [{"refId": "A", "datasource": DS, "expr": expr, "legendFormat": "{{job_name}}",
                         "instant": True}],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"graphMode": "area", "colorMode": "value", "justifyMode": "auto",
                        "textMode": "auto", "wideLayout": True, "showPercentChange": False,
                        "percentChangeColorMode": "standard", "orientation": "auto",
                        "reduceOptions": {"calcs": ["lastNotNull"], "values": False, "fields": ""}}}


def layout(panels: list[dict]) -> list[dict]:
    """Ids in order, and grid positions flowing left to right, top to bottom."""
    x = y = row_h = 0
    for i, p in enumerate(panels, start=1):
        p["id"] = i
        g = p["gridPos"]
        if x + g["w"] > 24:
            x, y, row_h = 0, y + row_h, 0
        g["x"], g["y"] = x, y
        x, row_h = x + g["w"], max(row_h, g["h"])
    return panels


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    return {
        "uid": uid, "title": title, "description": description, "tags": ["baton", "ray"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "schemaVersion": 41, "version": 1,
        "links": [{"title": "baton dashboards", "type": "dashboards", "tags": ["baton"],
                   "asDropdown": True, "icon": "external link", "includeVars": True,
                   "keepTime": True, "targetBlank": False, "tooltip": "", "url": ""}],
        "annotations": {"list": [{
            "name": "Rescales and recoveries", "enable": True, "iconColor": "orange",
            "datasource": DS,
            "expr": f"max by (job_name) (changes({m('baton_world_size')}{SEL}[1m])) > 0",
            "step": "30s", "titleFormat": "world size changed", "textFormat": "{{job_name}}"}]},
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Prometheus",
             "query": "prometheus", "current": {"text": "Prometheus", "value": "prometheus"}},
            {"type": "query", "name": "job_name", "label": "job", "datasource": DS,
             "query": "label_values(ray_baton_step, job_name)",
             "definition": "label_values(ray_baton_step, job_name)",
             "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*", "sort": 1,
             "current": {"text": "All", "value": "$__all"}}]},
        "panels": layout(panels),
    }


def training() -> dict:
    return dashboard("baton-training", "baton: training", "Is my job training, how fast, and "
                     "how well does it use the hardware?", [
        stat("Step", "Optimizer steps completed.", gauge("baton_step"), decimals=0),
        stat("Loss", "Mean training loss of the last step.", gauge("baton_loss"), decimals=3),
        stat("Tokens/s", "Training throughput of the whole job.", gauge("baton_tokens_per_second"),
             unit="short"),
        stat("MFU", "Model FLOPs per second over the workers' peak (set "
             "tracking.cpu_peak_tflops for CPU workers).", gauge("baton_mfu"), unit="percentunit"),
        stat("Workers alive", "Workers running in the job's world.", gauge("baton_workers_alive"),
             decimals=0),
        stat("Failures", "Worker failures seen since the job started.",
             f"sum by (job_name) ({m('baton_failures', '_total')}{SEL})", decimals=0),
        timeseries("Loss", "Falling means learning; a jump after a recovery means state was "
                   "lost.", [(gauge("baton_loss"), "{{job_name}}")]),
        timeseries("Throughput", "Tokens and samples per second; drops show failures, "
                   "checkpoints and slow workers.",
                   [(gauge("baton_tokens_per_second"), "{{job_name}} tokens/s"),
                    (gauge("baton_samples_per_second"), "{{job_name}} samples/s")]),
        timeseries("Step time", "Median and 90th percentile of the optimizer step.",
                   [(quantile(0.5, "baton_step_seconds"), "{{job_name}} p50"),
                    (quantile(0.9, "baton_step_seconds"), "{{job_name}} p90")], unit="s"),
        timeseries("Learning rate", "The schedule the coordinator hands the workers.",
                   [(gauge("baton_learning_rate"), "{{job_name}}")]),
        timeseries("MFU", "Model FLOPs utilisation over time.",
                   [(gauge("baton_mfu"), "{{job_name}}")], unit="percentunit", max_=1),
        timeseries("World size", "Workers in the world and alive: they differ while a failure "
                   "is being recovered.",
                   [(gauge("baton_world_size"), "{{job_name}} world size"),
                    (gauge("baton_workers_alive"), "{{job_name}} alive")]),
        timeseries("Worker memory", "The largest worker's resident host memory and, on GPUs, "
                   "its peak of device memory allocated in the step: the worker that runs out "
                   "first.", [(f"max by (job_name, kind) ({m('baton_worker_memory_bytes')}{SEL})",
                               "{{job_name}} {{kind}}")], unit="bytes"),
        timeseries("Compute by worker", "Each worker's computation in the last step, without "
                   "its waits for peers (data parallel, ZeRO-1, pipelines on CPU): every step "
                   "waits for the slowest; compare the workers doing the same work (a "
                   "pipeline's stages differ).",
                   [(by_rank("baton_rank_compute_seconds"), "{{job_name}} rank {{rank}} ({{node}})")],
                   unit="s"),
        timeseries("Data wait by worker", "Seconds each worker spent getting its batch in the "
                   "last step: one far above the others reads from a slow disk or node.",
                   [(by_rank("baton_rank_data_wait_seconds"), "{{job_name}} rank {{rank}} ({{node}})")],
                   unit="s"),
        timeseries("Memory by worker", "Each worker's resident host memory and, on GPUs, its "
                   "peak of device memory allocated in the step.",
                   [(by_rank("baton_rank_memory_bytes", "kind"),
                     "{{job_name}} rank {{rank}} {{kind}}")], unit="bytes", w=24),
    ])


def faults() -> dict:
    return dashboard("baton-faults", "baton: faults and elasticity", "What failed, how fast "
                     "did the job recover, and how did its world change?", [
        stat("Failures", "Worker failures seen.", f"sum by (job_name) "
             f"({m('baton_failures', '_total')}{SEL})", decimals=0),
        stat("Recoveries", "Failures recovered from.", f"sum by (job_name) "
             f"({m('baton_recoveries', '_total')}{SEL})", decimals=0),
        stat("Rescales", "Times the world was re-formed at another size.", f"sum by (job_name) "
             f"({m('baton_rescales', '_total')}{SEL})", decimals=0),
        stat("Data-parallel replicas", "dp of the current world.", gauge("baton_dp"), decimals=0),
        stat("Mean recovery", "From a failure to the first step after it (Ray exports each "
             "time at the middle of its histogram bucket: 2.65 s counts as 3.75).",
             f"sum by (job_name) ({m('baton_recovery_seconds', '_sum')}{SEL}) / sum by (job_name) "
             f"({m('baton_recovery_seconds', '_count')}{SEL})", unit="s"),
        stat("Checkpoint save", "Mean seconds to write and commit a checkpoint, lately.",
             mean("baton_checkpoint_save_seconds"), unit="s"),
        timeseries("Failures by cause", "Failures so far: actor_died, node_died, hang, "
                   "timeout, exception. A step up is a failure.",
                   [(total("baton_failures", "cause"), "{{job_name}} {{cause}}")]),
        timeseries("Recoveries by cause", "Failures recovered from so far, by what caused them.",
                   [(total("baton_recoveries", "cause"), "{{job_name}} {{cause}}")]),
        timeseries("Recovery time", "Seconds from a failure to training again, over the run "
                   "so far (90th percentile and mean).",
                   [(quantile_so_far(0.9, "baton_recovery_seconds", "job_name, cause"),
                     "{{job_name}} {{cause}} p90"),
                    (mean_so_far("baton_recovery_seconds", "job_name, cause"),
                     "{{job_name}} {{cause}} mean")], unit="s"),
        timeseries("Rescales", "Times the world was re-formed larger (up: room appeared) or "
                   "smaller (down: after a failure with no room to replace the worker), so far.",
                   [(total("baton_rescales", "direction"), "{{job_name}} {{direction}}")]),
        timeseries("World size and replicas", "Workers in the world, alive, and data-parallel "
                   "replicas.",
                   [(gauge("baton_world_size"), "{{job_name}} world size"),
                    (gauge("baton_workers_alive"), "{{job_name}} alive"),
                    (gauge("baton_dp"), "{{job_name}} dp")]),
        timeseries("Waiting in line", "Seconds each job has waited for room other jobs hold: "
                   "queued, or suspended for a job of higher priority or one it borrowed room "
                   "from; 0 while it has a world.",
                   [(gauge("baton_waiting_seconds"), "{{job_name}}")], unit="s"),
        timeseries("Checkpoint save and load", "Mean seconds to write and commit a checkpoint "
                   "(lately), and to load one into the world (over the run so far).",
                   [(mean("baton_checkpoint_save_seconds"), "{{job_name}} save"),
                    (mean_so_far("baton_checkpoint_load_seconds"), "{{job_name}} load")], unit="s"),
    ])


def pipeline() -> dict:
    return dashboard("baton-pipeline", "baton: pipeline and data", "Where does a step's time "
                     "go: pipeline bubble, waiting for data, checkpoints?", [
        stat("Pipeline bubble", "Idle share of the last pipeline step (pp > 1 only).",
             gauge("baton_pipeline_bubble"), unit="percentunit"),
        stat("Data wait", "Share of the step spent getting the batch.",
             gauge("baton_data_wait_fraction"), unit="percentunit"),
        stat("Tokens/s per worker", "Throughput over the world size.",
             f"{gauge('baton_tokens_per_second')} / {gauge('baton_world_size')}"),
        stat("Step time p50", "Median optimizer step.", quantile(0.5, "baton_step_seconds"),
             unit="s"),
        timeseries("Pipeline bubble", "Measured idle fraction of each pipeline step; "
                   "compare with (p - 1) / (m + p - 1) for GPipe and 1F1B.",
                   [(gauge("baton_pipeline_bubble"), "{{job_name}}")], unit="percentunit", max_=1),
        timeseries("Data wait", "Workers' time getting their batch as a share of the step; "
                   "high means the input, not the model, sets the pace.",
                   [(gauge("baton_data_wait_fraction"), "{{job_name}}")], unit="percentunit",
                   max_=1),
        timeseries("Step time distribution", "p50, p90 and p99 of the optimizer step.",
                   [(quantile(q, "baton_step_seconds"), f"{{{{job_name}}}} p{int(q * 100)}")
                    for q in (0.5, 0.9, 0.99)], unit="s"),
        timeseries("Throughput per worker", "Tokens per second per worker: flat as the world "
                   "grows means the job scales.",
                   [(f"{gauge('baton_tokens_per_second')} / {gauge('baton_world_size')}",
                     "{{job_name}}")]),
        timeseries("Checkpoint load time", "p90 seconds to load a checkpoint (resume, "
                   "recovery, rescale), over the run so far.",
                   [(quantile_so_far(0.9, "baton_checkpoint_load_seconds"), "{{job_name}}")], unit="s"),
        timeseries("Checkpoint save time", "p90 seconds to write and commit a checkpoint.",
                   [(quantile(0.9, "baton_checkpoint_save_seconds"), "{{job_name}}")], unit="s"),
    ])


DASHBOARDS = {"baton-training.json": training, "baton-faults.json": faults,
              "baton-pipeline.json": pipeline}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in render().items():
        path = HERE / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print(f"stale: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
