"""A real ``tslice agent`` process, SIGKILLed mid-operation and restarted on its state dir."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tests.agent.processes import AgentProcess
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc


async def _wait(stub: pb_grpc.SnapshotAgentServiceStub, op_id: str) -> pb.GetOperationResponse:
    return await stub.WaitOperation(pb.WaitOperationRequest(operation_id=op_id, timeout_ms=20_000))


async def _jobs(stub: pb_grpc.SnapshotAgentServiceStub) -> dict[str, pb.JobStatus]:
    return {j.job_id: j for j in (await stub.Status(pb.StatusRequest())).job_statuses}


def _never_two_resident(events: list[device.Event]) -> None:
    resident: dict[tuple[str, str], set[str]] = {}
    for event in events:
        holders = resident.setdefault((event.group, event.device), set())
        if event.event == "alloc":
            holders.add(event.job)
            assert len(holders) == 1, f"two jobs resident on {event.device}: {holders}"
        else:
            holders.discard(event.job)


async def test_sigkill_mid_operation_loses_nothing(
    tmp_path: Path, processes: list[AgentProcess]
) -> None:
    state_dir = tmp_path / "state"
    slow = ("--sim-extra-latency=60",)

    # 1. Killed during a snapshot: nothing moved, the job is still resident.
    first = AgentProcess(state_dir, *slow)
    processes.append(first)
    stub = await first.start()
    assert (await stub.Grant(pb.GrantRequest(job_id="job-a", group="g", grant_epoch=1))).state == (
        pb.JOB_STATE_RUNNING
    )
    cut = await stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert (await _jobs(stub))["job-a"].state == pb.JOB_STATE_TRANSITIONING
    await first.kill()

    second = AgentProcess(state_dir)
    processes.append(second)
    stub = await second.start()
    job = (await _jobs(stub))["job-a"]
    assert job.state == pb.JOB_STATE_RUNNING
    op = await stub.GetOperation(pb.GetOperationRequest(operation_id=cut.operation_id))
    assert op.status == pb.OPERATION_STATUS_FAILED
    assert "agent restarted during operation" in op.error
    snap = await stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert (await _wait(stub, snap.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
    await stub.Grant(pb.GrantRequest(job_id="job-b", group="g", grant_epoch=2))
    snap_b = await stub.Snapshot(pb.SnapshotRequest(job_id="job-b", group="g"))
    assert (await _wait(stub, snap_b.operation_id)).storage_bytes > 0
    await second.kill()  # idle kill: everything was written before each reply

    # 2. Killed during a restore: the bytes that landed are given back, the job is SAVED.
    third = AgentProcess(state_dir, *slow)
    processes.append(third)
    stub = await third.start()
    jobs = await _jobs(stub)
    assert (jobs["job-a"].state, jobs["job-b"].state) == (pb.JOB_STATE_SAVED, pb.JOB_STATE_SAVED)
    cut = await stub.Restore(pb.RestoreRequest(job_id="job-a", group="g"))
    assert (await _jobs(stub))["job-a"].state == pb.JOB_STATE_TRANSITIONING
    await third.kill()

    fourth = AgentProcess(state_dir)
    processes.append(fourth)
    stub = await fourth.start()
    jobs = await _jobs(stub)
    assert jobs["job-a"].state == pb.JOB_STATE_SAVED
    status = await stub.Status(pb.StatusRequest())
    assert status.accelerator_statuses[0].memory_used_bytes == 0
    again = await stub.Restore(pb.RestoreRequest(job_id="job-a", group="g"))
    assert (await _wait(stub, again.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
    # The fencing epoch survived every crash.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Grant(pb.GrantRequest(job_id="job-c", group="g", grant_epoch=1))
    assert "stale" in info.value.details()
    assert await fourth.terminate() == 0

    events = device.read_journal(state_dir / device.JOURNAL_FILE)
    assert [(e.job, e.event) for e in events] == [
        ("job-a", "alloc"),
        ("job-a", "free"),  # the snapshot starts (the state is no longer usable)...
        ("job-a", "alloc"),  # ...and was cut by the crash: resident again after the restart
        ("job-a", "free"),
        ("job-b", "alloc"),
        ("job-b", "free"),
        ("job-a", "alloc"),  # the interrupted restore...
        ("job-a", "free"),  # ...given back on recovery
        ("job-a", "alloc"),
    ]
    _never_two_resident(events)
