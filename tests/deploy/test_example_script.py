"""The example RL job's stand-in script (deploy/kubernetes/overlays/rl-job-example) runs.

Without an orchestrator address tslice.rl is a no-op, so this checks the script's use of
tslice.rl (the phases of each role, the role and job it reports), not the hand-overs
(tests/jobside/test_rl_phases.py does those).
"""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = (
    Path(__file__).resolve().parents[2]
    / "deploy"
    / "kubernetes"
    / "overlays"
    / "rl-job-example"
    / "rl_demo.py"
)


@pytest.mark.parametrize("role", ["trainer", "sampler"])
def test_the_example_script_runs_its_phases(
    role: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("TIMESLICE_ORCH_ADDR", "TSLICE_ORCHESTRATOR", "TIMESLICE_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TSLICE_JOB_ID", "demo-a")
    monkeypatch.setenv("TSLICE_ROLE", role)
    monkeypatch.setenv("DEMO_STEPS", "2")
    monkeypatch.setenv("DEMO_WORK_S", "0")
    runpy.run_path(str(SCRIPT), run_name="__main__")
    assert capsys.readouterr().out.splitlines()[-1] == f"demo-a {role}: step 2/2"
