"""deploy/observability: the Grafana dashboard and the Prometheus alert rules.

* the rules pass `promtool check rules` and their unit tests (`promtool test rules`:
  each alert fires on its series); promtool is Debian's `prometheus` package, which
  .ci/run installs (without it, this test fails in CI and skips elsewhere);
* every metric name a dashboard query or a rule uses is exported by a real orchestrator's
  and a real agent's /metrics, after a hand-over (queries parsed, not grepped);
* the dashboard has the structure Grafana imports (no maintained JSON schema of Grafana
  dashboards is installable from PyPI or Debian: a structural test), the panels the
  operators asked for, and make_dashboard.py reproduces it.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests import debian_tools
from tests.orchestrator.orch_harness import Cluster, acquire, free_port, yield_

ROOT = pathlib.Path(__file__).resolve().parents[2]
HERE = ROOT / "deploy" / "observability"
DASHBOARD = HERE / "tslice-dashboard.json"
RULES = HERE / "tslice-alerts.yaml"
RULE_TESTS = HERE / "tslice-alerts.test.yaml"

#: PromQL's functions, aggregations and keywords: every other bare name is a metric.
_WORDS = """sum min max avg count stddev stdvar topk bottomk quantile count_values group
    rate irate increase delta idelta deriv histogram_quantile abs ceil floor round clamp
    clamp_min clamp_max label_replace label_join vector scalar time sort sort_desc
    absent absent_over_time avg_over_time max_over_time min_over_time sum_over_time
    count_over_time last_over_time changes resets predict_linear exp ln log2 log10 sqrt
    humanize and or unless by without on ignoring group_left group_right bool offset
    inf nan le"""
PROMQL_WORDS = frozenset(_WORDS.split())


def test_alert_rules_pass_promtool_and_their_unit_tests() -> None:
    promtool = debian_tools.binary("promtool", "prometheus")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout
    tested = subprocess.run(
        [promtool, "test", "rules", str(RULE_TESTS)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=HERE,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_alert_rules_cover_what_operators_asked_for() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {
        "TsliceNodeDegraded",
        "TsliceSwitchFailures",
        "TsliceGroupStuckSwitching",
        "TsliceLeaseExpiries",
        "TsliceAgentUnreachable",
    } <= names
    tested = yaml.safe_load(RULE_TESTS.read_text())
    fired = {
        case["alertname"]
        for t in tested["tests"]
        for case in t["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert fired == names, "every alert has a unit test in which it fires"


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _queries() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every dashboard target and every rule."""
    board = _dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            yield f"panel {panel['title']!r}", target["expr"]
    for var in board["templating"]["list"]:
        if var["type"] == "query":  # Grafana's label_values(METRIC, LABEL)
            found = re.fullmatch(r"label_values\((.+), *\w+\)", var["definition"])
            assert found, var["definition"]
            yield f"variable {var['name']}", found.group(1)
    for rule in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]:
        yield f"rule {rule['alert']}", rule["expr"]


def metric_names(expr: str) -> set[str]:
    """The metric names of a PromQL expression: strings, label matchers, ranges and label
    lists dropped, then every bare name that is not a PromQL word."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text)) - PROMQL_WORDS
    return {n for n in names if not re.fullmatch(r"\d+(e\d+)?", n)}


def test_the_query_parser_finds_metric_names() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (operation, le) (rate(x_bucket{group_id=~"$group",'
        ' a="b{c}"}[$__rate_interval]))) / ignoring(job_id) group_left sum(y_total) > 0'
    )
    assert metric_names(expr) == {"x_bucket", "y_total"}


def _exported(text: str) -> set[str]:
    """Every series name a scrape may carry, from the families' types (a family with no
    sample yet still has its HELP and TYPE lines)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "summary": ("_sum", "_count", "_created", ""),
        "info": ("_info",),
    }
    out: set[str] = set()
    for family in text_string_to_metric_families(text):
        out |= {family.name + s for s in suffixes.get(family.type, ("",))}
        out |= {s.name for s in family.samples}
    return out


async def test_every_metric_a_query_uses_is_exported_by_the_servers(
    tmp_path: pathlib.Path,
) -> None:
    cluster = Cluster(tmp_path)
    agent_port, orch_port = free_port(), free_port()
    try:
        await cluster.start_agent("node-a", metrics_port=agent_port)
        await cluster.start_orchestrator(metrics_port=orch_port)
        stub = cluster.stub()
        for job in ("a", "b"):  # a switch: snapshot and restore on the agent
            await acquire(stub, job, "g")
            await yield_(stub, job, "g")
        async with httpx.AsyncClient() as http:
            texts = [
                (await http.get(f"http://127.0.0.1:{port}/metrics")).text
                for port in (orch_port, agent_port)
            ]
    finally:
        await cluster.close()
    exported = _exported(texts[0]) | _exported(texts[1])
    used = {(where, name) for where, expr in _queries() for name in metric_names(expr)}
    assert len({n for _, n in used}) >= 15
    missing = sorted(f"{where}: {name}" for where, name in used if name not in exported)
    assert not missing, "not exported by the orchestrator or the agent:\n" + "\n".join(missing)


def test_the_dashboard_has_the_structure_grafana_imports() -> None:
    board = _dashboard()
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in board, key
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in board["panels"]:
        assert panel["type"] in {"timeseries", "stat", "bargauge", "piechart", "table"}
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not mine & cells, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]
        assert panel["description"] and panel["fieldConfig"]["defaults"]["unit"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"] and target["expr"].strip()
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]


def test_the_dashboard_has_the_panels_operators_asked_for() -> None:
    titles = " | ".join(p["title"].lower() for p in _dashboard()["panels"])
    for wanted in (
        "hand-overs per second",
        "switch duration by phase",
        "bytes moved per backend",
        "gb/s",
        "queue wait",
        "hold time",
        "device-time share per job",
        "degraded nodes",
        "lease expiries",
        "failures by kind",
    ):
        assert wanted in titles, wanted


def test_make_dashboard_reproduces_the_checked_in_json() -> None:
    sys.path.insert(0, str(HERE))
    try:
        import make_dashboard
    finally:
        sys.path.remove(str(HERE))
    assert make_dashboard.render() == DASHBOARD.read_text(), (
        "deploy/observability/tslice-dashboard.json is stale: "
        "run python deploy/observability/make_dashboard.py"
    )
