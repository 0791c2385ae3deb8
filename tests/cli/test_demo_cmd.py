"""`tslice demo --json` end to end: real processes, measured speedup, zero violations; on the
veRL trace and on a trace of other pools; `tslice plan` on the event log of a demo run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.support import run_cli
from tests.sim.traces import three_pools_one_private
from tslice.cli import render


def test_demo_json_end_to_end(
    short_tmp: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = short_tmp / "demo-out"  # the cluster's Unix sockets are made under it
    event_log = short_tmp / "events.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tslice",
            "demo",
            "--json",
            "--steps",
            "2",
            "--time-scale",
            "1000",
            "--out",
            str(out),
            "--events",
            str(event_log),
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # Nothing but one JSON object on stdout.
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    for key in (
        "ok",
        "speedup",
        "recorded_speedup",
        "jobs",
        "steps",
        "time_scale",
        "contention",
        "runs",
        "snapshot_median",
        "restore_median",
        "violation_count",
        "violations",
        "timeline",
        "sim_bandwidth_bytes_per_s",
        "sim_restore_bandwidth_bytes_per_s",
    ):
        assert key in summary, key
    assert summary["ok"] is True
    assert summary["violation_count"] == 0 and summary["violations"] == []
    # (How much faster time-slicing is, is the demo's figure, not a test's: at this time
    # scale the phases last milliseconds, and a loaded machine can erase the gain.)
    assert summary["recorded_speedup"] == 1.45
    runs = summary["runs"]
    assert set(runs) == {"exclusive", "time-sliced"}
    for run in runs.values():
        assert run["steps_done"] == 4 and run["errors"] == []
        assert set(run["duty"]) == {"sampler", "trainer"}
    # The measured speedup is the ratio of the measured makespans.
    ratio = runs["exclusive"]["makespan_s"] / runs["time-sliced"]["makespan_s"]
    assert abs(summary["speedup"] - ratio) < 0.01
    # Sharing fills the idle time: each pool is held a larger share of the time.
    for pool in ("sampler", "trainer"):
        assert runs["time-sliced"]["duty"][pool] > runs["exclusive"]["duty"][pool]
    # One switch per pool in the exclusive run (A -> B), many when sliced.
    assert runs["exclusive"]["switches"] == 2
    assert runs["time-sliced"]["switches"] >= 6
    # Derived from the trace: restores copy faster than snapshots on both nodes.
    for pool in ("sampler", "trainer"):
        snapshot_rate = summary["sim_bandwidth_bytes_per_s"][pool]
        assert summary["sim_restore_bandwidth_bytes_per_s"][pool] > 2 * snapshot_rate
    for table in ("snapshot_median", "restore_median"):
        for pool in ("sampler", "trainer"):
            assert summary[table][pool]["count"] >= 2
            assert summary[table][pool]["demo_ms"] > 0
    timeline = Path(summary["timeline"])
    assert timeline == out / "timeline.html" and timeline.is_file()
    html = timeline.read_text()
    assert "https://" not in html and "http://" not in html
    assert "sampler" in html and "trainer" in html and "job A" in html and "job B" in html
    assert json.loads((out / "summary.json").read_text())["speedup"] == summary["speedup"]
    monkeypatch.setenv("COLUMNS", "200")  # the plan's tables unwrapped
    _plan_of_the_demo_log(event_log, runs["time-sliced"]["switches"], capsys)


def _plan_of_the_demo_log(
    event_log: Path, switches: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's event log is what `tslice events --json` prints, and `tslice plan`
    reads it: a recommendation, its predicted and its simulated gain."""
    events = [json.loads(line) for line in event_log.read_text().splitlines()]
    kinds = {e["kind"] for e in events}
    assert {"GRANTED", "YIELDED", "SNAPSHOT_DONE", "RESTORE_DONE", "SWITCH_DONE"} <= kinds
    handovers = [e for e in events if e["kind"] == "SWITCH_DONE" and e["from_job"]]
    assert len(handovers) == switches + 2  # the exclusive run's A -> B on both pools
    # Wide enough that rich wraps no column header (its width otherwise depends on where
    # the test runs: a terminal, a pipe, a pytest-xdist worker).
    # (The console is made once per process: made again here, and after.)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("COLUMNS", "200")
        render.stdout.cache_clear()
        try:
            code, stdout, err = run_cli(
                capsys, "plan", str(event_log), "--steps", "2", "--time-scale", "2"
            )
        finally:
            render.stdout.cache_clear()
    assert code == 0, err
    assert "recommended: {A, B} on 2 GPU(s)" in stdout
    predicted = re.search(r"predicted gain (\d+\.\d+)x", stdout)
    simulated = re.search(r"simulated gain (\d+\.\d+)x", stdout)
    assert predicted and simulated, stdout
    # Two jobs of the veRL shape gain from sharing. The replayed gain is only shown: on a
    # loaded machine the orchestrator's own milliseconds per hand-over weigh on it.
    assert float(predicted.group(1)) > 1.2 and float(simulated.group(1)) > 0
    for column in ("makespan predicted", "makespan simulated", "hand-overs"):
        assert column in stdout
    row = next(line for line in stdout.splitlines() if line.strip().startswith("1 "))
    assert re.search(r"A, B .* \d+\.\d+ s +\d+\.\d+ s$", row.rstrip()), row


def test_demo_runs_a_trace_of_other_pools(tmp_path: Path, short_tmp: Path) -> None:
    """Three pools named neither sampler nor trainer, one of them each job's own."""
    recorded = tmp_path / "three-pools.json"
    recorded.write_text(json.dumps(three_pools_one_private()))
    out = short_tmp / "demo-out"  # the cluster's Unix sockets are made under it
    # The table this time (summary.json has what --json prints): its columns are the pools.
    proc = _demo(
        "--trace",
        str(recorded),
        "--steps",
        "2",
        "--time-scale",
        "4000",
        "--out",
        str(out),
        json_output=False,
    )
    assert proc.returncode == 0, proc.stderr
    for pool in ("gen", "learn", "judge"):
        assert f"{pool} duty" in proc.stdout, proc.stdout
    assert "the trace records" in proc.stdout or "the recorded run gave" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and summary["violation_count"] == 0
    assert summary["pools"] == ["gen", "learn", "judge"]
    assert summary["private_pools"] == ["judge"]
    for run in summary["runs"].values():
        assert run["steps_done"] == 4 and run["errors"] == []
        assert set(run["duty"]) == {"gen", "learn", "judge"}
        assert all(0 < share <= 1 for share in run["duty"].values())
    # Only the shared pools switch (snapshots and restores); judge never does.
    assert set(summary["snapshot_median"]) == {"gen", "learn"}
    assert summary["runs"]["time-sliced"]["switches"] >= 2
    html = (out / "timeline.html").read_text()
    assert "judge" in html and "one per job" in html


def test_demo_names_what_a_trace_lacks(tmp_path: Path) -> None:
    raw = three_pools_one_private()
    for event in raw["timeslice"]["events"]:
        event.pop("step", None)
    recorded = tmp_path / "no-steps.json"
    recorded.write_text(json.dumps(raw))
    proc = _demo("--trace", str(recorded), "--out", str(tmp_path / "out"))
    assert proc.returncode != 0
    assert "timeslice.events[0].step is missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def _demo(*args: str, json_output: bool = True) -> subprocess.CompletedProcess[str]:
    flags = ["--json"] if json_output else ["--no-live"]
    return subprocess.run(
        [sys.executable, "-m", "tslice", "demo", *flags, *args],
        env={**os.environ, "COLUMNS": "200"},  # the table unwrapped
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
