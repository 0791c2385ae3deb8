"""Harness: real in-process agents (sim/noop backends) and a real orchestrator on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import pathlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx

from tslice.agent import app as agent_app
from tslice.agent import config as agent_config
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.orchestrator import app as orch_app
from tslice.orchestrator import config as orch_config

GiB = 1024**3
#: 10 GiB devices, copies of a few milliseconds.
FAST_SIM: dict[str, Any] = {"capacity": "10GiB", "bandwidth": "2TB/s", "latency_s": 0.001}


async def _start(coro_factory: Any) -> tuple[str, asyncio.Event, asyncio.Task[None]]:
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(coro_factory(ready.set_result, stop))
    done, _ = await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
        raise AssertionError("server stopped before it was ready")
    return ready.result(), stop, task


@dataclasses.dataclass
class Agent:
    name: str
    address: str
    config: agent_config.AgentConfig
    stop: asyncio.Event
    task: asyncio.Task[None]
    channel: grpc.aio.Channel
    stub: Any

    async def jobs(self) -> dict[str, pb.JobStatus]:
        status = await self.stub.Status(pb.StatusRequest())
        return {j.job_id: j for j in status.job_statuses}

    async def state(self, job: str) -> int:
        js = (await self.jobs()).get(job)
        return js.state if js is not None else pb.JOB_STATE_UNSPECIFIED


class Cluster:
    """Agents and one orchestrator in this event loop; everything stopped at teardown."""

    def __init__(self, tmp_path: pathlib.Path) -> None:
        self.tmp_path = tmp_path
        self.agents: dict[str, Agent] = {}
        self.orch_address = ""
        self.orch_config: orch_config.OrchestratorConfig | None = None
        self._orch_stop: asyncio.Event | None = None
        self._orch_task: asyncio.Task[None] | None = None
        self.channels: list[grpc.aio.Channel] = []

    # ---- agents ---------------------------------------------------------------------------

    async def start_agent(self, name: str, *, port: int = 0, **overrides: Any) -> Agent:
        values: dict[str, Any] = {
            "node_name": name,
            "host": "127.0.0.1",
            "port": port,
            "state_dir": str(self.tmp_path / f"agent-{name}"),
            "default_backend": "sim",
            "sim": dict(FAST_SIM),
            "grace_period_s": 1.0,
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key] = {**values[key], **value}
            else:
                values[key] = value
        cfg = agent_config.load(overrides=values)
        return await self._run_agent(name, cfg)

    async def _run_agent(self, name: str, cfg: agent_config.AgentConfig) -> Agent:
        address, stop, task = await _start(
            lambda ready, stop: agent_app.serve(cfg, ready=ready, stop=stop)
        )
        channel = grpc.aio.insecure_channel(address)
        agent = Agent(
            name, address, cfg, stop, task, channel, pb_grpc.SnapshotAgentServiceStub(channel)
        )
        self.agents[name] = agent
        return agent

    async def stop_agent(self, name: str) -> None:
        agent = self.agents.pop(name)
        await agent.channel.close()
        agent.stop.set()
        await agent.task

    async def restart_agent(self, name: str) -> Agent:
        agent = self.agents[name]
        port = int(agent.address.rsplit(":", 1)[1])
        cfg = dataclasses.replace(agent.config, port=port)
        await self.stop_agent(name)
        return await self._run_agent(name, cfg)

    # ---- orchestrator ---------------------------------------------------------------------

    def config(self, **overrides: Any) -> orch_config.OrchestratorConfig:
        values: dict[str, Any] = {
            "host": "127.0.0.1",
            "port": 0,
            "state_dir": str(self.tmp_path / "orch"),
            "metrics_port": 0,
            "shutdown_grace_s": 2.0,
            "reattach_grace_s": 30.0,
        }
        if "groups" in overrides:
            groups = overrides.pop("groups")
            values["topology"] = {
                "groups": {
                    g: {"nodes": [{"name": n, "agent": self.agents[n].address} for n in nodes]}
                    for g, nodes in groups.items()
                }
            }
        elif "topology" not in overrides:
            values["local_agents"] = [f"{a.name}={a.address}" for a in self.agents.values()]
        values.update(overrides)
        return orch_config.build(overrides=values)

    async def start_orchestrator(
        self, cfg: orch_config.OrchestratorConfig | None = None, **overrides: Any
    ) -> str:
        cfg = cfg or self.config(**overrides)
        self.orch_config = cfg
        self.orch_address, self._orch_stop, self._orch_task = await _start(
            lambda ready, stop: orch_app.serve(cfg, ready=ready, stop=stop)
        )
        return self.orch_address

    async def stop_orchestrator(self) -> None:
        if self._orch_stop is not None and self._orch_task is not None:
            self._orch_stop.set()
            await self._orch_task
            self._orch_stop = self._orch_task = None

    async def restart_orchestrator(self) -> str:
        await self.stop_orchestrator()
        return await self.start_orchestrator(self.orch_config)

    def stub(self) -> Any:
        channel = grpc.aio.insecure_channel(self.orch_address)
        self.channels.append(channel)
        return opb_grpc.TimeSliceOrchestratorServiceStub(channel)

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
        await self.stop_orchestrator()
        for name in list(self.agents):
            await self.stop_agent(name)


@contextlib.asynccontextmanager
async def one_node(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    """An orchestrator in local mode over one agent, ``node-a``; everything stops at exit."""
    cluster = Cluster(tmp_path)
    try:
        await cluster.start_agent("node-a")
        await cluster.start_orchestrator()
        yield cluster
    finally:
        await cluster.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def agent_calls(port: int) -> dict[tuple[str, str], float]:
    """(node, operation) -> number of timed agent calls, from the metrics endpoint."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    counts: dict[tuple[str, str], float] = {}
    prefix = "timeslice_orchestrator_agent_operation_duration_seconds_count{"
    for line in text.splitlines():
        if line.startswith(prefix):
            labels, value = line[len(prefix) :].split("} ")
            fields = dict(part.split("=") for part in labels.split(","))
            counts[(fields["node"].strip('"'), fields["operation"].strip('"'))] = float(value)
    return counts


def acquire(stub: Any, job: str, group: str, **kw: Any) -> Any:
    return stub.Acquire(opb.AcquireRequest(job_id=job, group_id=group, **kw))


def yield_(stub: Any, job: str, group: str) -> Any:
    return stub.Yield(opb.YieldRequest(job_id=job, group_id=group))


class Events:
    """Collects WatchEvents into a list; ``wait_for`` waits on the stream, not on time."""

    def __init__(self, stub: Any, group: str = "") -> None:
        self.call = stub.WatchEvents(opb.WatchEventsRequest(group_id=group))
        self.seen: list[opb.OrchestratorEvent] = []

    @classmethod
    async def open(cls, stub: Any, group: str = "") -> Events:
        events = cls(stub, group)
        await events.call.initial_metadata()  # the server is subscribed from here on
        return events

    async def wait_for(
        self, kind: int, *, job: str = "", node: str = "", timeout: float = 10.0
    ) -> opb.OrchestratorEvent:
        for ev in self.seen:
            if _match(ev, kind, job, node):
                return ev

        async def read() -> opb.OrchestratorEvent:
            async for ev in self.call:
                self.seen.append(ev)
                if _match(ev, kind, job, node):
                    return ev
            raise AssertionError("event stream ended")

        return await asyncio.wait_for(read(), timeout)

    def kinds(self, *, job: str = "") -> list[str]:
        return [
            opb.OrchestratorEvent.Kind.Name(e.kind).removeprefix("KIND_")
            for e in self.seen
            if not job or e.job_id == job
        ]

    def cancel(self) -> None:
        self.call.cancel()


def _match(ev: opb.OrchestratorEvent, kind: int, job: str, node: str) -> bool:
    return ev.kind == kind and (not job or ev.job_id == job) and (not node or ev.node == node)
