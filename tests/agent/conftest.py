"""Fixtures: real in-process agents on 127.0.0.1:0 with fast simulated devices."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2_grpc

from tests.agent.cuda_doubles import FakeTool, Node
from tests.agent.processes import AgentProcess
from tslice.agent import app, config
from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

GiB = 1024**3
#: 10 GiB devices (default footprint 6 GiB), copies of a few milliseconds.
FAST_SIM: dict[str, Any] = {"capacity": "10GiB", "bandwidth": "2TB/s", "latency_s": 0.001}
DEFAULT_FOOTPRINT = int(10 * GiB * 0.4)


def _merge(base_: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base_)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


@dataclasses.dataclass
class Agent:
    """A running agent and stubs connected to it."""

    address: str
    config: config.AgentConfig
    channel: grpc.aio.Channel
    stub: pb_grpc.SnapshotAgentServiceStub
    health: health_pb2_grpc.HealthStub
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def wait(self, op_id: str, *, timeout_ms: int = 10_000) -> pb.GetOperationResponse:
        return await self.stub.WaitOperation(
            pb.WaitOperationRequest(operation_id=op_id, timeout_ms=timeout_ms)
        )

    async def jobs(self) -> dict[str, pb.JobStatus]:
        status = await self.stub.Status(pb.StatusRequest())
        return {j.job_id: j for j in status.job_statuses}

    async def state(self, job_id: str) -> int:
        return (await self.jobs())[job_id].state

    async def grant(self, job_id: str, *, group: str = "g", epoch: int = 0, **kw: Any) -> int:
        reply = await self.stub.Grant(
            pb.GrantRequest(job_id=job_id, group=group, grant_epoch=epoch, **kw)
        )
        return reply.state

    async def snapshot(
        self, job_id: str, *, group: str = "g", **kw: Any
    ) -> pb.GetOperationResponse:
        op = await self.stub.Snapshot(pb.SnapshotRequest(job_id=job_id, group=group, **kw))
        return await self.wait(op.operation_id)

    async def restore(self, job_id: str, *, group: str = "g", **kw: Any) -> pb.GetOperationResponse:
        op = await self.stub.Restore(pb.RestoreRequest(job_id=job_id, group=group, **kw))
        return await self.wait(op.operation_id)


class AgentRunner:
    """Starts agents in this event loop; stops them all at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.running: list[Agent] = []

    def make_config(self, **overrides: Any) -> config.AgentConfig:
        values = _merge(
            {
                "node_name": "node-a",
                "host": "127.0.0.1",
                "port": 0,
                "state_dir": str(self.tmp_path / "agent"),
                "default_backend": "sim",
                "sim": FAST_SIM,
                "grace_period_s": 2.0,
            },
            overrides,
        )
        return config.load(overrides=values)

    async def start(
        self,
        *,
        instances: Mapping[str, base.Backend] | None = None,
        **overrides: Any,
    ) -> Agent:
        """Start an agent; ``instances`` inject ready-made backends by name."""
        cfg = self.make_config(**overrides)
        return await self.start_config(cfg, instances=instances)

    async def start_config(
        self, cfg: config.AgentConfig, *, instances: Mapping[str, base.Backend] | None = None
    ) -> Agent:
        stop = asyncio.Event()
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(
            app.serve(cfg, ready=ready.set_result, stop=stop, backends=instances)
        )
        done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # raises the startup error
            raise AssertionError("agent stopped before it was ready")
        address = ready.result()
        channel = grpc.aio.insecure_channel(address)
        agent = Agent(
            address=address,
            config=cfg,
            channel=channel,
            stub=pb_grpc.SnapshotAgentServiceStub(channel),
            health=health_pb2_grpc.HealthStub(channel),
            stop=stop,
            task=task,
        )
        self.running.append(agent)
        return agent

    async def stop(self, agent: Agent) -> None:
        if agent in self.running:
            self.running.remove(agent)
        await agent.channel.close()
        agent.stop.set()
        await agent.task

    async def restart(self, agent: Agent, **kw: Any) -> Agent:
        await self.stop(agent)
        return await self.start_config(agent.config, **kw)

    async def stop_all(self) -> None:
        for agent in list(self.running):
            await self.stop(agent)


@pytest.fixture
async def agents(tmp_path: Path) -> AsyncIterator[AgentRunner]:
    runner = AgentRunner(tmp_path)
    try:
        yield runner
    finally:
        await runner.stop_all()
    # A stopped agent leaves no task behind (operations, health, pruning, streams).
    leftovers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert not leftovers, f"tasks left running after the agents stopped: {leftovers}"


@pytest.fixture
async def agent(agents: AgentRunner) -> Agent:
    return await agents.start()


# ---- the cuda backend's node: real (sleeping) processes, the FakeDriver, FakeNvml


@pytest.fixture
def sleeping() -> Iterator[Callable[[int], list[int]]]:
    """Start ``n`` real processes (the cuda backend checks /proc); killed at the end."""
    children: list[subprocess.Popen[bytes]] = []

    def start(n: int) -> list[int]:
        started = [subprocess.Popen(["sleep", "300"]) for _ in range(n)]
        children.extend(started)
        return [child.pid for child in started]

    yield start
    for child in children:
        child.kill()
        child.wait()


@pytest.fixture
def pids(sleeping: Callable[[int], list[int]]) -> list[int]:
    return sleeping(3)


@pytest.fixture
def node(pids: list[int]) -> Node:
    return Node(pids)


@pytest.fixture
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTool:
    """A cuda-checkpoint look-alike on PATH's stead, its states in a JSON file."""
    fake = FakeTool(tmp_path)
    monkeypatch.setenv("FAKE_CC_STATE", str(fake.state_file))
    return fake


@pytest.fixture
async def processes() -> AsyncIterator[list[AgentProcess]]:
    """The agent processes a test starts, killed at its end if still running."""
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        await asyncio.to_thread(agent.server.kill)
