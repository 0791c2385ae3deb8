"""Agent faults during a switch, on real processes: killed and restarted mid-snapshot, an
operation past its deadline, a snapshot that always fails, an agent that does not answer.

Each test has its group (see conftest.py): ``restart`` on node-hold (copies that never
end before the test kills the agent, which it restarts with quick ones),
``deadline`` on node-hang (its first copy hangs; the agent's operation deadline is 1 s),
``failing`` and ``failing-retried`` on node-fail (every copy fails), ``down`` on
node-down.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.faults.processes import Stack
from tests.faults.stack import (
    GS,
    WAIT_S,
    K,
    Orchestrator,
    job_states,
    running,
    switch_under_way,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

#: A waiter's deadline where what is tested is the answer at its deadline.
SHORT_S = 3.0


async def test_an_agent_killed_mid_snapshot_and_restarted_finishes_the_switch(
    stack: Stack,
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    agent = stack.agents["node-hold"]
    try:
        events, waiter = await switch_under_way(o, "restart")
        assert (await job_states(agent.address, "restart"))["a"].state == (
            pb.JOB_STATE_TRANSITIONING
        )
        agent.kill()  # mid-copy (a copy here ends only so): the snapshot's operation is cut
        failed = await events.wait_for(K.KIND_SWITCH_FAILED, node="node-hold")
        assert "node-hold" in failed.detail or agent.address in failed.detail, failed
        st = await o.status("restart")
        assert st.group_state in (GS.STATE_SWITCHING, GS.STATE_UNKNOWN), st
        assert "node-hold" in st.detail, st.detail
        # The agent settles the cut operation from its backend; its copies are quick now.
        agent.restart_as("--sim-extra-latency", "0")
        assert (await waiter).grant_epoch == 2
        states = await job_states(agent.address, "restart")
        assert running(states) == {"b"} and states["a"].state == pb.JOB_STATE_SAVED
        events.cancel()
    finally:
        await o.close()


async def test_an_operation_past_its_deadline_fails_and_the_switch_retries_it(
    stack: Stack,
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    try:
        events, waiter = await switch_under_way(o, "deadline")
        failed = await events.wait_for(K.KIND_SWITCH_FAILED, node="node-hang")
        assert "deadline" in failed.detail or "did not finish" in failed.detail, failed
        assert (await waiter).grant_epoch == 2  # the retried snapshot did not hang
        states = await job_states(stack.agents["node-hang"].address, "deadline")
        assert running(states) == {"b"} and states["a"].state == pb.JOB_STATE_SAVED
        events.cancel()
    finally:
        await o.close()


async def _deadline_exceeded(waiter: asyncio.Task[object]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await waiter
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    return err.value.details() or ""


async def test_a_snapshot_that_keeps_failing_degrades_the_group_and_names_the_reason(
    stack: Stack,
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    try:
        # No short deadline: the waiter is refused once the node is degraded, however
        # long its three failed snapshots take (a 3-s deadline was the margin once).
        events, waiter = await switch_under_way(o, "failing")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await waiter
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "node-fail" in (err.value.details() or "")
        assert "injected failure" in (err.value.details() or "")
        st = await o.status("failing")
        assert [d.node for d in st.degraded] == ["node-fail"], st
        states = await job_states(stack.agents["node-fail"].address, "failing")
        assert states["a"].state == pb.JOB_STATE_FAULTED, states
        events.cancel()
    finally:
        await o.stub.ClearDegraded(opb.ClearDegradedRequest(group_id="failing"), timeout=WAIT_S)
        await o.close()


async def test_a_waiter_with_a_deadline_is_told_which_agent_is_unreachable(
    stack: Stack,
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    agent = stack.agents["node-down"]
    try:
        holder = (await o.status("down")).locking_job
        if holder:  # left by the orchestrator-kill test: the group must be free to switch
            await o.yield_(holder, "down")
        agent.kill()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await o.acquire("j", "down", timeout=SHORT_S)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert "node-down" in (err.value.details() or ""), err.value
    finally:
        agent.restart()
        await o.close()
