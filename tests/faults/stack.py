"""What the fault tests share: raw stubs of the orchestrator and agents, the event stream.

Every server is a real ``python -m tslice orchestrator|agent`` process (``processes.py``), so
a fault is a real one: SIGKILL, SIGSTOP, a cut network link. The tests synchronise on the
orchestrator's events (``WatchEvents``, subscribed before acting) and on the servers'
readiness, never on sleeps. Calls are raw gRPC stubs so that what a user would see (status
code and message) is what the test asserts; clients of the library would retry it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tests.faults.processes import Process
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc

K = opb.OrchestratorEvent
GS = opb.GroupStatus
#: Longest any single wait of these tests may take before it fails (not a timed assertion:
#: the bound only turns a hang into a failure with the servers' logs).
WAIT_S = 30.0


class Orchestrator:
    """A channel and stub to the orchestrator; :meth:`reconnect` after a restart."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(address)
        self.stub: Any = opb_grpc.TimeSliceOrchestratorServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def acquire(
        self, job: str, group: str, *, timeout: float = WAIT_S
    ) -> opb.AcquireResponse:
        request = opb.AcquireRequest(job_id=job, group_id=group)
        reply: opb.AcquireResponse = await self.stub.Acquire(
            request, timeout=timeout, wait_for_ready=True
        )
        assert reply.success, reply
        return reply

    def acquiring(self, job: str, group: str, *, timeout: float = WAIT_S) -> asyncio.Task[Any]:
        return asyncio.ensure_future(self.acquire(job, group, timeout=timeout))

    async def yield_(self, job: str, group: str) -> None:
        request = opb.YieldRequest(job_id=job, group_id=group)
        reply = await self.stub.Yield(request, timeout=WAIT_S, wait_for_ready=True)
        assert reply.success, reply

    async def status(self, group: str) -> opb.GroupStatus:
        request = opb.GetGroupStatusRequest(group_id=group)
        reply = await self.stub.GetGroupStatus(request, timeout=WAIT_S, wait_for_ready=True)
        status: opb.GroupStatus = reply.group
        return status

    async def events(self, group: str) -> Events:
        return await Events.open(self.stub, group)


class Events:
    """One group's WatchEvents stream; ``wait_for`` reads the stream, never the clock."""

    def __init__(self, stub: Any, group: str) -> None:
        self.call = stub.WatchEvents(opb.WatchEventsRequest(group_id=group), wait_for_ready=True)
        self.seen: list[opb.OrchestratorEvent] = []

    @classmethod
    async def open(cls, stub: Any, group: str) -> Events:
        events = cls(stub, group)
        await events.call.initial_metadata()  # subscribed from here on
        return events

    async def wait_for(self, kind: int, *, job: str = "", node: str = "") -> opb.OrchestratorEvent:
        for event in self.seen:
            if _match(event, kind, job, node):
                return event

        async def read() -> opb.OrchestratorEvent:
            event: opb.OrchestratorEvent
            async for event in self.call:
                self.seen.append(event)
                if _match(event, kind, job, node):
                    return event
            raise AssertionError(f"event stream ended before {K.Kind.Name(kind)}")

        return await asyncio.wait_for(read(), WAIT_S)

    def cancel(self) -> None:
        self.call.cancel()


def _match(event: opb.OrchestratorEvent, kind: int, job: str, node: str) -> bool:
    return (
        event.kind == kind and (not job or event.job_id == job) and (not node or event.node == node)
    )


async def switch_under_way(
    o: Orchestrator, group: str, *, timeout: float = WAIT_S, frozen: Process | None = None
) -> tuple[Events, asyncio.Task[Any]]:
    """a holds ``group``, b waits (its Acquire is the task), a yields: returns once b's
    switch has started (every node's first call is under way).

    ``frozen``: an agent SIGSTOPped before a yields, left stopped for the caller to
    SIGCONT: it answers nothing meanwhile, so the switch is still in flight when this
    returns and until the caller acts, however long the steps in between take."""
    await o.acquire("a", group)
    events = await o.events(group)
    waiter = o.acquiring("b", group, timeout=timeout)
    await events.wait_for(K.KIND_QUEUED, job="b")
    if frozen is not None:
        frozen.signal(signal.SIGSTOP)
    await o.yield_("a", group)
    await events.wait_for(K.KIND_SWITCH_STARTED, job="b")
    return events, waiter


@contextlib.asynccontextmanager
async def agent_stub(address: str) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(address) as channel:
        yield pb_grpc.SnapshotAgentServiceStub(channel)


async def job_states(address: str, group: str) -> dict[str, pb.JobStatus]:
    """The agent's jobs of ``group``, read from the agent itself."""
    async with agent_stub(address) as stub:
        reply = await stub.Status(pb.StatusRequest(), timeout=WAIT_S, wait_for_ready=True)
    return {j.job_id: j for j in reply.job_statuses if j.group == group}


def running(states: dict[str, pb.JobStatus]) -> set[str]:
    return {job for job, s in states.items() if s.state == pb.JOB_STATE_RUNNING}
