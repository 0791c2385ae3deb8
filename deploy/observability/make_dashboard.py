"""Writes tslice-dashboard.json (Grafana) beside this file: `python make_dashboard.py`.

The dashboard is generated so that its panels stay uniform (one helper per panel kind) and
reviewable as Python; the JSON is what Grafana imports and what CI checks
(tests/deploy/test_observability.py: every query's metric names against a real orchestrator's
and agent's /metrics, the structure Grafana needs, and that this script reproduces the file).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

OUT = pathlib.Path(__file__).with_name("tslice-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
GROUPS = 'group_id=~"$group"'
RATE = "$__rate_interval"


def _target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def _panel(
    kind: str,
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    *,
    unit: str,
    grid: tuple[int, int, int, int],
    **extra: Any,
) -> dict[str, Any]:
    x, y, w, h = grid
    panel: dict[str, Any] = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [
            _target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(targets)
        ],
        "fieldConfig": {"defaults": {"unit": unit, **extra.pop("defaults", {})}, "overrides": []},
        "options": extra.pop("options", {}),
    }
    panel.update(extra)
    return panel


def _quantiles(metric: str, by: str, where: str = GROUPS) -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({metric}_bucket{{{where}}}[{RATE}])))",
            f"p{int(q * 100)} {{{{{by}}}}}",
        )
        for q in (0.5, 0.95)
    ]


def panels() -> list[dict[str, Any]]:
    ts = "timeseries"
    out = [
        _panel(
            "stat",
            "Degraded nodes",
            "Nodes that kept refusing a switch: their group starts no switch until an "
            "operator runs `tslice clear-degraded GROUP --node NODE`.",
            [(f"sum(tslice_orchestrator_degraded_nodes{{{GROUPS}}})", "degraded")],
            unit="none",
            grid=(0, 0, 6, 4),
            defaults={
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": "green", "value": None}, {"color": "red", "value": 1}],
                }
            },
        ),
        _panel(
            "stat",
            "Unreachable nodes",
            "Nodes whose agent does not answer (their groups are UNKNOWN).",
            [(f"sum(tslice_orchestrator_unreachable_nodes{{{GROUPS}}})", "unreachable")],
            unit="none",
            grid=(6, 0, 6, 4),
            defaults={
                "thresholds": {
                    "mode": "absolute",
                    "steps": [{"color": "green", "value": None}, {"color": "orange", "value": 1}],
                }
            },
        ),
        _panel(
            "stat",
            "Lease expiries (range)",
            "Holders whose lease ran out: their process died or hung with the group held.",
            [
                (
                    f"sum(increase(tslice_orchestrator_lease_expiries_total{{{GROUPS}}}[$__range]))",
                    "expired",
                )
            ],
            unit="none",
            grid=(12, 0, 6, 4),
        ),
        _panel(
            "stat",
            "Groups switching",
            "Groups in the SWITCHING state now.",
            [(f'sum(tslice_orchestrator_group_state{{{GROUPS}, state="SWITCHING"}})', "switching")],
            unit="none",
            grid=(18, 0, 6, 4),
        ),
        _panel(
            ts,
            "Hand-overs per second",
            "Grants per second (each ends an Acquire), by group; 'already held' re-acquires "
            "are left out.",
            [
                (
                    f"sum by (group_id) (rate(tslice_orchestrator_grants_total{{{GROUPS}, "
                    f'how!="already_held"}}[{RATE}]))',
                    "{{group_id}}",
                )
            ],
            unit="ops",
            grid=(0, 4, 12, 8),
        ),
        _panel(
            ts,
            "Switch duration by phase",
            "Agent operations of switches (snapshot, restore, grant...) as the orchestrator "
            "timed them, and whole switches (all nodes).",
            [
                *_quantiles("timeslice_orchestrator_agent_operation_duration_seconds", "operation"),
                *[
                    (expr, legend.replace("{{group_id}}", "switch {{group_id}}"))
                    for expr, legend in _quantiles(
                        "tslice_orchestrator_switch_duration_seconds", "group_id"
                    )
                ],
            ],
            unit="s",
            grid=(12, 4, 12, 8),
        ),
        _panel(
            ts,
            "Bytes moved per backend",
            "Device bytes moved off (snapshot) and onto (restore) the accelerators, per "
            "second, by backend.",
            [
                (
                    f"sum by (backend, kind) (rate(tslice_agent_bytes_moved_total[{RATE}]))",
                    "{{backend}} {{kind}}",
                )
            ],
            unit="Bps",
            grid=(0, 12, 12, 8),
        ),
        _panel(
            ts,
            "Copy speed per backend (GB/s while copying)",
            "Bytes moved divided by the time the operations took: the speed of a copy, "
            "not of the link's average.",
            [
                (
                    f"sum by (backend, kind) (rate(tslice_agent_bytes_moved_total[{RATE}])) / "
                    "sum by (backend, kind) "
                    f"(rate(tslice_agent_operation_duration_seconds_sum[{RATE}]))",
                    "{{backend}} {{kind}}",
                )
            ],
            unit="Bps",
            grid=(12, 12, 12, 8),
        ),
        _panel(
            ts,
            "Queue wait",
            "Time from Acquire to grant (p50, p95) and jobs waiting, by group.",
            [
                *_quantiles("timeslice_orchestrator_acquire_wait_duration_seconds", "group_id"),
            ],
            unit="s",
            grid=(0, 20, 12, 8),
        ),
        _panel(
            ts,
            "Jobs waiting",
            "Queue depth by group.",
            [
                (
                    f"sum by (group_id) (timeslice_orchestrator_queue_depth{{{GROUPS}}})",
                    "{{group_id}}",
                )
            ],
            unit="none",
            grid=(12, 20, 12, 8),
        ),
        _panel(
            ts,
            "Hold time",
            "How long a job held its group, grant to yield (p50, p95).",
            _quantiles("tslice_orchestrator_hold_duration_seconds", "group_id"),
            unit="s",
            grid=(0, 28, 12, 8),
        ),
        _panel(
            ts,
            "Device-time share per job",
            "Share of the groups' time each job held (stacked to 100 %): who gets the GPUs.",
            [
                (
                    "sum by (job_id) "
                    f"(rate(tslice_orchestrator_job_hold_seconds_total{{{GROUPS}}}[{RATE}]))",
                    "{{job_id}}",
                )
            ],
            unit="percentunit",
            grid=(12, 28, 12, 8),
            defaults={"custom": {"stacking": {"mode": "percent", "group": "A"}, "fillOpacity": 60}},
        ),
        _panel(
            ts,
            "Failures by kind",
            "Switches that ended without a grant (by outcome), failed switch steps (each is "
            "retried), and failed agent operations (by backend and outcome).",
            [
                (
                    f"sum by (outcome) (rate(tslice_orchestrator_switches_total{{{GROUPS}, "
                    f'outcome!="completed"}}[{RATE}]))',
                    "switch {{outcome}}",
                ),
                (
                    f"sum by (operation) (rate(tslice_orchestrator_switch_step_failures_total"
                    f"{{{GROUPS}}}[{RATE}]))",
                    "step {{operation}}",
                ),
                (
                    "sum by (backend, outcome) "
                    f'(rate(tslice_agent_operations_total{{outcome!="complete"}}[{RATE}]))',
                    "agent {{backend}} {{outcome}}",
                ),
            ],
            unit="ops",
            grid=(0, 36, 12, 8),
        ),
        _panel(
            ts,
            "Degraded and unreachable nodes by group",
            "Over time, by group.",
            [
                (
                    f"sum by (group_id) (tslice_orchestrator_degraded_nodes{{{GROUPS}}})",
                    "degraded {{group_id}}",
                ),
                (
                    f"sum by (group_id) (tslice_orchestrator_unreachable_nodes{{{GROUPS}}})",
                    "unreachable {{group_id}}",
                ),
                (
                    f"sum by (group_id) (increase(tslice_orchestrator_lease_expiries_total"
                    f"{{{GROUPS}}}[{RATE}]))",
                    "lease expiries {{group_id}}",
                ),
            ],
            unit="none",
            grid=(12, 36, 12, 8),
        ),
    ]
    for number, panel in enumerate(out, start=1):
        panel["id"] = number
    return out


def dashboard() -> dict[str, Any]:
    return {
        "uid": "tslice-overview",
        "title": "tslice: GPU time-slicing",
        "description": "Hand-overs, switches, queues, device time per job and failures of a "
        "tslice orchestrator and its node agents (docs/observability.md).",
        "tags": ["tslice", "gpu"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "group",
                    "label": "Group",
                    "type": "query",
                    "datasource": DS,
                    "query": {
                        "query": "label_values(tslice_orchestrator_group_state, group_id)",
                        "refId": "groups",
                    },
                    "definition": "label_values(tslice_orchestrator_group_state, group_id)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
