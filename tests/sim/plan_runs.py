"""Recorded runs for the planner's tests: four jobs with complementary phases, and an
event log of two jobs taking turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.sim.traces import Lane, constructed

# A and C mostly train, B and D mostly sample. A/B and C/D are each other's mirror
# image (one trains while the other samples, and their steps last as long); A/D or
# C/B leave one pool over-full, A/C (or B/D) want the same pool most of the time.
STEPS = 4
SHAPES: dict[str, Lane] = {
    "A": [(("trainer",), 80.0), (("sampler",), 20.0)],
    "B": [(("sampler",), 80.0), (("trainer",), 20.0)],
    "C": [(("trainer",), 60.0), (("sampler",), 40.0)],
    "D": [(("sampler",), 60.0), (("trainer",), 40.0)],
}


def write_run(tmp_path: Path, raw: dict[str, Any], name: str = "run.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


def four_jobs(tmp_path: Path) -> Path:
    # One job after the other (as an exclusive run records them): no window overlaps
    # another job's, so both pools are shared.
    jobs = {job: (i * 1000.0, [lane]) for i, (job, lane) in enumerate(SHAPES.items())}
    raw = constructed(jobs, steps=STEPS, mode="sync", shared=("sampler", "trainer"))
    return write_run(tmp_path, raw)


def event(t: float, kind: str, group: str, job: str, **extra: Any) -> dict[str, Any]:
    when = f"2026-12-02T00:00:{t:06.3f}+00:00"
    return {"time": when, "kind": kind, "group_id": group, "job_id": job, **extra}


def two_jobs_log(steps: int = 4) -> list[dict[str, Any]]:
    """A valid event log: A and B take turns on trainer, then on sampler, every step."""
    lines: list[dict[str, Any]] = []
    t = 0.0
    for _ in range(steps):
        for job in ("A", "B"):
            for group in ("trainer", "sampler"):
                lines += [
                    event(t, "GRANTED", group, job, duration_ms=0),
                    event(t + 0.01, "SNAPSHOT_DONE", group, job, duration_ms=5),
                    event(t + 0.02, "RESTORE_DONE", group, job, duration_ms=5),
                    event(t + 1, "YIELDED", group, job),
                ]
                t += 1.2
    return lines
