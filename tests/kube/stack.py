"""Kubernetes mode's processes for the tests: agents (their pods registered once they
serve) and ``tslice orchestrator --kubernetes`` against the API-server emulator, plus the
event-stream helpers. Servers are ready once they wrote their ready file
(tests.harness.servers); later waits are on their log lines and on replies, never sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

from tests.harness.servers import Server
from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tslice.agent.backends import simdevice as device
from tslice.client import AsyncClient, EventKind, OrchestratorEvent
from tslice.sim.cluster import SimAgent

WAIT_S = 30.0
GiB = 1024**3


def exclusive_sim() -> SimAgent:
    """Simulated devices where two jobs' states never fit at once (50 GiB each on 80 GiB)
    and a move takes half a second: a switch is long enough to be interrupted."""
    return SimAgent(
        name="",
        capacity_bytes=80 * GiB,
        footprint_bytes=50 * GiB,
        bandwidth_bytes_per_s=100 * GiB,
        latency_s=0.01,
    )


_C = TypeVar("_C", bound="Cluster")


class Cluster:
    """Agents and the orchestrator in Kubernetes mode, all started at once."""

    def __init__(self, api: ApiServerEmulator, tmp_path: pathlib.Path, short: pathlib.Path):
        self.api, self.tmp_path, self.short = api, tmp_path, short
        self.servers: list[Server] = []
        self.agents: dict[str, Server] = {}
        self.orchestrator: Server | None = None

    def launch(self, name: str, args: list[str]) -> Server:
        server = Server(args[0], args[1:], self.tmp_path / f"{name}.log")
        self.servers.append(server)
        return server

    def launch_agents(self, nodes: dict[str, list[str]]) -> dict[str, Server]:
        """An agent per node (its flags), not waited for (see :meth:`register`)."""
        started = {}
        for node, flags in nodes.items():
            args = [
                "agent", "--node-name", node, "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--state-dir", str(self.short / node), *flags,
            ]  # fmt: skip
            started[node] = self.launch(node, args)
        self.agents.update(started)
        return started

    def register(self, agents: dict[str, Server]) -> None:
        """Each agent's pod (pod IP 127.0.0.1, port 'grpc'), once it serves."""
        for node, agent in agents.items():
            agent.wait_ready()
            self.api.apply(objects.agent_pod(node, "127.0.0.1", agent.port))

    def start(self, nodes: dict[str, list[str]], *, shutdown_grace_s: float = 1.0) -> str:
        """The agents and the orchestrator; its address once all serve."""
        agents = self.launch_agents(nodes)
        kubeconfig = self.api.write_kubeconfig(self.tmp_path / "kubeconfig")
        self._orchestrator_args = [
            "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig),
            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--state-dir", str(self.tmp_path / "orchestrator"),
            "--shutdown-grace", str(shutdown_grace_s),
        ]  # fmt: skip
        self.orchestrator = self.launch("orchestrator", self._orchestrator_args)
        self.register(agents)
        return self.orchestrator.wait_ready()

    def restart_orchestrator(self) -> str:
        """SIGKILL the orchestrator and start it again on its state; its new address."""
        assert self.orchestrator is not None
        self.orchestrator.kill()
        name = f"orchestrator-{len(self.servers)}"
        self.orchestrator = self.launch(name, self._orchestrator_args)
        return self.orchestrator.wait_ready()

    def logged(self, pattern: str) -> None:
        assert self.orchestrator is not None
        self.orchestrator.wait_for(pattern)

    def journal(self) -> list[device.Event]:
        paths = sorted(self.short.glob("*/sim-journal.jsonl"))
        return sorted((e for p in paths for e in device.read_journal(p)), key=lambda e: e.t)

    def logs(self) -> str:
        return "\n".join(f"----- {s.log_path.name} -----\n{s.logs()}" for s in self.servers)

    def stop_all(self) -> None:
        for server in self.servers:  # all at once: each stops gracefully
            server.terminate()
        for server in reversed(self.servers):
            server.stop()


@contextlib.contextmanager
def running(
    make: Callable[[ApiServerEmulator, pathlib.Path, pathlib.Path], _C],
    api: ApiServerEmulator,
    tmp_path: pathlib.Path,
) -> Iterator[_C]:
    """A cluster for one test: its logs printed if the test fails, its servers stopped."""
    # Unix socket paths (the agents' register sockets) must be short; tmp_path can be long.
    short = pathlib.Path(tempfile.mkdtemp(prefix="tslice-kube-"))
    cluster = make(api, tmp_path, short)
    try:
        yield cluster
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        cluster.stop_all()
        shutil.rmtree(short, ignore_errors=True)


@contextlib.asynccontextmanager
async def events_of(
    client: AsyncClient, group: str | None
) -> AsyncIterator[AsyncIterator[OrchestratorEvent]]:
    """The events of ``group`` (None: of every group, one that does not exist yet too)."""
    stream = client.watch_events(group)
    await stream.started()
    try:
        yield stream
    finally:
        await stream.aclose()


async def next_event(
    events: AsyncIterator[OrchestratorEvent], kind: EventKind, job: str = ""
) -> OrchestratorEvent:
    """The next event of ``kind`` (of ``job`` if given)."""

    async def first() -> OrchestratorEvent:
        async for event in events:
            if event.kind is kind and (not job or event.job_id == job):
                return event
        raise AssertionError(f"the event stream ended before a {kind.value} event")

    return await asyncio.wait_for(first(), WAIT_S)
