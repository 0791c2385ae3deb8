"""bench/trace_replay.py keeps working: its smoke form replays the veRL trace through real
processes under every configuration, with no error and no mutual-exclusion violation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "trace_replay.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_quick_form_replays_every_configuration() -> None:
    done = _bench("--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["pools"] == ["sampler", "trainer"] and report["steps"] == 2
    assert [(r["configuration"], r["jobs"]) for r in report["rows"]] == [
        ("reference", 2),
        ("sequential", 2),
        ("overlap", 2),
        ("+prefetch", 2),
        ("+discard", 2),
    ]
    for row in report["rows"]:
        assert row["errors"] == [] and row["violations"] == 0
        assert row["switches"] > 0
        assert set(row["duty"]) == {"sampler", "trainer"}
        # Figures are what the run measured, put together consistently.
        assert abs(row["back_to_back_s"] - sum(report["solo_makespan_s"].values())) < 0.5
        assert abs(row["speedup"] - row["back_to_back_s"] / row["makespan_s"]) < 1e-3
        assert row["bound"]["limit"] in {"sampler", "trainer", "job A", "job B"}
        # No run can beat the bound the phase model allows.
        assert row["makespan_s"] >= row["bound"]["makespan_s"]
    # What a switch's copies cost: the sum, then the longer one, then less still.
    cost = {r["configuration"]: r["switch_modelled_s"] for r in report["rows"]}
    for pool in ("sampler", "trainer"):
        assert cost["sequential"][pool] > cost["overlap"][pool] >= cost["+prefetch"][pool]
    assert cost["+discard"]["sampler"] == 0 < cost["+discard"]["trainer"]
    validation = report["validation"]
    assert validation["recorded_speedup"] == 1.45 and validation["jobs"] == 2


def test_a_trace_missing_a_field_is_refused_with_its_name(tmp_path: Path) -> None:
    recorded = tmp_path / "no-windows.json"
    recorded.write_text(json.dumps({"timeslice": {"events": []}}))
    done = _bench("--trace", str(recorded))
    assert done.returncode == 2
    assert "timeslice.windows is missing (needed for the lock windows of each pool)" in done.stderr
