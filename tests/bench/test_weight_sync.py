"""bench/weight_sync.py keeps working: its smoke form runs every scenario and variant on
real processes, and what it reports follows from the order the jobs were served in (no
figure is compared with a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"
SCENARIOS = ["together", "sampler-first", "trainer-first"]
VARIANTS = ["set", "sorted", "reverse"]


def test_quick_form_reports_every_figure_and_the_sets_switches_overlap() -> None:
    command = [sys.executable, str(SCRIPT), "--quick", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    summary = {(s["scenario"], s["variant"]): s for s in report["summary"]}
    assert list(summary) == [(s, v) for s in SCENARIOS for v in VARIANTS]
    assert len(report["rounds"]) == len(summary) * report["reps"]
    for (_, variant), row in summary.items():
        assert row["n"] == report["reps"]
        for key in ("wait_s", "handover_s", "switch_sum_s", "switch_wall_s", "third_wait_s"):
            assert set(row[key]) == {"median", "min", "max"}, key
        assert set(row["idle_s"]) == {"sampler", "trainer"}
        assert row["wait_ratio_to_set"]["median"] > 0
        assert row["wait_modelled_s"] > 0
        if variant == "set":
            # Both switches start when the set is granted: they run at once, and the
            # sampler stays reserved for the set while third waits.
            assert row["overlapped"] == row["n"]
            assert row["third_before_sync"] == 0
        else:
            # One by one, the second Acquire is sent only once the first is granted.
            assert row["overlapped"] == 0
            # Reverse: third, queued on the sampler before the sync job asks for it, is
            # served there first; sorted: the sync job was queued there first.
            assert row["third_before_sync"] == (row["n"] if variant == "reverse" else 0)
    for r in report["rounds"]:
        overlapping = r["switch_wall_s"] < r["switch_sum_s"]
        assert overlapping == r["overlapped"] == (r["variant"] == "set"), r
