"""End to end: the emulated API server, a real ``tslice orchestrator --kubernetes`` and a
real agent. A group appears when its node is labelled and a job acquires it; when every
pod of the holder is deleted, the holder loses the lock (with an event) and the next
waiter is granted. Waits are on the servers' log lines, the orchestrator's event stream
and the Acquire replies."""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

pytest.importorskip("lightkube")

from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.processes import LoggedServer
from tslice.client import AsyncClient, EventKind, OrchestratorEvent

NODE = "gpu-a"


@pytest.fixture
def short_dir() -> Iterator[pathlib.Path]:
    """Unix socket paths must be short; pytest's tmp_path can be too long."""
    path = pathlib.Path(tempfile.mkdtemp(prefix="tslice-kube-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(short_dir: pathlib.Path, tmp_path: pathlib.Path) -> Iterator[LoggedServer]:
    args = [
        "agent", "--node-name", NODE, "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--backend", "noop", "--state-dir", str(short_dir / "agent"),
    ]  # fmt: skip
    server = LoggedServer(args, tmp_path / "agent.log")
    try:
        yield server
    finally:
        server.stop()


async def test_a_labelled_group_is_acquired_and_a_gone_holder_loses_it(
    api: ApiServerEmulator, agent: LoggedServer, tmp_path: pathlib.Path
) -> None:
    port = int(agent.wait_for(r"serving on 127\.0\.0\.1:(\d+)").group(1))
    api.apply(objects.node(NODE))  # not in a group yet
    api.apply(objects.agent_pod(NODE, "127.0.0.1", port))
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
    args = [
        "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig),
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--state-dir", str(tmp_path / "orchestrator"), "--shutdown-grace", "1",
    ]  # fmt: skip
    orchestrator = LoggedServer(args, tmp_path / "orchestrator.log")
    try:
        address = orchestrator.wait_for(r"serving on (127\.0\.0\.1:\d+)").group(1)
        api.apply(objects.node(NODE, "trainer"))
        orchestrator.wait_for(r"group trainer appeared with 1 node\(s\): gpu-a")
        await _hand_over_when_the_holders_pods_go(api, address)
    except BaseException:
        print(orchestrator.logs(), agent.logs())
        raise
    finally:
        orchestrator.stop()


async def _hand_over_when_the_holders_pods_go(api: ApiServerEmulator, address: str) -> None:
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
    ):
        assert "trainer" in await a.list_groups()
        await a.acquire("trainer", timeout=30)
        events = b.watch_events("trainer")
        await events.started()
        waiting = asyncio.create_task(b.acquire("trainer", timeout=30))
        queued = await _next(events, EventKind.QUEUED)
        assert queued.job_id == "job-b"
        api.store.delete("pods", "rl", "job-a-trainer-0")
        yielded = await _next(events, EventKind.YIELDED)
        assert yielded.job_id == "job-a"
        assert "every pod of job job-a is gone" in yielded.detail
        granted = await asyncio.wait_for(waiting, 30)
        assert granted.success
        await events.aclose()


async def _next(events: AsyncIterator[OrchestratorEvent], kind: EventKind) -> OrchestratorEvent:
    async def first() -> OrchestratorEvent:
        async for event in events:
            if event.kind is kind:
                return event
        raise AssertionError(f"the event stream ended before a {kind.value} event")

    return await asyncio.wait_for(first(), 30)
