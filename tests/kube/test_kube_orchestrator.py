"""End to end: the emulated API server, a real ``tslice orchestrator --kubernetes`` and real
agents. A group appears when its node is labelled and a job acquires it; when every pod
of the holder is deleted, the holder loses the lock (with an event) and the next waiter
is granted; a node cordoned in the middle of a switch leaves the group, which carries on
over the node left, exclusive throughout (the device journals are checked). Waits are on
the servers' log lines, the orchestrator's event stream and the Acquire replies."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("lightkube")

from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.processes import LoggedServer
from tslice.agent.backends import simdevice as device
from tslice.client import AsyncClient, EventKind, GroupState, OrchestratorEvent
from tslice.common import errors
from tslice.sim import checker
from tslice.sim.cluster import SimAgent

GiB = 1024**3
WAIT_S = 30.0


class Cluster:
    """Agents (their pods registered once they serve) and the orchestrator in Kubernetes
    mode, all started at once."""

    def __init__(self, api: ApiServerEmulator, tmp_path: pathlib.Path, short: pathlib.Path):
        self.api, self.tmp_path, self.short = api, tmp_path, short
        self.servers: list[LoggedServer] = []
        self.orchestrator: LoggedServer | None = None

    def start(self, nodes: dict[str, list[str]], *, shutdown_grace_s: float = 1.0) -> str:
        """An agent per node (its flags), each with its pod (pod IP 127.0.0.1, port 'grpc'),
        and the orchestrator; its address once all serve."""
        agents = {}
        for node, flags in nodes.items():
            args = [
                "agent", "--node-name", node, "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--state-dir", str(self.short / node), *flags,
            ]  # fmt: skip
            agents[node] = LoggedServer(args, self.tmp_path / f"{node}.log")
            self.servers.append(agents[node])
        kubeconfig = self.api.write_kubeconfig(self.tmp_path / "kubeconfig")
        args = [
            "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig),
            "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--state-dir", str(self.tmp_path / "orchestrator"),
            "--shutdown-grace", str(shutdown_grace_s),
        ]  # fmt: skip
        self.orchestrator = LoggedServer(args, self.tmp_path / "orchestrator.log")
        self.servers.append(self.orchestrator)
        for node, agent in agents.items():
            port = int(agent.wait_for(r"serving on 127\.0\.0\.1:(\d+)").group(1))
            self.api.apply(objects.agent_pod(node, "127.0.0.1", port))
        return self.orchestrator.wait_for(r"serving on (127\.0\.0\.1:\d+)").group(1)

    def logged(self, pattern: str) -> None:
        assert self.orchestrator is not None
        self.orchestrator.wait_for(pattern)

    def journal(self) -> list[device.Event]:
        paths = sorted(self.short.glob("*/sim-journal.jsonl"))
        return sorted((e for p in paths for e in device.read_journal(p)), key=lambda e: e.t)

    def logs(self) -> str:
        return "\n".join(f"----- {s.log_path.name} -----\n{s.logs()}" for s in self.servers)


@pytest.fixture
def cluster(api: ApiServerEmulator, tmp_path: pathlib.Path) -> Iterator[Cluster]:
    # Unix socket paths (the agents' register sockets) must be short; tmp_path can be long.
    short = pathlib.Path(tempfile.mkdtemp(prefix="tslice-kube-"))
    running = Cluster(api, tmp_path, short)
    try:
        yield running
    except BaseException:
        print(running.logs())
        raise
    finally:
        for server in running.servers:  # all at once: each stops gracefully
            server.terminate()
        for server in reversed(running.servers):
            server.stop()
        shutil.rmtree(short, ignore_errors=True)


@contextlib.asynccontextmanager
async def _events(
    client: AsyncClient, group: str
) -> AsyncIterator[AsyncIterator[OrchestratorEvent]]:
    stream = client.watch_events(group)
    await stream.started()
    try:
        yield stream
    finally:
        await stream.aclose()


async def _next(
    events: AsyncIterator[OrchestratorEvent], kind: EventKind, job: str = ""
) -> OrchestratorEvent:
    """The next event of ``kind`` (of ``job`` if given)."""

    async def first() -> OrchestratorEvent:
        async for event in events:
            if event.kind is kind and (not job or event.job_id == job):
                return event
        raise AssertionError(f"the event stream ended before a {kind.value} event")

    return await asyncio.wait_for(first(), WAIT_S)


async def test_a_labelled_group_is_acquired_and_a_gone_holder_loses_it(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    api.apply(objects.node("gpu-a"))  # not in a group yet
    for job in ("job-a", "job-b", "job-c"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    address = cluster.start({"gpu-a": ["--backend", "noop"]})
    api.apply(objects.node("gpu-a", "trainer"))
    cluster.logged(r"group trainer appeared with 1 node\(s\): gpu-a")
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
        AsyncClient(address, job_id="job-c", lease_s=None) as c,
        _events(b, "trainer") as events,
    ):
        assert "trainer" in await a.list_groups()
        # A labelled node without an agent pod: its group waits for it instead of guessing.
        api.apply(objects.node("gpu-z", "sampler"))
        cluster.logged(r"group sampler appeared with 1 node\(s\): gpu-z")
        with pytest.raises(errors.Unavailable, match=r"gpu-z\.no-agent-pod\.invalid"):
            await a.acquire("sampler", timeout=1)
        assert (await a.status("sampler")).group_state is GroupState.UNKNOWN
        await a.acquire("trainer", timeout=WAIT_S)
        waiting = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
        await _next(events, EventKind.QUEUED, "job-b")
        queued_c = asyncio.create_task(c.acquire("trainer", timeout=WAIT_S))
        await _next(events, EventKind.QUEUED, "job-c")
        # A waiter whose pods went leaves the queue; its Acquire says why.
        api.apply(objects.job_pod("job-c-trainer-0", "job-c", "trainer", phase="Failed"))
        with pytest.raises(
            errors.Aborted, match="by Kubernetes mode: every pod of job job-c is gone"
        ):
            await asyncio.wait_for(queued_c, WAIT_S)
        # A holder whose pods went loses the lock; the next waiter is granted.
        api.store.delete("pods", "rl", "job-a-trainer-0")
        yielded = await _next(events, EventKind.YIELDED, "job-a")
        assert "by Kubernetes mode: every pod of job job-a is gone" in yielded.detail
        assert (await asyncio.wait_for(waiting, WAIT_S)).success
        # Unlabelled, the node leaves: the group is gone, and an Acquire says how to fix it.
        api.apply(objects.node("gpu-a"))
        cluster.logged(r"group trainer is gone \(.*\); it stops")
        with pytest.raises(errors.NotFound, match=r"label its nodes group\.timeslice\.io/trainer"):
            await c.acquire("trainer", timeout=WAIT_S)


async def test_a_node_cordoned_mid_switch_leaves_the_group_which_stays_exclusive(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    # Two 50 GiB states never fit on an 80 GiB device; a move takes half a second.
    sim = SimAgent(
        name="",
        capacity_bytes=80 * GiB,
        footprint_bytes=50 * GiB,
        bandwidth_bytes_per_s=100 * GiB,
        latency_s=0.01,
    )
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    # No grace: the switch in flight is cut when the group restarts, and recovery on the
    # node left finishes the hand-over (the harder of the two ways it can go).
    address = cluster.start({"gpu-a": sim.flags(), "gpu-b": sim.flags()}, shutdown_grace_s=0)
    for node in ("gpu-a", "gpu-b"):
        api.apply(objects.node(node, "trainer"))
    # The two labels may be seen apart (a group of one node, then of two) or together.
    both = r"gpu-a@\S+, gpu-b@\S+"
    appeared = r" appeared with 2 node\(s\): gpu-a, gpu-b"
    cluster.logged(rf"group trainer({appeared}|: nodes changed \(gpu-a@\S+ -> {both}\))")
    windows: list[checker.Window] = []
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
        _events(b, "trainer") as events,
    ):
        first = checker.Window(job="job-a", group="trainer", requested=time.time())
        windows.append(first)
        await a.acquire("trainer", timeout=WAIT_S)
        first.acquired = time.time()
        second = checker.Window(job="job-b", group="trainer", requested=time.time())
        windows.append(second)
        waiting = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
        await _next(events, EventKind.QUEUED, "job-b")
        first.yielded = time.time()
        await a.yield_("trainer")
        await _next(events, EventKind.SWITCH_STARTED, "job-b")
        api.apply(objects.node("gpu-b", "trainer", unschedulable=True))
        cluster.logged(rf"group trainer: nodes changed \({both} -> gpu-a@[^,]+\)")
        # The client re-issues its Acquire across the group's restart (UNAVAILABLE).
        assert (await asyncio.wait_for(waiting, WAIT_S)).success
        second.acquired = time.time()
        # Asked again, the restarted group answers once it has verified the grant itself.
        await b.acquire("trainer", timeout=WAIT_S)
        status = await b.status("trainer")
        assert (status.locking_job, status.nodes) == ("job-b", ("gpu-a",))
        second.yielded = time.time()
    assert (
        checker.check(
            journal=cluster.journal(), windows=windows, group_nodes={"trainer": ["gpu-a"]}
        )
        == []
    )
