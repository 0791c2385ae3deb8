"""One node step of a switch in one call: Snapshot/Restore ``wait_ms``, Grant evict+restore."""

from __future__ import annotations

import asyncio

import grpc

from tests.agent.agent_doubles import GatedBackend
from tests.agent.conftest import DEFAULT_FOOTPRINT, Agent, AgentRunner, GiB
from tests.agent.grant_calls import a_running_b_saved, rpc_error, step
from tslice.agent.backends import sim
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

COMPLETE = pb.OPERATION_STATUS_COMPLETE
FAILED = pb.OPERATION_STATUS_FAILED
PENDING = pb.OPERATION_STATUS_PENDING
RUNNING = pb.JOB_STATE_RUNNING
SAVED = pb.JOB_STATE_SAVED


def closed_gate(gated: GatedBackend) -> None:
    gated.gate = asyncio.Event()
    gated.started = asyncio.Event()


# ---- Snapshot / Restore carry the operation --------------------------------------------------


async def test_snapshot_and_restore_with_wait_ms_reply_with_the_finished_operation(
    agent: Agent,
) -> None:
    await agent.grant("job-a")
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g", wait_ms=10_000))
    assert snap.operation.status == COMPLETE
    assert (snap.operation.job_id, snap.operation.kind) == ("job-a", "snapshot")
    assert snap.operation.storage_bytes == DEFAULT_FOOTPRINT
    polled = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=snap.operation_id))
    assert polled == snap.operation
    assert await agent.state("job-a") == SAVED

    back = await agent.stub.Restore(pb.RestoreRequest(job_id="job-a", group="g", wait_ms=10_000))
    assert back.operation.status == COMPLETE
    assert back.operation.snapshot_device_bytes == DEFAULT_FOOTPRINT
    assert await agent.state("job-a") == RUNNING


async def test_without_wait_ms_the_reply_is_immediate_and_carries_the_pending_operation(
    agents: AgentRunner,
) -> None:
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    await agent.grant("job-a")
    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert snap.HasField("operation") and snap.operation.status == PENDING
    assert snap.operation.job_id == "job-a"
    # A wait that runs out replies with the operation as it stands.
    err = await rpc_error(agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", wait_ms=1)))
    assert err.code() == grpc.StatusCode.ABORTED
    gated.release()
    assert (await agent.wait(snap.operation_id)).status == COMPLETE


async def test_negative_waits_are_invalid(agent: Agent) -> None:
    for call in (
        agent.stub.Snapshot(pb.SnapshotRequest(job_id="a", wait_ms=-1)),
        agent.stub.Restore(pb.RestoreRequest(job_id="a", wait_ms=-1)),
        agent.stub.Grant(pb.GrantRequest(job_id="a", group="g", wait_ms=-1)),
        agent.stub.Grant(pb.GrantRequest(job_id="a", group="g", evict=["bad id"])),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await agent.jobs() == {}


# ---- Grant: evict, restore, record, in one call ----------------------------------------------


async def test_one_grant_evicts_restores_and_records(agent: Agent) -> None:
    await a_running_b_saved(agent)
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert reply.granted and reply.restored and reply.state == RUNNING
    assert [(op.job_id, op.kind, op.status) for op in reply.operations] == [
        ("job-a", "snapshot", COMPLETE),
        ("job-b", "restore", COMPLETE),
    ]
    assert reply.operations[0].storage_bytes == DEFAULT_FOOTPRINT
    assert reply.operations[1].snapshot_device_bytes == DEFAULT_FOOTPRINT
    # Each move is an ordinary operation, pollable by its id.
    for op_id, op in zip(reply.operation_ids, reply.operations, strict=True):
        polled = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=op_id))
        assert polled == op
    jobs = await agent.jobs()
    assert (jobs["job-a"].state, jobs["job-b"].state) == (SAVED, RUNNING)
    # The grant is recorded: epoch 3 named job-b, so an older or reused epoch is refused.
    err = await rpc_error(agent.stub.Grant(step("job-a", epoch=3, evict=["job-b"])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in err.details()
    assert await agent.state("job-b") == RUNNING

    again = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert again.granted and not again.restored and list(again.operations) == []


async def test_grant_of_an_unknown_job_evicts_then_activates(agent: Agent) -> None:
    await agent.grant("job-a", epoch=1)
    reply = await agent.stub.Grant(step("job-c", epoch=2, evict=["job-a", "job-a", "job-c"]))
    assert reply.granted and not reply.restored
    assert [(op.job_id, op.kind) for op in reply.operations] == [
        ("job-a", "snapshot"),
        ("job-c", "activate"),
    ]
    assert (await agent.jobs())["job-c"].device_bytes == DEFAULT_FOOTPRINT


async def test_stale_grant_evicts_nothing(agent: Agent) -> None:
    await a_running_b_saved(agent)
    err = await rpc_error(agent.stub.Grant(step("job-b", epoch=1, evict=["job-a"])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale" in err.details()
    assert await agent.state("job-a") == RUNNING


async def test_safety_net_still_refuses_a_second_resident_of_the_group(agent: Agent) -> None:
    await a_running_b_saved(agent)
    err = await rpc_error(agent.stub.Grant(step("job-b", epoch=3, evict=[])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "job job-a of group g is RUNNING" in err.details()
    jobs = await agent.jobs()
    assert (jobs["job-a"].state, jobs["job-b"].state) == (RUNNING, SAVED)


async def test_restore_false_keeps_the_original_refusal_of_a_saved_job(agent: Agent) -> None:
    await a_running_b_saved(agent)
    request = step("job-b", epoch=3, evict=["job-a"])
    request.restore = False
    err = await rpc_error(agent.stub.Grant(request))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "restore it first" in err.details()
    assert await agent.state("job-b") == SAVED


async def test_wait_ms_elapsing_replies_with_pending_operations_and_reissue_continues(
    agents: AgentRunner,
) -> None:
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    gated.release()
    await a_running_b_saved(agent)
    closed_gate(gated)

    first = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"], wait_ms=30))
    assert not first.granted and first.state == SAVED
    assert [(op.job_id, op.kind, op.status) for op in first.operations] == [
        ("job-a", "snapshot", PENDING)
    ]
    # Re-issued while the snapshot still runs: it waits on the same operation, starts none.
    second = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"], wait_ms=30))
    assert not second.granted and list(second.operation_ids) == list(first.operation_ids)
    assert gated.calls.count("snapshot") == 2  # one in setup, one for this hand-over

    gated.release()
    assert (await agent.wait(first.operation_ids[0])).status == COMPLETE
    done = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert done.granted and done.restored
    assert [(op.job_id, op.kind) for op in done.operations] == [("job-b", "restore")]


async def test_reissued_grant_follows_a_restore_already_running(agents: AgentRunner) -> None:
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    gated.release()
    await a_running_b_saved(agent)
    assert (await agent.snapshot("job-a")).status == COMPLETE
    closed_gate(gated)

    first = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"], wait_ms=30))
    assert not first.granted
    assert [(op.kind, op.status) for op in first.operations] == [("restore", PENDING)]
    assert await agent.state("job-b") == pb.JOB_STATE_TRANSITIONING
    # Re-issued while the restore runs: it follows that operation instead of refusing.
    second = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"], wait_ms=30))
    assert not second.granted and list(second.operation_ids) == list(first.operation_ids)
    gated.release()
    assert (await agent.wait(first.operation_ids[0])).status == COMPLETE
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert reply.granted and reply.state == RUNNING and list(reply.operations) == []
    assert gated.calls.count("restore") == 1


async def test_failed_eviction_is_reported_in_the_reply_not_as_an_rpc_error(
    agents: AgentRunner,
) -> None:
    backend = sim.SimBackend(
        node="node-a", capacity_bytes=10 * GiB, bandwidth_bytes_per_s=10**12, latency_s=0.0
    )
    agent = await agents.start(instances={"sim": backend})
    await a_running_b_saved(agent)
    backend.fail_probability = 1.0
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert not reply.granted and not reply.restored
    assert [(op.job_id, op.kind, op.status) for op in reply.operations] == [
        ("job-a", "snapshot", FAILED)
    ]
    assert "injected failure" in reply.operations[0].error
    jobs = await agent.jobs()
    assert (jobs["job-a"].state, jobs["job-b"].state) == (pb.JOB_STATE_FAULTED, SAVED)

    # The sim says job-a still runs, so a re-issued Grant retries its snapshot (as Snapshot
    # would) without a ResetJob, and reports the new failure the same way.
    again = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert not again.granted and [op.status for op in again.operations] == [FAILED]
    assert again.operation_ids[0] != reply.operation_ids[0]
    backend.fail_probability = 0.0
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert reply.granted and reply.restored


async def test_faulted_evictee_the_backend_cannot_vouch_for_is_refused(
    agents: AgentRunner,
) -> None:
    gated = GatedBackend(recovers_to=None)
    agent = await agents.start(
        default_backend="gated", instances={"gated": gated}, operation_timeout_s=0.05
    )
    await agent.grant("job-a", epoch=1)
    # The snapshot hangs past its deadline: job-a is FAULTED and nobody can tell where it is.
    assert (await agent.snapshot("job-a")).status == FAILED
    assert await agent.state("job-a") == pb.JOB_STATE_FAULTED
    err = await rpc_error(agent.stub.Grant(step("job-b", epoch=2, evict=["job-a"])))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "ResetJob" in err.details()
    assert "job-b" not in await agent.jobs()


async def test_failed_restore_is_reported_in_the_reply(agents: AgentRunner) -> None:
    backend = sim.SimBackend(
        node="node-a", capacity_bytes=10 * GiB, bandwidth_bytes_per_s=10**12, latency_s=0.0
    )
    agent = await agents.start(instances={"sim": backend})
    await a_running_b_saved(agent)
    assert (await agent.snapshot("job-a")).status == COMPLETE
    backend.fail_probability = 1.0
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert not reply.granted and not reply.restored
    assert [(op.job_id, op.kind, op.status) for op in reply.operations] == [
        ("job-b", "restore", FAILED)
    ]
    assert await agent.state("job-b") == pb.JOB_STATE_FAULTED


# ---- GrantStream: the same Grants over one long-lived call ----------------------------------


async def test_grant_stream_replies_by_request_id_and_survives_a_refusal(agent: Agent) -> None:
    await a_running_b_saved(agent)
    call = agent.stub.GrantStream()
    try:
        # A refused Grant is a reply with the unary Grant's status, not the end of the stream.
        await call.write(
            pb.GrantStreamRequest(request_id=7, grant=step("bad id", epoch=3, evict=[]))
        )
        refused = await call.read()
        assert refused.request_id == 7 and not refused.HasField("grant")
        assert refused.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "job_id 'bad id' is malformed" in refused.status_message
        unary = await rpc_error(agent.stub.Grant(step("bad id", epoch=3, evict=[])))
        assert (unary.code(), unary.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            refused.status_message,
        )
        # The hand-over a -> b on the same stream: evicted, restored, recorded.
        await call.write(
            pb.GrantStreamRequest(request_id=8, grant=step("job-b", epoch=3, evict=["job-a"]))
        )
        done = await call.read()
        assert done.request_id == 8 and done.status_code == 0
        assert done.grant.granted and done.grant.restored and done.grant.state == RUNNING
        assert [op.kind for op in done.grant.operations] == ["snapshot", "restore"]
        assert (await agent.state("job-a"), await agent.state("job-b")) == (SAVED, RUNNING)
        # A stale epoch is refused as by the unary Grant (nothing evicted).
        await call.write(
            pb.GrantStreamRequest(request_id=9, grant=step("job-a", epoch=2, evict=["job-b"]))
        )
        stale = await call.read()
        assert stale.status_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert await agent.state("job-b") == RUNNING
    finally:
        call.cancel()


async def test_grant_stream_runs_grants_concurrently(agents: AgentRunner) -> None:
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    gated.release()
    assert await agent.grant("slow", epoch=1) == RUNNING
    closed_gate(gated)
    call = agent.stub.GrantStream()
    try:
        # The eviction of "slow" waits on the gate; a Grant of another group is not held up.
        slow = pb.GrantRequest(
            job_id="next", group="g", grant_epoch=2, evict=["slow"], restore=True, wait_ms=10_000
        )
        await call.write(pb.GrantStreamRequest(request_id=1, grant=slow))
        await gated.started.wait()
        other = pb.GrantRequest(
            job_id="other", group="h", grant_epoch=1, restore=True, wait_ms=10_000
        )
        await call.write(pb.GrantStreamRequest(request_id=2, grant=other))
        first = await call.read()
        assert first.request_id == 2 and first.grant.granted
        gated.gate.set()
        second = await call.read()
        assert second.request_id == 1 and second.grant.granted
    finally:
        call.cancel()
