"""Switch behaviour against real agents: concurrency across nodes, failures, departures."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
GS = opb.GroupStatus


async def status(stub: object, group: str = "g") -> opb.GroupStatus:
    resp = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group))  # type: ignore[attr-defined]
    return resp.group


async def assert_only_resident(cluster: Cluster, job: str) -> None:
    for agent in cluster.agents.values():
        running = {j for j, s in (await agent.jobs()).items() if s.state == pb.JOB_STATE_RUNNING}
        assert running == {job}, (agent.name, running)


async def test_nodes_switch_concurrently_and_grant_waits_for_all(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b", sim={"extra_latency_s": 0.3})  # every copy >= 0.3 s
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    await yield_(stub, "a", "g")
    await acquire(stub, "b", "g")  # a snapshotted everywhere, b granted
    ev = await Events.open(stub, "g")
    a_task = asyncio.ensure_future(acquire(stub, "a", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="a")
    await yield_(stub, "b", "g")
    a = await a_task
    assert a.context_restored
    await ev.wait_for(K.KIND_GRANTED, job="a")
    order = [(opb.OrchestratorEvent.Kind.Name(e.kind), e.job_id, e.node) for e in ev.seen]
    restore_a_fast = order.index(("KIND_RESTORE_DONE", "a", "node-a"))
    snapshot_b_slow = order.index(("KIND_SNAPSHOT_DONE", "b", "node-b"))
    restore_a_slow = order.index(("KIND_RESTORE_DONE", "a", "node-b"))
    granted = order.index(("KIND_GRANTED", "a", ""))
    # node-a finished its whole step while node-b was still snapshotting: concurrent nodes,
    # and node-a restored as soon as its own snapshot was done.
    assert restore_a_fast < snapshot_b_slow < restore_a_slow < granted
    assert order.index(("KIND_SWITCH_DONE", "a", "")) < granted
    await assert_only_resident(cluster, "a")
    ev.cancel()


async def test_random_failures_are_reset_and_retried(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b", sim={"fail_probability": 0.5, "seed": 7})
    await cluster.start_orchestrator(
        groups={"g": ["node-a", "node-b"]}, backoff_initial_s=0.001, backoff_max_s=0.01
    )
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")
    for i in range(6):
        job, other = ("b", "a") if i % 2 == 0 else ("a", "b")
        waiter = asyncio.ensure_future(acquire(stub, job, "g"))
        await ev.wait_for(K.KIND_QUEUED, job=job)
        await yield_(stub, other, "g")
        assert (await waiter).success
        await assert_only_resident(cluster, job)
        await ev.wait_for(K.KIND_GRANTED, job=job)
        ev.seen = [e for e in ev.seen if e.kind == K.KIND_SWITCH_FAILED]
    assert ev.seen, "with p=0.5 over 11 copies some must have failed and been retried"
    assert all(e.node == "node-b" for e in ev.seen)
    st = await status(stub)
    assert st.group_state == GS.STATE_LOCKED and st.switch_count == 7
    ev.cancel()


async def test_failure_injection_emits_failures_and_recovers(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"fail_probability": 1.0})
    await cluster.start_orchestrator(
        groups={"g": ["node-a"]}, backoff_initial_s=0.005, backoff_max_s=0.02
    )
    stub = cluster.stub()
    await acquire(stub, "a", "g")  # Grant only: no copy, cannot fail
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await yield_(stub, "a", "g")
    first = await ev.wait_for(K.KIND_SWITCH_FAILED, job="b")
    assert first.node == "node-a" and "snapshot" in first.detail
    await ev.wait_for(K.KIND_SWITCH_FAILED, job="b")  # retried (after ResetJob) and failing again
    st = await status(stub)
    assert st.group_state == GS.STATE_SWITCHING and "snapshot" in st.detail
    assert not b_task.done()
    # The device heals: restart the agent without faults (same port, same state dir).
    agent = cluster.agents["node-a"]
    port = int(agent.address.rsplit(":", 1)[1])
    cfg = agent.config
    await cluster.stop_agent("node-a")
    await cluster.start_agent("node-a", port=port, state_dir=str(cfg.state_dir))
    b = await b_task
    assert b.success and b.grant_epoch == 2
    await assert_only_resident(cluster, "b")
    jobs = await cluster.agents["node-a"].jobs()
    assert jobs["a"].state == pb.JOB_STATE_SAVED
    ev.cancel()


async def test_unreachable_agent_makes_group_unknown_until_it_returns(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(
        groups={"g": ["node-a", "node-b"]}, backoff_initial_s=0.01, backoff_max_s=0.05
    )
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    await yield_(stub, "a", "g")
    agent_b = cluster.agents["node-b"]
    port_b = int(agent_b.address.rsplit(":", 1)[1])
    await cluster.stop_agent("node-b")
    st = await status(stub)
    assert st.group_state == GS.STATE_UNKNOWN
    assert "node-b" in st.detail and st.active_job == "a" and st.loaded_job == ""
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    failed = await ev.wait_for(K.KIND_SWITCH_FAILED, node="node-b")
    assert "unreachable" in failed.detail or "UNAVAILABLE" in failed.detail or failed.detail
    assert (await status(stub)).group_state == GS.STATE_UNKNOWN
    await cluster.start_agent("node-b", port=port_b)
    b = await b_task
    assert b.success
    st = await status(stub)
    assert st.group_state == GS.STATE_LOCKED and st.detail == "" and st.loaded_job == "b"
    await assert_only_resident(cluster, "b")
    ev.cancel()


async def test_one_failing_group_does_not_block_another(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b", sim={"fail_probability": 1.0})
    await cluster.start_orchestrator(
        groups={"good": ["node-a"], "bad": ["node-b"]},
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        # Still failing while "good" hands over, not yet degraded (tests/faults has that).
        max_operation_failures=1_000_000,
    )
    stub = cluster.stub()
    ev = await Events.open(stub)
    await acquire(stub, "x", "bad")
    y_task = asyncio.ensure_future(acquire(stub, "y", "bad"))
    await ev.wait_for(K.KIND_QUEUED, job="y")
    await yield_(stub, "x", "bad")
    await ev.wait_for(K.KIND_SWITCH_FAILED, job="y")  # "bad" keeps failing
    for _ in range(3):  # "good" hands over normally meanwhile
        await acquire(stub, "p", "good")
        await yield_(stub, "p", "good")
        await acquire(stub, "q", "good")
        await yield_(stub, "q", "good")
    assert not y_task.done()
    y_task.cancel()
    ev.cancel()


async def test_target_cancelling_during_its_switch(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 0.2})
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_call = acquire(stub, "b", "g")
    b_task = asyncio.ensure_future(b_call)
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await yield_(stub, "a", "g")
    await ev.wait_for(K.KIND_SWITCH_STARTED, job="b")
    b_call.cancel()
    await ev.wait_for(K.KIND_CANCELLED, job="b")
    await ev.wait_for(K.KIND_SWITCH_DONE, job="b")  # the switch is finished, not left half-done
    st = await status(stub)
    assert st.group_state == GS.STATE_IDLE_YIELDED and st.locking_job == ""
    assert st.active_job == "b" and st.loaded_job == "b"
    await assert_only_resident(cluster, "b")
    assert "GRANTED" not in ev.kinds(job="b")
    with pytest.raises(asyncio.CancelledError):
        await b_task
    # b is resident and yielded: its next Acquire is zero-cost
    again = await acquire(stub, "b", "g")
    assert not again.context_restored and again.grant_epoch == 3
    ev.cancel()


async def test_target_cancelling_during_its_switch_hands_on_to_next(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 0.2})
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_call = acquire(stub, "b", "g")
    b_task = asyncio.ensure_future(b_call)
    await ev.wait_for(K.KIND_QUEUED, job="b")
    c_task = asyncio.ensure_future(acquire(stub, "c", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="c")
    await yield_(stub, "a", "g")
    await ev.wait_for(K.KIND_SWITCH_STARTED, job="b")
    b_call.cancel()
    c = await c_task
    assert c.success and c.grant_epoch == 3
    await assert_only_resident(cluster, "c")
    assert "GRANTED" not in ev.kinds(job="b")
    with pytest.raises(asyncio.CancelledError):
        await b_task
    ev.cancel()


async def test_target_yielding_during_its_switch_aborts_its_acquire(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 0.2})
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await yield_(stub, "a", "g")
    await ev.wait_for(K.KIND_SWITCH_STARTED, job="b")
    out = await yield_(stub, "b", "g")
    assert out.success and out.snapshot_deferred
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await b_task
    assert info.value.code() == grpc.StatusCode.ABORTED
    await ev.wait_for(K.KIND_SWITCH_DONE, job="b")
    st = await status(stub)
    assert st.group_state == GS.STATE_IDLE_YIELDED and st.active_job == "b"
    ev.cancel()


async def test_observed_loss_of_residency_forces_a_real_switch(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    await yield_(stub, "a", "g")
    # Someone snapshots a behind the orchestrator's back (e.g. an llm-d client).
    agent = cluster.agents["node-a"]
    op = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="a", group="g"))
    await agent.stub.WaitOperation(
        pb.WaitOperationRequest(operation_id=op.operation_id, timeout_ms=5000)
    )
    st = await status(stub)  # the live read notices: a is not loaded any more
    assert st.group_state == GS.STATE_IDLE_YIELDED and st.loaded_job == ""
    again = await acquire(stub, "a", "g")
    assert again.context_restored  # restored for real, not a zero-cost re-acquire
    await assert_only_resident(cluster, "a")


async def test_agent_restart_mid_operation_is_reset_and_retried(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 30.0}, grace_period_s=0.1)
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(
        groups={"g": ["node-a", "node-b"]}, backoff_initial_s=0.01, backoff_max_s=0.05
    )
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await yield_(stub, "a", "g")
    # node-b's snapshot done => node-a's (30 s) snapshot was started at the same time
    await ev.wait_for(K.KIND_SNAPSHOT_DONE, job="a", node="node-b")
    agent = cluster.agents["node-a"]
    assert await agent.state("a") == pb.JOB_STATE_TRANSITIONING
    # The agent dies mid-snapshot and comes back (same port and state, no slowness now).
    port = int(agent.address.rsplit(":", 1)[1])
    state_dir = str(agent.config.state_dir)
    await cluster.stop_agent("node-a")
    await cluster.start_agent("node-a", port=port, state_dir=state_dir)
    b = await b_task
    assert b.success
    await assert_only_resident(cluster, "b")
    assert await cluster.agents["node-a"].state("a") == pb.JOB_STATE_SAVED
    ev.cancel()


async def test_a_degraded_node_fails_the_waiting_acquire_at_once(cluster: Cluster) -> None:
    agent = await cluster.start_agent("node-a")
    await cluster.start_orchestrator(
        groups={"g": ["node-a"]}, max_refusals=2, backoff_initial_s=0.001
    )
    stub = cluster.stub()
    # Something wedged the node for this group: a grant mark the orchestrator's epochs
    # cannot pass (a mark below 2**62 is passed: see test_hostile.py).
    stray = pb.GrantRequest(job_id="stray", group="g", grant_epoch=2**62, restore=True, wait_ms=1)
    await agent.stub.Grant(stray)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(acquire(stub, "a", "g"), 30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "node node-a is degraded" in (err.value.details() or "")
    # The first switch was the only one: none started on the degraded node after it.
    after = await status(stub)
    assert (after.grant_epoch, after.switch_count, list(after.waiting_jobs)) == (1, 0, [])
