"""The sim backend writes down every fault it injects (``sim-faults.jsonl``): chaos runs
count them from there, across agent restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tslice.agent.backends import base, sim
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 1024**3


def _backend(state_dir: Path, *, fail: float = 0.0, hang: float = 0.0) -> sim.SimBackend:
    return sim.SimBackend(
        node="n1",
        state_dir=state_dir,
        capacity_bytes=10 * GiB,
        bandwidth_bytes_per_s=10**12,
        latency_s=0.0,
        fail_probability=fail,
        hang_probability=hang,
        seed=3,
    )


async def test_injected_failures_and_hangs_are_recorded_per_copy(tmp_path: Path) -> None:
    job = base.JobContext(job_id="a", group="g", footprint_bytes=GiB)
    failing = _backend(tmp_path, fail=1.0)
    await failing.activate(job)
    with pytest.raises(base.FatalBackendError, match="injected failure"):
        await failing.snapshot(job, pb.SUSPEND_MODE_OFFLOAD)

    hanging = _backend(tmp_path, hang=1.0)  # same devices: a restarted agent
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(hanging.snapshot(job, pb.SUSPEND_MODE_OFFLOAD), timeout=0.05)

    faults = device.read_faults(tmp_path / device.FAULTS_FILE)
    assert [(f.kind, f.direction, f.node, f.job, f.group) for f in faults] == [
        ("fail", "snapshot", "n1", "a", "g"),
        ("hang", "snapshot", "n1", "a", "g"),
    ]
    # Nothing moved: the job is still resident. The journal says when its state is usable:
    # not from each snapshot's start (free), again once the snapshot failed (alloc).
    assert hanging.node.resident_bytes(job="a", group="g") == GiB
    events = [e.event for e in device.read_journal(tmp_path / device.JOURNAL_FILE)]
    assert events == ["alloc", "free", "alloc", "free", "alloc"]


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / device.FAULTS_FILE
    path.write_text(
        '{"t": 1.0, "node": "n", "group": "g", "job": "a", "kind": "hang", '
        '"direction": "restore"}\n{"t": 2.0, "no'
    )
    assert [f.kind for f in device.read_faults(path)] == ["hang"]
