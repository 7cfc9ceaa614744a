"""The Grafana dashboards: valid against Grafana 11.6's dashboard schema (and each panel against
its kind's), unique panel ids, a refId and an expr on every target, PromQL that the Prometheus
project's own parser accepts, and every metric and label they query one that baton exports.
That baton really exports them is tests/integration/test_observability.py's part."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from baton.tracking.metrics import METRICS, exported_names

ROOT = Path(__file__).resolve().parents[2]
BOARDS = ROOT / "dashboards"
SCHEMAS = ROOT.parent / "shared" / "schemas" / "grafana-11.6"
PROMQL = ROOT / "tests" / "promql"
FILES = sorted(BOARDS.glob("*.json"))
needs_schemas = pytest.mark.skipif(not SCHEMAS.is_dir(),
                                   reason=f"Grafana schemas not found at {SCHEMAS}")
# what Grafana substitutes before a query reaches Prometheus
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "30s", "$__range": "1h"}


def _boards() -> dict[str, dict]:
    return {f.name: json.loads(f.read_text()) for f in FILES}


def _targets(board: dict) -> list[tuple[dict, dict]]:
    return [(p, t) for p in board["panels"] for t in p.get("targets", [])]


def _expressions(board: dict) -> list[str]:
    exprs = [t["expr"] for _, t in _targets(board)]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    return exprs


def _grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr.replace("$job_name", ".*")


def test_there_are_the_three_dashboards_and_they_are_generated_from_one_description():
    assert [f.name for f in FILES] == ["baton-faults.json", "baton-pipeline.json",
                                       "baton-training.json"]
    check = subprocess.run([sys.executable, str(BOARDS / "generate.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize("name", [f.name for f in FILES])
def test_panels_have_unique_ids_and_every_target_a_ref_id_and_an_expr(name):
    board = _boards()[name]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    for panel in board["panels"]:
        refs = [t.get("refId") for t in panel["targets"]]
        assert panel["targets"] and all(refs) and len(set(refs)) == len(refs), panel["title"]
        assert all(t.get("expr", "").strip() for t in panel["targets"]), panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"


# -- the schema ------------------------------------------------------------------------------

def _schema(name: str, ref: str = "") -> dict:
    schema = json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())
    return {**schema, "$ref": f"#/definitions/{ref}"} if ref else schema


def schema_errors(board: dict) -> list[str]:
    """Errors of the dashboard against Grafana's model, of each panel's options and custom
    field config against its kind's model, and of each target against the Prometheus query's."""
    out = [f"dashboard: {e.message}" for e in
           jsonschema.Draft7Validator(_schema("dashboard")).iter_errors(board)]
    query = jsonschema.Draft7Validator(_schema("prometheus", "Dataquery"))
    for panel in board.get("panels", []):
        kind = panel.get("type")
        if kind not in ("timeseries", "stat"):
            out.append(f"panel {panel.get('id')}: a {kind!r} panel, which these tests do not know")
            continue
        options = jsonschema.Draft7Validator(_schema(kind, "Options"))
        out += [f"panel {panel['id']} options: {e.message}" for e in
                options.iter_errors(panel.get("options", {}))]
        custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
        if custom is not None:
            fields = jsonschema.Draft7Validator(_schema(kind, "FieldConfig"))
            out += [f"panel {panel['id']} custom: {e.message}" for e in fields.iter_errors(custom)]
        for target in panel.get("targets", []):
            out += [f"panel {panel['id']} target: {e.message}" for e in query.iter_errors(target)]
    return out


@needs_schemas
@pytest.mark.parametrize("name", [f.name for f in FILES])
def test_dashboard_validates_against_grafana_11_6(name):
    assert schema_errors(_boards()[name]) == []


def _mutations(board: dict):
    b = copy.deepcopy(board)
    b["panels"][0]["gridpos"] = b["panels"][0].pop("gridPos")
    yield "a typo'd panel field", b
    b = copy.deepcopy(board)
    b["panels"][0]["targets"][0]["exprr"] = b["panels"][0]["targets"][0].pop("expr")
    yield "a typo'd target field", b
    b = copy.deepcopy(board)
    ts = next(p for p in b["panels"] if p["type"] == "timeseries")
    ts["options"]["tooltip"]["mode"] = "all"
    yield "a tooltip mode Grafana does not have", b
    b = copy.deepcopy(board)
    st = next(p for p in b["panels"] if p["type"] == "stat")
    del st["options"]["reduceOptions"]
    yield "a stat panel without reduceOptions", b
    b = copy.deepcopy(board)
    b["panels"][1]["id"] = "2"
    yield "a panel id that is a string", b
    b = copy.deepcopy(board)
    del b["templating"]
    yield "no templating", b


@needs_schemas
@pytest.mark.parametrize("what", ["a typo'd panel field", "a typo'd target field",
                                  "a tooltip mode Grafana does not have",
                                  "a stat panel without reduceOptions",
                                  "a panel id that is a string", "no templating"])
def test_a_broken_dashboard_fails_the_schema(what):
    board = _boards()["baton-training.json"]
    [mutated] = [b for name, b in _mutations(board) if name == what]
    assert schema_errors(mutated), what


# -- the queries -----------------------------------------------------------------------------

def parse_promql(exprs: list[str]) -> list[dict]:
    """Each expression through the Prometheus project's parser (tests/promql/parse.mjs)."""
    node = shutil.which("node")
    if node is None or not (PROMQL / "node_modules" / "@prometheus-io").is_dir():
        pytest.fail("the PromQL parser is not installed: run `npm ci --prefix tests/promql` "
                    "(.ci/run does)")
    run = subprocess.run([node, str(PROMQL / "parse.mjs")], input=json.dumps(exprs),
                         capture_output=True, text=True, timeout=60, cwd=PROMQL)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_the_parser_rejects_broken_promql():
    broken = ["sum(rate(ray_baton_loss[1m]) by", "ray_baton_loss{job_name=}",
              "histogram_quantile(0.9, )", "max by job_name (ray_baton_loss)",
              "changes(max(ray_baton_dp)[1m])"]
    for result in parse_promql(broken + ["max by (job_name) (ray_baton_loss)"])[:-1]:
        assert result["errors"], result["expr"]
    assert parse_promql(["max by (job_name) (ray_baton_loss)"])[0]["errors"] == []


def _queries() -> list[dict]:
    exprs = sorted({_grafana_to_promql(e) for b in _boards().values() for e in _expressions(b)})
    return parse_promql(exprs)


def test_every_query_parses():
    results = _queries()
    assert len(results) >= 25
    assert [(r["expr"], r["errors"]) for r in results if r["errors"]] == []


def test_every_metric_and_label_queried_is_one_baton_exports():
    series = exported_names()
    used_metrics, used_labels = set(), set()
    for r in _queries():
        for name in r["metrics"]:
            assert name in series, f"{name} (in {r['expr']}) is not exported by baton"
            used_metrics.add(name)
            allowed = set(series[name].labels) | ({"le"} if name.endswith("_bucket") else set())
            unknown = set(r["labels"]) - allowed - {"le"}
            assert not unknown, f"{r['expr']}: labels {unknown} are not on {name}"
        used_labels |= set(r["labels"])
    # and every metric baton exports is on some dashboard
    assert {series[n].name for n in used_metrics} == set(METRICS)
    assert {"job_name", "cause", "direction", "le"} <= used_labels


def test_the_job_variable_lists_the_jobs_baton_exports():
    for board in _boards().values():
        job = next(v for v in board["templating"]["list"] if v["name"] == "job_name")
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", job["query"]).groups()
        assert metric in exported_names() and label in METRICS["baton_step"].labels


def test_provisioning_points_grafana_at_the_dashboards_and_a_prometheus():
    boards = yaml.safe_load((BOARDS / "provisioning" / "dashboards.yaml").read_text())
    sources = yaml.safe_load((BOARDS / "provisioning" / "datasources.yaml").read_text())
    assert boards["apiVersion"] == 1 and sources["apiVersion"] == 1
    [provider] = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]
    [source] = sources["datasources"]
    assert source["type"] == "prometheus" and source["url"].startswith("http")
