"""How the workload-channel hub tells a workload that left from one that lost its channel.

A real grpc.aio server delegates WorkloadChannel to a ChannelHub; the workload is a raw
client, so the test decides exactly how the stream ends:

- a half-close (``done_writing``): the workload left at once (``closed`` event with
  ``left=True``, a clean :class:`~tslice.agent.channel.Departure`);
- a cancelled call, whatever came before: lost; the hub waits ``lost_grace_s`` for a new
  registration of the same (job, group), then sends ``left``; a registration within the
  grace clears it;
- a workload without keepalive that half-closes after commands were sent cannot be
  told from a lost one (nothing it declared can probe it): lost too;
- a superseded session (the same workload on a new stream) and an agent shutting down
  leave nothing behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.agent.raw_workload import HubServer, start_hub
from tslice.agent import channel
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

TSLICE = pb.WorkloadFeatures(keepalive=True, reports_state=True)
#: Far longer than any test: a departure seen within it came from a clean end.
LONG_GRACE_S = 120.0


class Hub(HubServer):
    """A hub on loopback that records its events."""

    def __init__(self, running: HubServer) -> None:
        super().__init__(running.hub, running.address, running.server)
        self.events: list[channel.ChannelEvent] = []
        self._changed = asyncio.Event()
        self.hub.add_listener(self._on_event)

    def _on_event(self, event: channel.ChannelEvent) -> None:
        self.events.append(event)
        self._changed.set()

    async def event(self, kind: str) -> channel.ChannelEvent:
        """The first event of ``kind`` (waiting for it)."""
        while True:
            found = [e for e in self.events if e.kind == kind]
            if found:
                return found[0]
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 20)


async def _start(grace_s: float) -> Hub:
    hub = channel.ChannelHub(ping_interval_s=5.0, lost_grace_s=grace_s)
    return Hub(await start_hub(hub, "127.0.0.1:0"))


@pytest.fixture
async def hubs() -> AsyncIterator[list[Hub]]:
    made: list[Hub] = []
    yield made
    for running in made:
        await running.hub.close()
        await running.server.stop(grace=None)


async def hub(hubs: list[Hub], grace_s: float = LONG_GRACE_S) -> Hub:
    running = await _start(grace_s)
    hubs.append(running)
    return running


class Raw:
    """A workload speaking the wire by hand."""

    def __init__(self, address: str, *, instance: str = "") -> None:
        self.channel = grpc.aio.insecure_channel(address)
        metadata = (("tslice-workload-instance", instance),) if instance else None
        stub = pb_grpc.SnapshotAgentServiceStub(self.channel)
        self.call = stub.WorkloadChannel(metadata=metadata)

    async def register(
        self, job_id: str = "job-a", *, features: pb.WorkloadFeatures | None = TSLICE
    ) -> None:
        register = pb.RegisterWorkload(job_id=job_id, group="g")
        if features is not None:
            register.features.CopyFrom(features)
        await self.call.write(pb.WorkloadMessage(register=register))

    async def final_code(self) -> grpc.StatusCode:
        """How the hub ended the call, once every command it sent was read."""
        while await self.call.read() is not grpc.aio.EOF:
            pass
        return await self.call.code()

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()


async def test_a_half_close_leaves_at_once(hubs: list[Hub]) -> None:
    running = await hub(hubs)
    raw = Raw(running.address)
    try:
        await raw.register()
        await running.hub.wait_registered("job-a", "g", timeout=20)
        await raw.call.done_writing()
        closed = await running.event("closed")
        assert closed.left and closed.reason == "the workload closed the channel"
        gone = running.hub.departure("job-a", "g")
        assert gone is not None and gone.clean
        assert running.hub.lost_grace_left("job-a", "g") is None
        # The hub ends the half-closed call cleanly.
        assert await raw.final_code() == grpc.StatusCode.OK
        assert [e.kind for e in running.events] == ["registered", "closed"]
    finally:
        await raw.close()


async def test_a_cancelled_call_is_lost_then_gone_after_the_grace(hubs: list[Hub]) -> None:
    running = await hub(hubs, grace_s=0.3)
    raw = Raw(running.address)
    try:
        await raw.register()
        await running.hub.wait_registered("job-a", "g", timeout=20)
        raw.call.cancel()
        closed = await running.event("closed")
        assert not closed.left
        left = await running.event("left")
        assert left.left and "did not register again within 0.3 s" in left.reason
        gone = running.hub.departure("job-a", "g")
        assert gone is not None and not gone.clean
    finally:
        await raw.close()


async def test_a_lost_workload_that_registers_again_within_the_grace_stays(
    hubs: list[Hub],
) -> None:
    running = await hub(hubs)
    first, second = Raw(running.address), Raw(running.address)
    try:
        await first.register()
        await running.hub.wait_registered("job-a", "g", timeout=20)
        first.call.cancel()
        await running.event("closed")
        left = running.hub.lost_grace_left("job-a", "g")
        assert left is not None and 0 < left <= LONG_GRACE_S
        assert running.hub.departure("job-a", "g") is None  # still within the grace

        await second.register()
        settled = await running.hub.wait_settled("job-a", "g", timeout=20)
        assert isinstance(settled, channel.WorkloadState)
        assert running.hub.lost_grace_left("job-a", "g") is None
        assert running.hub.departure("job-a", "g") is None
        assert "left" not in [e.kind for e in running.events]
    finally:
        await first.close()
        await second.close()


async def test_a_snapshot_cut_by_a_half_close_finds_the_workload_gone(hubs: list[Hub]) -> None:
    running = await hub(hubs)
    raw = Raw(running.address)
    try:
        await raw.register()
        await running.hub.wait_registered("job-a", "g", timeout=20)
        sent = asyncio.create_task(running.hub.snapshot("job-a", "g", timeout_s=30))
        while True:  # the registration's ping, then the command
            command = await raw.call.read()
            if command.WhichOneof("command") == "snapshot":
                break
        await raw.call.done_writing()  # leaves without answering
        with pytest.raises(channel.WorkloadDisconnectedError):
            await sent
        # Recorded before the waiting command heard of the disconnect.
        gone = running.hub.departure("job-a", "g")
        assert gone is not None and gone.clean
    finally:
        await raw.close()


async def test_a_half_close_without_keepalive_after_commands_counts_as_lost(
    hubs: list[Hub],
) -> None:
    running = await hub(hubs)
    raw = Raw(running.address)
    try:
        await raw.register(features=None)  # llm-d's library declares nothing
        await running.hub.wait_registered("job-a", "g", timeout=20)
        sent = asyncio.create_task(running.hub.snapshot("job-a", "g", timeout_s=30))
        command = await raw.call.read()
        await raw.call.write(
            pb.WorkloadMessage(result=pb.CommandResult(command_id=command.command_id, ok=True))
        )
        await sent
        await raw.call.done_writing()
        closed = await running.event("closed")
        assert not closed.left  # nothing it declared can tell a half-close from a loss
        assert running.hub.lost_grace_left("job-a", "g") is not None
    finally:
        await raw.close()


async def test_a_half_close_without_keepalive_before_any_command_leaves(
    hubs: list[Hub],
) -> None:
    running = await hub(hubs)
    raw = Raw(running.address)
    try:
        await raw.register(features=None)
        await running.hub.wait_registered("job-a", "g", timeout=20)
        await raw.call.done_writing()  # probed with the call's initial metadata
        closed = await running.event("closed")
        assert closed.left
        assert running.hub.departure("job-a", "g") is not None
    finally:
        await raw.close()


async def test_a_superseded_session_and_a_shutdown_leave_nothing(hubs: list[Hub]) -> None:
    running = await hub(hubs, grace_s=0.0)  # a loss would count as gone at once
    first, second = Raw(running.address, instance="w-1"), Raw(running.address, instance="w-1")
    try:
        await first.register()
        await running.hub.wait_registered("job-a", "g", timeout=20)
        await second.register()
        with pytest.raises(grpc.aio.AioRpcError) as replaced:
            await first.final_code()
        assert replaced.value.code() == grpc.StatusCode.ABORTED
        assert running.hub.departure("job-a", "g") is None
        await running.hub.close()  # the agent shuts down: its workloads did not leave
        with pytest.raises(grpc.aio.AioRpcError) as shut:
            await second.final_code()
        assert shut.value.code() == grpc.StatusCode.UNAVAILABLE
        assert running.hub.departure("job-a", "g") is None
        assert "left" not in [e.kind for e in running.events]
        assert not any(e.left for e in running.events)
    finally:
        await first.close()
        await second.close()


def test_the_grace_must_be_a_number_of_seconds() -> None:
    with pytest.raises(ValueError, match="lost_grace_s must be a number of seconds >= 0"):
        channel.ChannelHub(lost_grace_s=-1)
    with pytest.raises(ValueError, match="lost_grace_s"):
        channel.check_grace(True)
