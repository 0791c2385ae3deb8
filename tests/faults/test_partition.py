"""The orchestrator and one agent partitioned in the middle of a switch.

node-1 runs in a network namespace of its own, joined to the host by a veth pair
(``processes.Netns``); the test takes the agent's end of the link down while node-1
is snapshotting for group ``partition``: the orchestrator's calls get no answer at all
(packets are dropped, no reset), as across a real partition, while the agent goes on
with its work. Where namespaces cannot be made (not root, no iproute2) the agent is
frozen with SIGSTOP instead: its kernel still holds the connections, the agent answers
nothing; that is the closest fault without a namespace, and it is said in the test id.
node-1 is frozen (SIGSTOP) from before the switch starts: with a namespace it is let go
on once its link is cut, without one the freeze is the partition. Either way its 1-s
snapshot, and the switch with it, cannot finish before the partition, however slow the
machine is.
"""

from __future__ import annotations

import signal

import pytest

from tests.faults.conftest import NO_NETNS
from tests.faults.processes import Stack
from tests.faults.stack import GS, K, Orchestrator, job_states, running, switch_under_way
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

CUT = "sigstop" if NO_NETNS else "netns-link-down"


@pytest.mark.parametrize("cut", [CUT])
async def test_a_partition_mid_switch_is_retried_and_the_switch_finishes_once_healed(
    stack: Stack, cut: str
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    agent = stack.agents["node-1"]
    netns = stack.netns.get("node-1")
    try:
        events, waiter = await switch_under_way(o, "partition", frozen=agent)
        if netns is not None:
            netns.cut()
            agent.signal(signal.SIGCONT)  # the agent goes on with its work, unheard
        try:
            # No answer within an agent call's deadline: the step failed, to be retried.
            failed = await events.wait_for(K.KIND_SWITCH_FAILED, node="node-1")
            st = await o.status("partition")
        finally:
            if netns is not None:
                netns.heal()
            else:
                agent.signal(signal.SIGCONT)
        assert "no reply within" in failed.detail, failed
        assert st.group_state in (GS.STATE_SWITCHING, GS.STATE_UNKNOWN), st
        assert "node-1" in st.detail, st.detail
        assert not waiter.done()  # the waiter waits through it: a partition is not a refusal
        assert (await waiter).grant_epoch == 2
        states = await job_states(agent.address, "partition")
        assert running(states) == {"b"} and states["a"].state == pb.JOB_STATE_SAVED
        assert (await o.status("partition")).detail == ""
        events.cancel()
    finally:
        await o.close()
