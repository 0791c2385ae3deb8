"""bench/load.py keeps working: its short form runs end to end on real processes, and its
mutual-exclusion checks find what they are meant to find (fed violations on purpose)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf import timestamp_pb2

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "load.py"
Kind = opb.OrchestratorEvent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_load", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(kind: int, group: str, job: str, t: float, waited_ms: int = 0) -> opb.OrchestratorEvent:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(int(t * 1e9))
    return opb.OrchestratorEvent(
        time=ts, kind=kind, group_id=group, job_id=job, duration_ms=waited_ms
    )


SHORT_FORM = ("--seconds", "5", "--jobs", "100", "--groups", "25", "--procs", "2", "--nodes", "2")


def test_short_form_runs_with_no_error_and_no_violation() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SHORT_FORM, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["errors"] == 0, report["error_samples"]
    assert report["violations"] == 0, report["violation_samples"]
    assert report["events_lost"] == 0
    assert report["grants"] > 0
    assert report["handover_ms"]["n"] > 0
    # Replayed from the history: every group, so more hand-overs than the watched ones.
    assert report["handover_all_ms"]["n"] > report["handover_ms"]["n"]
    assert report["acquire_ms"]["n"] > 0
    assert report["orchestrator"]["cpu_ms_per_grant"] > 0
    assert report["orchestrator"]["rss_mib"] > 0
    assert len(report["generators_cpu_share"]) == 2


def test_event_check_finds_a_grant_while_another_job_holds() -> None:
    load = _load()
    watch = load._Watch(start=0.0, end=100.0)
    watch.take(_event(Kind.KIND_GRANTED, "g", "a", 1.0))
    watch.take(_event(Kind.KIND_YIELDED, "g", "a", 2.0))
    watch.take(_event(Kind.KIND_GRANTED, "g", "b", 2.5, waited_ms=1000))  # queued at 1.5
    watch.take(_event(Kind.KIND_GRANTED, "h", "c", 2.6))  # another group: no conflict
    assert watch.violations == []
    assert [round(s, 3) for s in watch.handover_s] == [0.5]
    watch.take(_event(Kind.KIND_GRANTED, "g", "a", 3.0))  # b never yielded
    assert len(watch.violations) == 1 and "a granted" in watch.violations[0]


def test_hand_over_counts_only_a_waiter_queued_before_the_yield() -> None:
    load = _load()
    watch = load._Watch(start=0.0, end=100.0)
    watch.take(_event(Kind.KIND_GRANTED, "g", "a", 1.0))
    watch.take(_event(Kind.KIND_YIELDED, "g", "a", 2.0))
    watch.take(_event(Kind.KIND_GRANTED, "g", "b", 3.0, waited_ms=500))  # came after the yield
    assert watch.handover_s == []


def test_hold_intervals_that_overlap_are_violations() -> None:
    load = _load()
    apart = [("g", "a", 1.0, 2.0), ("g", "b", 2.1, 3.0), ("h", "c", 1.5, 2.5)]
    assert load.overlapping_holds(apart) == []
    overlapping = [*apart, ("g", "c", 2.9, 3.5)]
    found = load.overlapping_holds(overlapping)
    assert len(found) == 1 and found[0].startswith("g: c held")


def test_the_half_saturation_hold_offers_half_the_saturating_rate() -> None:
    load = _load()
    # 250 groups that granted 340/s at saturation: each group grants once per hold.
    hold_ms = load.half_saturation_hold_ms(340.0, 250)
    assert 250 / (hold_ms / 1000) == pytest.approx(170.0)
    with pytest.raises(ValueError, match="granted nothing"):
        load.half_saturation_hold_ms(0.0, 250)
