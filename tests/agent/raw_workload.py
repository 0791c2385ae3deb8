"""A ChannelHub on a real grpc.aio server, and a workload that speaks the workload
channel's wire protocol by hand (shared by the channel tests)."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from tslice.agent import channel
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

OFFLOAD = pb.SUSPEND_MODE_OFFLOAD
DISCARD = pb.SUSPEND_MODE_DISCARD
UNSPECIFIED = pb.SUSPEND_MODE_UNSPECIFIED
#: What tslice's workload library declares; ``None`` = llm-d's (the field is not set).
TSLICE = pb.WorkloadFeatures(keepalive=True, reports_state=True)


class HubServicer(pb_grpc.SnapshotAgentServiceServicer):
    def __init__(self, hub: channel.ChannelHub) -> None:
        self.hub = hub

    async def WorkloadChannel(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for command in self.hub.handle_stream(request_iterator, context):
            yield command


class HubServer:
    """A ChannelHub served by a real grpc.aio server at ``address``."""

    def __init__(self, hub: channel.ChannelHub, address: str, server: grpc.aio.Server) -> None:
        self.hub = hub
        self.address = address
        self.server = server


async def start_hub(hub: channel.ChannelHub, bind: str) -> HubServer:
    """``hub`` served on ``bind`` (``127.0.0.1:0`` or a ``unix:`` path)."""
    server = grpc.aio.server()
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(HubServicer(hub), server)
    port = server.add_insecure_port(bind)
    await server.start()
    address = f"127.0.0.1:{port}" if bind.startswith("127.") else bind
    return HubServer(hub, address, server)


class RawWorkload:
    """A workload speaking the wire protocol by hand."""

    def __init__(self, address: str, *, instance: str = "", token: str | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        metadata = [("tslice-workload-instance", instance)] if instance else []
        if token is not None:
            metadata.append(("authorization", f"Bearer {token}"))
        stub = pb_grpc.SnapshotAgentServiceStub(self.channel)
        self.call = stub.WorkloadChannel(metadata=metadata or None)

    async def register(
        self,
        job_id: str,
        *,
        group: str = "g",
        modes: Sequence[int] = (),
        default_mode: int = UNSPECIFIED,
        tags: Sequence[str] = (),
        resident_tags: Sequence[str] = (),
        suspended: bool = False,
        pid: int = 0,
        features: pb.WorkloadFeatures | None = TSLICE,
        ack: bool = True,
        rank: int = 0,
    ) -> None:
        """Register; with declared keepalive, wait for the acknowledging ping and answer it."""
        register = pb.RegisterWorkload(
            job_id=job_id,
            group=group,
            capabilities=pb.WorkloadCapabilities(
                supported_modes=modes, default_mode=default_mode, tags=tags
            ),
            resident_tags=resident_tags,
            suspended=suspended,
            pid=pid,
            rank=rank,
        )
        if features is not None:
            register.features.CopyFrom(features)
        await self.call.write(pb.WorkloadMessage(register=register))
        if ack and features is not None and features.keepalive:
            first = await self.call.read()
            assert first.WhichOneof("command") == "ping", first
            await self.call.write(pb.WorkloadMessage(pong=pb.Ping(nonce=first.ping.nonce)))

    async def next_command(self, *, answer_pings: bool = True) -> pb.AgentCommand:
        """The next snapshot/restore/pong, answering pings on the way."""
        while True:
            message = await self.call.read()
            assert message is not grpc.aio.EOF, "stream ended"
            if message.WhichOneof("command") == "ping":
                if answer_pings:
                    await self.call.write(pb.WorkloadMessage(pong=message.ping))
                continue
            return message

    async def answer(
        self, command: pb.AgentCommand, *, ok: bool = True, error: str = "", device_bytes: int = 0
    ) -> None:
        await self.call.write(
            pb.WorkloadMessage(
                result=pb.CommandResult(
                    command_id=command.command_id, ok=ok, error=error, device_bytes=device_bytes
                )
            )
        )

    async def sync(self) -> None:
        """Round trip a ping: the hub has processed everything written before it."""
        await self.call.write(pb.WorkloadMessage(ping=pb.Ping(nonce=4242)))
        reply = await self.next_command()
        assert reply.WhichOneof("command") == "pong" and reply.pong.nonce == 4242

    async def final_status(self) -> grpc.StatusCode:
        try:
            while await self.call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return await self.call.code()

    async def close(self) -> None:
        self.call.cancel()
        await self.channel.close()
