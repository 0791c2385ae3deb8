"""Simulated backends for the agent's sim-backend tests: a job context, a fast backend."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tslice.agent.backends import base, sim

GiB = 1024**3


def ctx(job_id: str = "a", *, footprint: int = 0, **kw: object) -> base.JobContext:
    job = base.JobContext(job_id=job_id, group="g", footprint_bytes=footprint)
    return dataclasses.replace(job, **kw)  # type: ignore[arg-type]


def fast(tmp_path: Path | None = None, **kw: object) -> sim.SimBackend:
    settings: dict[str, object] = {
        "node": "n1",
        "state_dir": tmp_path,
        "capacity_bytes": 10 * GiB,
        "bandwidth_bytes_per_s": 10**12,
        "latency_s": 0.0,
    }
    settings.update(kw)
    return sim.SimBackend.create(settings)
