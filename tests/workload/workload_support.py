"""Test support for the workload side: a minimal agent (ChannelHub behind grpc.aio) and
stand-in engines that record what the adapters call on them.

(A plain module rather than conftest.py so that tests can import it by a unique name.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc

from tslice.agent import channel
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc


class FakeVllm:
    """Looks like ``vllm.LLM`` built with ``enable_sleep_mode=True``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        # Like vLLM's executor: the tags still asleep; awake again once none are left.
        self.sleeping_tags: set[str] = set()

    @property
    def sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @sleeping.setter
    def sleeping(self, value: bool) -> None:
        self.sleeping_tags = {"weights", "kv_cache"} if value else set()

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.sleeping_tags -= set(tags if tags is not None else ["weights", "kv_cache"])

    def is_sleeping(self) -> bool:
        return self.sleeping


class FakeAsyncVllm:
    """Looks like ``vllm.AsyncLLM``: every method is a coroutine."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.loops: list[asyncio.AbstractEventLoop] = []

    async def sleep(self, level: int = 1) -> None:
        self.loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        self.calls.append(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.loops.append(asyncio.get_running_loop())
        await asyncio.sleep(0)
        self.calls.append(("wake_up", tags))

    async def is_sleeping(self) -> bool:
        return False


class FakeSglang:
    """Looks like ``sglang.Engine`` built with ``enable_memory_saver=True``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("resume", tags))


class HubServicer(pb_grpc.SnapshotAgentServiceServicer):
    """The smallest agent: WorkloadChannel delegated to a ChannelHub."""

    def __init__(self, hub: channel.ChannelHub) -> None:
        self.hub = hub

    async def WorkloadChannel(self, request_iterator, context):  # type: ignore[no-untyped-def]
        async for command in self.hub.handle_stream(request_iterator, context):
            yield command


class HubServer:
    def __init__(
        self,
        hub: channel.ChannelHub,
        server: grpc.aio.Server,
        address: str,
        announcements: registration.RegistrationServer | None = None,
    ) -> None:
        self.hub = hub
        self.server = server
        self.address = address
        self.announcements = announcements

    @classmethod
    async def start(cls, bind: str, **hub_options: float) -> HubServer:
        """On a Unix socket, as the agent does: with its register socket next to it
        (``register.sock``), where workloads bind their channel to their process."""
        announcements = None
        if bind.startswith("unix:"):
            processes = registration.ProcessRegistry()
            announcements = registration.RegistrationServer(
                path=Path(bind[len("unix:") :]).with_name("register.sock"), registry=processes
            )
            await announcements.start()
            hub = channel.ChannelHub(processes=processes, **hub_options)  # type: ignore[arg-type]
        else:
            hub = channel.ChannelHub(**hub_options)  # type: ignore[arg-type]
        server = grpc.aio.server()
        pb_grpc.add_SnapshotAgentServiceServicer_to_server(HubServicer(hub), server)
        port = server.add_insecure_port(bind)
        await server.start()
        address = bind if bind.startswith("unix:") else f"127.0.0.1:{port}"
        return cls(hub, server, address, announcements)

    async def stop(self) -> None:
        await self.hub.close()
        await self.server.stop(grace=None)
        if self.announcements is not None:
            await self.announcements.close()
