"""A real ``tslice agent`` process on a sim backend, for the tests that SIGKILL an agent
and restart it on its state directory (tests.harness.servers starts it)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc

from tests.harness.servers import Server
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc


class AgentProcess:
    """One start of an agent on ``state_dir`` (its log and ready file beside it)."""

    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.state_dir = state_dir
        self.server = Server(
            "agent",
            [
                "--node-name=node-p",
                "--port=0",
                f"--state-dir={state_dir}",
                "--backend=sim",
                "--sim-capacity=10GiB",
                "--sim-bandwidth=2TB/s",
                "--sim-latency=0.001",
                "--log-level=warning",
                *extra,
            ],
            state_dir.parent / "agent.log",
            start=False,
        )
        self.channel: grpc.aio.Channel | None = None

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> pb_grpc.SnapshotAgentServiceStub:
        self.server.start()
        address = await asyncio.to_thread(self.server.wait_ready)
        self.channel = grpc.aio.insecure_channel(address)
        return pb_grpc.SnapshotAgentServiceStub(self.channel)

    async def _close_channel(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    async def kill(self) -> None:
        await self._close_channel()
        await asyncio.to_thread(self.server.kill)
        assert self.server.proc.returncode == -signal.SIGKILL

    async def terminate(self) -> int:
        await self._close_channel()
        return await asyncio.to_thread(self.server.terminate)
