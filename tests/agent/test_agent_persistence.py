"""An agent restarted on the same state dir forgets nothing (in-process restarts)."""

from __future__ import annotations

import grpc
import pytest

from tests.agent.agent_doubles import GatedBackend
from tests.agent.conftest import AgentRunner
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


async def test_jobs_saved_state_operations_and_epochs_survive_a_restart(
    agents: AgentRunner,
) -> None:
    agent = await agents.start()
    await agent.grant("job-a", epoch=5)
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    done = await agent.wait(snap.operation_id)
    await agent.grant("job-b", epoch=6)
    before = await agent.jobs()
    accelerators = (await agent.stub.Status(pb.StatusRequest())).accelerator_statuses

    agent = await agents.restart(agent)

    assert await agent.jobs() == before
    assert (await agent.stub.Status(pb.StatusRequest())).accelerator_statuses == accelerators
    again = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=snap.operation_id))
    assert again == done
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent.stub.Grant(pb.GrantRequest(job_id="job-c", group="g", grant_epoch=5))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale" in info.value.details()

    assert (await agent.snapshot("job-b")).status == pb.OPERATION_STATUS_COMPLETE
    assert (await agent.restore("job-a")).status == pb.OPERATION_STATUS_COMPLETE
    assert await agent.state("job-a") == pb.JOB_STATE_RUNNING


async def test_operation_cut_by_a_stop_is_settled_from_the_backend(agents: AgentRunner) -> None:
    agent = await agents.start(grace_period_s=0.05, sim={"hang_probability": 1.0})
    await agent.grant("job-a")
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert await agent.state("job-a") == pb.JOB_STATE_TRANSITIONING
    await agents.stop(agent)

    agent = await agents.start()  # same state dir, no more hangs
    job = (await agent.jobs())["job-a"]
    # The simulated snapshot never freed the device, so the job is still resident.
    assert job.state == pb.JOB_STATE_RUNNING
    op = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=snap.operation_id))
    assert op.status == pb.OPERATION_STATUS_FAILED
    assert f"agent restarted during operation {snap.operation_id}" in op.error
    assert (await agent.snapshot("job-a")).status == pb.OPERATION_STATUS_COMPLETE


async def test_operation_cut_by_a_stop_faults_the_job_when_the_backend_cannot_tell(
    agents: AgentRunner,
) -> None:
    gated = GatedBackend(recovers_to=None)
    agent = await agents.start(
        default_backend="gated", instances={"gated": gated}, grace_period_s=0.05
    )
    await agent.grant("job-a")
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    await gated.started.wait()
    await agents.stop(agent)

    agent = await agents.start(
        default_backend="gated", instances={"gated": GatedBackend(recovers_to=None)}
    )
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_FAULTED
    assert job.error == f"agent restarted during operation {snap.operation_id}; reset it"
    op = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=snap.operation_id))
    assert op.status == pb.OPERATION_STATUS_FAILED
    reset = await agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a"))
    assert reset.state == pb.JOB_STATE_IDLE


async def test_finished_operations_are_pruned_but_not_the_ones_jobs_point_to(
    agents: AgentRunner,
) -> None:
    agent = await agents.start(max_operations=2)
    await agent.grant("job-a")
    first = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a"))
    await agent.wait(first.operation_id)
    second = await agent.stub.Restore(pb.RestoreRequest(job_id="job-a"))
    await agent.wait(second.operation_id)
    third = await agent.stub.Restore(pb.RestoreRequest(job_id="job-a"))  # already RUNNING
    agent = await agents.restart(agent)  # pruning runs at start
    ops = {}
    for reply in (first, second, third):
        try:
            ops[reply.operation_id] = await agent.stub.GetOperation(
                pb.GetOperationRequest(operation_id=reply.operation_id)
            )
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
    assert third.operation_id in ops  # the job's current operation is kept
    assert len(ops) == 2
