"""The orchestrator gRPC service against real in-process agents (sim backend)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
GS = opb.GroupStatus


async def two_node_cluster(cluster: Cluster) -> object:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    return cluster.stub()


async def test_first_acquire_grants_on_every_node(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    resp = await acquire(stub, "a", "g")
    assert resp.success and not resp.context_restored and resp.grant_epoch == 1
    for node in ("node-a", "node-b"):
        assert await cluster.agents[node].state("a") == pb.JOB_STATE_RUNNING
    st = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))
    g = st.group
    assert g.group_state == GS.STATE_LOCKED
    assert (g.locking_job, g.active_job, g.loaded_job) == ("a", "a", "a")
    assert list(g.nodes) == ["node-a", "node-b"] and g.grant_epoch == 1 and g.switch_count == 1
    states = {(s.agent, s.job_id): s.job_state for s in st.agent_job_states}
    assert states == {
        ("node-a", "a"): opb.SnapshotAgentJobState.STATE_RUNNING,
        ("node-b", "a"): opb.SnapshotAgentJobState.STATE_RUNNING,
    }


async def test_zero_cost_reacquire_touches_no_agent(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    out = await yield_(stub, "a", "g")
    assert out.success and out.snapshot_deferred and out.pending_waiters == 0
    st = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))
    assert st.group.group_state == GS.STATE_IDLE_YIELDED and st.group.loaded_job == "a"
    before = {n: (await a.jobs())["a"].operation_id for n, a in cluster.agents.items()}
    resp = await acquire(stub, "a", "g")
    assert resp.success and not resp.context_restored and resp.grant_epoch == 2
    await ev.wait_for(K.KIND_GRANTED, job="a")
    # no switch, no snapshot, no restore happened, and the agents ran no operation
    assert ev.kinds() == ["YIELDED", "GRANTED"]
    after = {n: (await a.jobs())["a"].operation_id for n, a in cluster.agents.items()}
    assert before == after
    # holder re-acquire returns at once too, same epoch
    again = await acquire(stub, "a", "g")
    assert again.grant_epoch == 2 and not again.context_restored
    ev.cancel()


async def test_deferred_snapshot_then_switch_restores_both_nodes(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g", footprint_bytes=2 * 1024**3)
    out = await yield_(stub, "a", "g")
    assert out.snapshot_deferred
    for agent in cluster.agents.values():
        assert await agent.state("a") == pb.JOB_STATE_RUNNING  # nothing snapshotted
    ev = await Events.open(stub, "g")
    b = await acquire(stub, "b", "g")  # snapshots a on both nodes, grants b
    assert b.success and not b.context_restored and b.grant_epoch == 2
    for agent in cluster.agents.values():
        jobs = await agent.jobs()
        assert jobs["a"].state == pb.JOB_STATE_SAVED
        assert jobs["b"].state == pb.JOB_STATE_RUNNING
    a_waits = asyncio.ensure_future(acquire(stub, "a", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="a")
    out = await yield_(stub, "b", "g")
    assert out.pending_waiters == 1 and not out.snapshot_deferred
    a = await a_waits
    assert a.success and a.context_restored and a.grant_epoch == 3
    for node in ("node-a", "node-b"):
        done = await ev.wait_for(K.KIND_RESTORE_DONE, job="a", node=node)
        assert done.bytes == 2 * 1024**3
        snap = await ev.wait_for(K.KIND_SNAPSHOT_DONE, job="b", node=node)
        assert snap.bytes > 0
    for agent in cluster.agents.values():
        jobs = await agent.jobs()
        assert jobs["a"].state == pb.JOB_STATE_RUNNING and jobs["b"].state == pb.JOB_STATE_SAVED
    ev.cancel()


async def test_status_codes(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await yield_(stub, "b", "g")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "held by job 'a'" in (info.value.details() or "")
    for call in (acquire(stub, "a", "nope"), yield_(stub, "a", "nope")):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "known groups: g" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    for job, group in (("", "g"), ("a", ""), ("bad job", "g"), ("a", "g/../x y")):
        for call in (acquire(stub, job, group), yield_(stub, job, group)):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (job, group)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await acquire(stub, "a", "g", footprint_bytes=-1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # idempotent yield: holder yields twice, then nobody holds -> OK
    assert (await yield_(stub, "a", "g")).success
    assert (await yield_(stub, "a", "g")).success
    assert (await yield_(stub, "zz", "g")).success
    groups = await stub.ListGroups(opb.ListGroupsRequest())
    assert list(groups.group_ids) == ["g"]


async def test_cancelled_waiter_is_never_granted(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b = acquire(stub, "b", "g")
    b_task = asyncio.ensure_future(b)
    await ev.wait_for(K.KIND_QUEUED, job="b")
    c_task = asyncio.ensure_future(acquire(stub, "c", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="c")
    b.cancel()
    await ev.wait_for(K.KIND_CANCELLED, job="b")
    st = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))
    assert list(st.group.waiting_jobs) == ["c"] and st.group.waiter_queue_depth == 1
    await yield_(stub, "a", "g")
    c = await c_task
    assert c.success
    with pytest.raises(asyncio.CancelledError):
        await b_task
    assert "b" not in {e.job_id for e in ev.seen if e.kind == K.KIND_GRANTED}
    for agent in cluster.agents.values():
        assert "b" not in await agent.jobs()
    ev.cancel()


async def test_acquire_deadline_leaves_the_queue(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Acquire(opb.AcquireRequest(job_id="b", group_id="g"), timeout=0.2)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await ev.wait_for(K.KIND_CANCELLED, job="b")
    out = await yield_(stub, "a", "g")
    assert out.pending_waiters == 0 and out.snapshot_deferred
    ev.cancel()


async def test_a_unary_timeout_ms_without_a_grpc_deadline_is_enforced(cluster: Cluster) -> None:
    """docs/api.md: on a unary call the nearer of timeout_ms and the call's deadline counts.
    A waiter only queued behind a holder, with timeout_ms and no gRPC deadline, waited for
    ever (its deadline was left to a gRPC deadline it did not have)."""
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    # Bounded by the test, not by the call: the call itself carries no deadline.
    waiting = asyncio.ensure_future(
        stub.Acquire(opb.AcquireRequest(job_id="b", group_id="g", timeout_ms=300))
    )
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(asyncio.shield(waiting), 20)
    finally:
        waiting.cancel()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timeout_ms" in (info.value.details() or ""), info.value.details()
    await ev.wait_for(K.KIND_CANCELLED, job="b")
    out = await yield_(stub, "a", "g")
    assert out.pending_waiters == 0 and out.snapshot_deferred
    ev.cancel()


async def test_concurrent_acquires_of_one_job_share_the_slot(cluster: Cluster) -> None:
    stub = await two_node_cluster(cluster)
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    first = acquire(stub, "b", "g")
    first_task = asyncio.ensure_future(first)
    second_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    first.cancel()
    st = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))
    assert list(st.group.waiting_jobs) == ["b"]
    await yield_(stub, "a", "g")
    second = await second_task
    assert second.success
    with pytest.raises(asyncio.CancelledError):
        await first_task
    ev.cancel()


async def test_health_and_reflection(cluster: Cluster) -> None:
    await two_node_cluster(cluster)
    channel = grpc.aio.insecure_channel(cluster.orch_address)
    cluster.channels.append(channel)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    async for resp in call:
        names = {s.name for s in resp.list_services_response.service}
        assert "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService" in names
        break
