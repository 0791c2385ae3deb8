"""The orchestrator SIGKILLed with a group in each state, and an agent down when it starts.

One kill covers every state at once, each in a group of its own: IDLE, LOCKED,
IDLE_YIELDED, SWITCHING (a snapshot under way on node-1) and LOCKED with two waiters;
group ``down``'s agent is killed first, so the new orchestrator starts without it.
node-1 is frozen (SIGSTOP) from the moment the switch starts until the orchestrator is
dead: its 1-s snapshot cannot report back first, however slow the machine is (on a
loaded CI runner the steps between the two once took longer than the snapshot).
After the restart (same port, same state directory) each group is what it was: nothing
a client did is lost, the switch in flight is finished, and the queue keeps its order.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from tests.faults.processes import Stack
from tests.faults.stack import GS, K, Orchestrator, job_states, running
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


async def _unavailable(task: asyncio.Task[object]) -> None:
    """A call cut by the kill fails UNAVAILABLE (the client library re-issues it)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await task
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


async def test_an_orchestrator_killed_in_every_group_state_resumes_each(stack: Stack) -> None:
    o = Orchestrator(stack.orchestrator.address)
    await o.acquire("a", "locked")
    await o.acquire("a", "yielded")
    await o.yield_("a", "yielded")
    locked = await o.status("locked")
    # LOCKED with two waiters, queued b then c.
    await o.acquire("a", "waiters")
    waiting = await o.events("waiters")
    cut = [o.acquiring("b", "waiters")]
    await waiting.wait_for(K.KIND_QUEUED, job="b")
    cut.append(o.acquiring("c", "waiters"))
    await waiting.wait_for(K.KIND_QUEUED, job="c")
    # SWITCHING: a yields to b, whose switch starts with a's 1-s snapshot on node-1,
    # which is frozen at once so that the switch is still in flight at the kill.
    await o.acquire("a", "switching")
    switching = await o.events("switching")
    cut.append(o.acquiring("b", "switching"))
    await switching.wait_for(K.KIND_QUEUED, job="b")
    await o.yield_("a", "switching")
    await switching.wait_for(K.KIND_SWITCH_STARTED, job="b")
    node_1 = stack.agents["node-1"]
    node_1.signal(signal.SIGSTOP)
    try:
        # An agent that will be down when the orchestrator starts again.
        await o.acquire("a", "down")
        await o.yield_("a", "down")
        stack.agents["node-down"].kill()
        stack.orchestrator.kill()
    finally:
        node_1.signal(signal.SIGCONT)
    for task in cut:
        await _unavailable(task)
    waiting.cancel()
    switching.cancel()
    await o.close()
    stack.orchestrator.restart()
    o = Orchestrator(stack.orchestrator.address)
    try:
        await _resumed(o, stack, locked_epoch=locked.grant_epoch)
    finally:
        await o.close()


async def _resumed(o: Orchestrator, stack: Stack, *, locked_epoch: int) -> None:
    node_1 = stack.agents["node-1"].address
    # SWITCHING: the switch in flight is finished; b's re-issued Acquire gets its grant.
    b = await o.acquire("b", "switching")
    assert b.grant_epoch == 2
    states = await job_states(node_1, "switching")
    assert running(states) == {"b"} and states["a"].state == pb.JOB_STATE_SAVED

    # Waiters: the queue came back in its order, even when its jobs return in another.
    events = await o.events("waiters")
    c_task = o.acquiring("c", "waiters")
    await events.wait_for(K.KIND_QUEUED, job="c")  # "re-attached after restart"
    b_task = o.acquiring("b", "waiters")
    await events.wait_for(K.KIND_QUEUED, job="b")
    await o.yield_("a", "waiters")
    assert (await b_task).grant_epoch == 2 and not c_task.done()
    await o.yield_("b", "waiters")
    assert (await c_task).grant_epoch == 3
    await events.wait_for(K.KIND_GRANTED, job="c")
    granted = [e.job_id for e in events.seen if e.kind == K.KIND_GRANTED]
    assert granted == ["b", "c"], granted
    events.cancel()

    # LOCKED: a still holds it; a second Acquire of its own is answered at once, same grant.
    again = await o.acquire("a", "locked")
    assert again.grant_epoch == locked_epoch
    st = await o.status("locked")
    assert (st.group_state, st.locking_job, st.loaded_job) == (GS.STATE_LOCKED, "a", "a")

    # IDLE_YIELDED: the yielded resident re-acquires for free (nothing was moved).
    yielded = await o.acquire("a", "yielded")
    assert not yielded.context_restored
    assert running(await job_states(node_1, "yielded")) == {"a"}

    # IDLE: the first grant of a group nobody used.
    idle = await o.acquire("x", "idle")
    assert idle.grant_epoch == 1 and not idle.context_restored

    # Agent down at start: the group is UNKNOWN and says which node and why ...
    st = await o.status("down")
    assert st.group_state == GS.STATE_UNKNOWN, st
    assert "node-down" in st.detail and "unreachable" in st.detail, st.detail
    # ... a waiter waits (it is not refused), and is granted once the agent is back.
    down = o.acquiring("b", "down")
    stack.agents["node-down"].restart()
    assert (await down).success
    assert (await o.status("down")).group_state == GS.STATE_LOCKED
    assert running(await job_states(stack.agents["node-down"].address, "down")) == {"b"}
