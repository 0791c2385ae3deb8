"""bench/agent_cpu.py keeps working: a short run on real processes reports a figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "agent_cpu.py"


def test_a_short_run_reports_the_agents_cpu_per_hand_over() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "20", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["agent_cpu_ms_per_handover"] > 0
    assert report["handovers_per_s"] > 0
