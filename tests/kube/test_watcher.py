"""The Kubernetes-mode watcher against the API-server emulator, over real HTTP (lightkube):
list then watch, resume after a drop or a server-side close, re-list on 410 Gone,
bookmarks, cordons and readiness, pod phases. Every wait is on an event or a reported
version, never a sleep."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

pytest.importorskip("lightkube")

from lightkube.resources.core_v1 import Pod

from tests.kube import apistore, objects
from tests.kube.emulator import ApiServerEmulator
from tslice.orchestrator import config
from tslice.orchestrator.kube import model, watch
from tslice.orchestrator.switch import step as switch
from tslice.server import kube_watch

WAIT_S = 10.0  # a bound on a wait that should end at once (a hang fails, it does not stall)


class Seen:
    """What the watcher reported: events in a queue, versions per kind."""

    def __init__(self) -> None:
        self.events: asyncio.Queue[model.Event] = asyncio.Queue()
        self.versions: dict[str, str] = {}
        self.progressed = asyncio.Event()

    def on_events(self, events: list[model.Event]) -> None:
        for event in events:
            self.events.put_nowait(event)

    def on_progress(self, kind: model.Kind, version: str) -> None:
        self.versions[kind] = version
        self.progressed.set()

    async def next(self, want: Callable[[model.Event], bool]) -> model.Event:
        """The next event ``want`` accepts (earlier ones are skipped)."""

        async def first() -> model.Event:
            while True:
                event = await self.events.get()
                if want(event):
                    return event

        return await asyncio.wait_for(first(), WAIT_S)

    async def put(self, api: ApiServerEmulator, obj: apistore.Obj, kind: str = "job") -> None:
        """Write ``obj`` and wait until the stream of ``kind`` has seen it."""
        api.apply(obj)
        await self.version(kind, api.store.version)

    async def job_gone(self) -> str:
        event = await self.next(lambda e: isinstance(e, model.JobGone))
        assert isinstance(event, model.JobGone)
        return event.job

    async def version(self, kind: str, version: int) -> None:
        """Until the stream of ``kind`` has reached ``version``."""

        async def reached() -> None:
            while int(self.versions.get(kind, "0")) < version:
                self.progressed.clear()
                await self.progressed.wait()

        await asyncio.wait_for(reached(), WAIT_S)


@contextlib.asynccontextmanager
async def _watching(
    api: ApiServerEmulator, tmp_path: pathlib.Path, **settings: Any
) -> AsyncIterator[tuple[watch.Watcher, Seen]]:
    """A started, synced watcher of ``api`` (``settings``: KubeSettings fields)."""
    kube = config.KubeSettings(kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"), **settings)
    seen = Seen()
    watcher = watch.Watcher(
        watch.connect(kube),
        kube,
        on_events=seen.on_events,
        on_progress=seen.on_progress,
        backoff=switch.Backoff(0.01, 0.05),
    )
    watcher.start()
    try:
        await asyncio.wait_for(watcher.synced(), WAIT_S)
        while not seen.events.empty():  # what the first lists found: see watcher.model
            seen.events.get_nowait()
        # Every stream is watching: a fault the test sends from now on reaches all of them.
        await asyncio.to_thread(api.wait_for_watches, 3)
        yield watcher, seen
    finally:
        await watcher.close()


@pytest.fixture
async def watching(
    api: ApiServerEmulator, tmp_path: pathlib.Path
) -> AsyncIterator[tuple[watch.Watcher, Seen]]:
    api.apply(objects.node("gpu-a", "trainer"))
    api.apply(objects.agent_pod("gpu-a", "10.0.0.1"))
    async with _watching(api, tmp_path) as watching:
        yield watching


def _ref(name: str, ip: str, port: int = 9001) -> config.NodeRef:
    return config.NodeRef(name, f"{ip}:{port}")


async def test_list_then_watch_from_the_lists_version(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    a = _ref("gpu-a", "10.0.0.1")
    assert watcher.model.groups() == {"trainer": (a,)}
    listed = int(api.store.version)
    api.apply(objects.node("gpu-b", "trainer", "sampler"))
    # A labelled node counts at once, its agent not known yet: its groups wait for it.
    nowhere = config.NodeRef("gpu-b", model.no_agent_address("gpu-b"))
    assert {await seen.next(lambda e: True), await seen.next(lambda e: True)} == {
        model.GroupAppeared("sampler", (nowhere,)),
        model.GroupNodesChanged("trainer", (a, nowhere), (a,)),
    }
    api.apply(objects.agent_pod("gpu-b", "10.0.0.2", 9100))
    b = _ref("gpu-b", "10.0.0.2", 9100)
    assert {await seen.next(lambda e: True), await seen.next(lambda e: True)} == {
        model.GroupNodesChanged("sampler", (b,), (nowhere,)),
        model.GroupNodesChanged("trainer", (a, b), (a, nowhere)),
    }
    node_watches = [r for r in api.watch_requests("nodes")]
    assert len(node_watches) == 1
    assert node_watches[0].query["allowWatchBookmarks"] == "true"
    assert int(node_watches[0].query["resourceVersion"]) <= listed


async def test_cordoned_or_not_ready_nodes_do_not_count(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    api.apply(objects.node("gpu-a", "trainer", unschedulable=True))
    assert await seen.next(lambda e: not isinstance(e, model.GroupAppeared)) == model.GroupGone(
        "trainer"
    )
    assert watcher.model.pending_nodes() == {"gpu-a": "is cordoned"}
    api.apply(objects.node("gpu-a", "trainer"))
    assert isinstance(await seen.next(lambda e: True), model.GroupAppeared)
    api.apply(objects.node("gpu-a", "trainer", ready=False))
    assert await seen.next(lambda e: True) == model.GroupGone("trainer")
    assert watcher.model.pending_nodes() == {"gpu-a": "is not Ready"}


async def test_pod_phases_make_a_job_live_or_gone(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    api.apply(objects.job_pod("a-0", "job-a", "trainer", phase="Pending"))
    api.apply(objects.job_pod("a-1", "job-a", "trainer"))
    await seen.put(api, objects.job_pod("b-0", "job-b", "trainer"))
    assert watcher.model.live_jobs() == {"job-a", "job-b"}
    api.apply(objects.job_pod("a-0", "job-a", "trainer", phase="Succeeded"))
    api.store.delete("pods", "rl", "b-0")
    assert await seen.job_gone() == "job-b"
    api.apply(objects.job_pod("a-1", "job-a", "trainer", phase="Failed"))
    assert await seen.job_gone() == "job-a"
    assert watcher.model.live_jobs() == frozenset()


async def test_a_dropped_or_closed_watch_resumes_from_its_version(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    await seen.put(api, objects.job_pod("a-0", "job-a", "trainer"))
    reached = seen.versions["job"]
    api.drop_watches()
    api.store.delete("pods", "rl", "a-0")  # while no watch is open
    assert await seen.job_gone() == "job-a"
    resumed = [r.query.get("resourceVersion") for r in api.watch_requests("pods")]
    assert reached in resumed[2:]  # both pod streams came back; the job one from its version
    api.close_watches()
    await seen.put(api, objects.job_pod("c-0", "job-c", "trainer"))
    assert watcher.model.live_jobs() == {"job-c"}
    assert watcher.relists == 0


async def test_a_gone_version_is_listed_again_and_missed_deletions_are_seen(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    await seen.put(api, objects.job_pod("a-0", "job-a", "trainer"))
    api.refuse(10**6)  # the API server is in trouble: the watches cannot come back
    api.drop_watches()
    api.store.delete("pods", "rl", "a-0")
    api.store.compact()  # and the deletion is compacted away before they do
    api.refuse(0)
    assert await seen.job_gone() == "job-a"
    assert watcher.relists >= 1
    api.expire_watches()  # an open watch told 410 Gone lists again too
    api.apply(objects.node("gpu-b", "trainer"))
    api.apply(objects.agent_pod("gpu-b", "10.0.0.2"))
    await seen.next(lambda e: isinstance(e, model.GroupNodesChanged))


async def test_a_bookmark_moves_the_version_a_watch_resumes_from(
    api: ApiServerEmulator, watching: tuple[watch.Watcher, Seen]
) -> None:
    watcher, seen = watching
    api.apply(objects.node("gpu-b"))  # a change the job stream does not see
    await seen.version("node", api.store.version)
    api.bookmark()
    for kind in ("node", "job", "agent"):
        await seen.version(kind, api.store.version)
    api.store.compact()  # only the bookmark's version can be resumed from now
    api.drop_watches()
    await seen.put(api, objects.job_pod("a-0", "job-a", "trainer"))
    assert watcher.model.live_jobs() == {"job-a"}
    assert watcher.relists == 0


def test_an_agent_is_reached_at_its_pod_ip_and_grpc_port() -> None:
    pod = objects.agent_pod("gpu-a", "fd00::7", 9100)
    assert watch.agent_pod(Pod.from_dict(pod)).address == "[fd00::7]:9100"
    unnamed = objects.agent_pod("gpu-a", "10.0.0.1", 9100, port_name="metrics")
    assert watch.agent_pod(Pod.from_dict(unnamed)).address == "10.0.0.1:9001"
    pending = {**pod, "status": {"phase": "Pending"}}
    assert watch.agent_pod(Pod.from_dict(pending)).address is None


def test_only_pending_and_running_pods_keep_a_job_live() -> None:
    for phase, live in [
        ("Pending", True),
        ("Running", True),
        ("Succeeded", False),
        ("Failed", False),
    ]:
        pod = Pod.from_dict(objects.job_pod("p", "job-a", "trainer", phase=phase))
        assert watch.job_pod(pod) == model.JobPod("rl/p", "job-a", "trainer", live=live)


async def test_the_namespaces_and_the_agent_selector_are_kept(
    api: ApiServerEmulator, tmp_path: pathlib.Path
) -> None:
    api.apply(objects.node("gpu-a", "trainer"))
    elsewhere = objects.agent_pod("gpu-a", "10.0.0.9")  # the default labels, not the selector's
    api.apply(objects.job_pod("a-0", "job-a", "trainer", namespace="other"))
    mine = objects.agent_pod("gpu-a", "10.0.0.1")
    mine["metadata"].update(namespace="agents", labels={"app": "agent"})
    api.apply(elsewhere)
    api.apply(mine)
    settings = {"job_namespace": "rl", "agent_namespace": "agents", "agent_selector": "app=agent"}
    async with _watching(api, tmp_path, **settings) as (watcher, seen):
        assert watcher.model.groups() == {"trainer": (_ref("gpu-a", "10.0.0.1"),)}
        await seen.put(api, objects.job_pod("b-0", "job-b", "trainer", namespace="rl"))
        assert watcher.model.live_jobs() == {"job-b"}  # job-a's pod is in another namespace


async def test_a_long_list_is_read_page_by_page(
    api: ApiServerEmulator, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kube_watch, "LIST_PAGE", 2)
    for i in range(5):
        api.apply(objects.node(f"gpu-{i}", "trainer"))
        api.apply(objects.agent_pod(f"gpu-{i}", f"10.0.0.{i}"))
    async with _watching(api, tmp_path) as (watcher, _):
        assert len(watcher.model.groups()["trainer"]) == 5
    pages = [r.query for r in api.requests if r.path == "/api/v1/nodes" and "watch" not in r.query]
    assert [q.get("continue") for q in pages] == [
        None,
        f"{api.store.version}:2",
        f"{api.store.version}:4",
    ]
