"""The agent's Kubernetes mode against the API-server emulator of tests/kube (real HTTP,
the real lightkube client): the pods of its own node, and who may register a workload.

A workload's process is matched to a pod through ``<proc_root>/<pid>/cgroup``: the tests
write a fixture tree for their own pid (the pid the agent learns by SO_PEERCRED).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("lightkube")

from tests.harness.servers import Server
from tests.kube.emulator import ApiServerEmulator
from tslice.agent import app as agent_app
from tslice.agent import config as agent_config
from tslice.agent import discovery
from tslice.agent.kube import node_pods, pod_registry, pods
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.server import kube_watch
from tslice.workload import register_workload
from tslice.workload.process import RegistrationError, announce_process

WAIT_S = 20.0
NODE = "node-a"


def _pod(name: str, node: str, labels: dict[str, str], namespace: str = "rl") -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "trainer"}, {"name": "sidecar"}]},
        "status": {"phase": "Running"},
    }


def _job(job: str, group: str) -> dict[str, str]:
    return {"timeslice.io/job-id": job, "timeslice.io/group": group}


def _in_pod(proc_root: Path, pid: int, uid: str | None) -> None:
    """``pid``'s cgroup (systemd driver) names pod ``uid``, or no pod at all."""
    where = (
        f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-1.scope"
        if uid is not None
        else "0::/system.slice/sshd.service"
    )
    (proc_root / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc_root / str(pid) / "cgroup").write_text(where + "\n")


@pytest.fixture
def api() -> Iterator[ApiServerEmulator]:
    with ApiServerEmulator() as emulator:
        yield emulator


async def _until(watcher: pods.PodWatcher, reached: Callable[[], bool]) -> None:
    """Until ``reached()``, checked each time the pod stream moves on."""
    moved = asyncio.Event()
    watcher.stream.on_progress = lambda _version: moved.set()

    async def wait() -> None:
        while not reached():
            await moved.wait()
            moved.clear()

    await asyncio.wait_for(wait(), WAIT_S)


async def test_the_agent_watches_the_job_pods_of_its_own_node_only(
    api: ApiServerEmulator, tmp_path: Path
) -> None:
    mine = api.apply(_pod("a-0", NODE, _job("job-a", "trainer")))
    api.apply(_pod("b-0", "node-b", _job("job-b", "trainer")))  # another node
    api.apply(_pod("web", NODE, {"app": "web"}))  # no job label
    watcher = pods.PodWatcher(
        NODE,
        kubeconfig=api.write_kubeconfig(tmp_path / "kubeconfig"),
        backoff=kube_watch.JitteredBackoff(0.01, 0.05),
    )
    watcher.start()
    try:
        await asyncio.wait_for(watcher.synced(), WAIT_S)
        uid = mine["metadata"]["uid"]
        assert watcher.pods.pods() == [
            node_pods.PodInfo(uid, "rl/a-0", "job-a", "trainer", ("trainer", "sidecar"), "Running")
        ]
        # What the agent asked for: its node's pods with a job label, in every namespace.
        await asyncio.to_thread(api.wait_for_watches, 1)
        (watch_request, *_) = api.watch_requests("pods")
        assert watch_request.query["fieldSelector"] == f"spec.nodeName={NODE}"
        assert watch_request.query["labelSelector"] == "timeslice.io/job-id"

        api.apply(_pod("b-1", "node-b", _job("job-a", "trainer")))
        second = api.apply(_pod("a-1", NODE, _job("job-a", "sampler")))
        await _until(watcher, lambda: len(watcher.pods.of_job("job-a")) == 2)
        assert [p.key for p in watcher.pods.of_job("job-a")] == ["rl/a-0", "rl/a-1"]

        api.store.delete("pods", "rl", "a-0")  # a pod that goes leaves the model
        await _until(watcher, lambda: len(watcher.pods.pods()) == 1)
        assert [p.uid for p in watcher.pods.pods()] == [second["metadata"]["uid"]]
    finally:
        await watcher.close()


def test_a_process_may_register_only_for_the_job_and_group_of_its_pod(tmp_path: Path) -> None:
    on_node = node_pods.NodePods()
    trainer = node_pods.PodInfo("11-aa", "rl/a-0", "job-a", "trainer", ("trainer",), "Running")
    unlabelled_group = node_pods.PodInfo("22-bb", "rl/b-0", "job-b", None, ("w",), "Running")
    on_node.replace([trainer, unlabelled_group])
    _in_pod(tmp_path, 100, "11-aa")
    _in_pod(tmp_path, 200, "22-bb")
    _in_pod(tmp_path, 300, None)

    def why(pid: int, job: str, group: str) -> str | None:
        return pod_registry.refusal(pid, job, group, on_node, proc_root=tmp_path)

    assert why(100, "job-a", "trainer") is None
    assert why(100, "job-a", "") is None
    assert why(200, "job-b", "anything") is None  # the pod names no group
    other_job = why(100, "job-b", "trainer")
    assert other_job is not None
    assert "pod rl/a-0, labelled timeslice.io/job-id=job-a, not job 'job-b'" in other_job
    other_group = why(100, "job-a", "sampler")
    assert other_group is not None and "timeslice.io/group=sampler" in other_group
    no_pod = why(300, "job-a", "trainer")
    assert no_pod is not None and "in no pod of job 'job-a'" in no_pod
    assert "timeslice.io/job-id=job-a" in no_pod
    assert why(400, "job-a", "trainer") is not None  # no such process


def test_the_gpu_processes_of_a_job_are_those_in_its_pods(tmp_path: Path) -> None:
    on_node = node_pods.NodePods()
    on_node.replace(
        [
            node_pods.PodInfo("11-aa", "rl/a-t", "job-a", "trainer", ("t",), "Running"),
            node_pods.PodInfo("22-bb", "rl/a-s", "job-a", "sampler", ("s",), "Running"),
            node_pods.PodInfo("33-cc", "rl/b-0", "job-b", None, ("w",), "Running"),
        ]
    )
    for pid, uid in ((100, "11-aa"), (101, "11-aa"), (200, "22-bb"), (300, "33-cc")):
        _in_pod(tmp_path, pid, uid)
    _in_pod(tmp_path, 400, None)
    nvml = [discovery.GpuProcess(pid, 0, "GPU-0", 1 << 30) for pid in (101, 100, 200, 300, 400)]
    nvml.append(discovery.GpuProcess(100, 1, "GPU-1", 1 << 30))  # one process, two GPUs

    def pids(job: str, group: str) -> list[int]:
        return pod_registry.pids_of_job(job, group, nvml, on_node, proc_root=tmp_path)

    assert pids("job-a", "") == [100, 101, 200]
    assert pids("job-a", "trainer") == [100, 101]
    assert pids("job-b", "anything") == [300]  # its pod names no group
    assert pids("job-c", "") == []


@pytest.fixture
async def kube_agent(api: ApiServerEmulator, short_tmp: Path) -> AsyncIterator[dict[str, Any]]:
    pod = api.apply(_pod("a-0", NODE, _job("job-a", "trainer")))
    config = agent_config.AgentConfig(
        node_name=NODE,
        port=0,
        state_dir=short_tmp / "state",
        unix_socket=short_tmp / "agent.sock",
        register_socket=short_tmp / "register.sock",
        backends=("app-channel",),
        kubernetes=True,
        kubeconfig=api.write_kubeconfig(short_tmp / "kubeconfig"),
        proc_root=short_tmp / "proc",
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(agent_app.serve(config, ready=ready.set_result, stop=stop))
    try:
        await asyncio.wait_for(ready, WAIT_S)
        yield {
            "socket": short_tmp / "agent.sock",
            "register": config.register_path,
            "proc": config.proc_root,
            "pod": pod,
        }
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def _register(socket: Path, job: str, group: str) -> tuple[bool, str | None]:
    handle = register_workload(
        f"unix:{socket}", job, group, on_snapshot=lambda m, t: None, on_restore=lambda t: None
    )
    try:
        registered = await asyncio.to_thread(handle.wait_registered, WAIT_S)
        return registered, None if handle.error is None else str(handle.error)
    finally:
        await asyncio.to_thread(handle.close)


async def test_the_agent_admits_a_workload_only_from_a_pod_of_its_job(
    kube_agent: dict[str, Any],
) -> None:
    socket, proc = kube_agent["socket"], kube_agent["proc"]
    _in_pod(proc, os.getpid(), kube_agent["pod"]["metadata"]["uid"])
    assert await _register(socket, "job-a", "trainer") == (True, None)
    registered, error = await _register(socket, "job-z", "trainer")
    assert not registered and error is not None
    # Final (PERMISSION_DENIED): the handle stopped and says why.
    assert error.startswith("the agent refused the registration of job 'job-z'"), error
    assert "in pod rl/a-0, labelled timeslice.io/job-id=job-a, not job 'job-z'" in error
    _in_pod(proc, os.getpid(), None)
    registered, error = await _register(socket, "job-a", "trainer")
    assert not registered and error is not None
    assert "in no pod of job 'job-a'" in error and "timeslice.io/job-id=job-a" in error


async def test_the_agent_takes_a_process_announcement_only_from_a_pod_of_its_job(
    kube_agent: dict[str, Any],
) -> None:
    register, proc = kube_agent["register"], kube_agent["proc"]
    _in_pod(proc, os.getpid(), kube_agent["pod"]["metadata"]["uid"])
    with pytest.raises(RegistrationError, match=r"labelled timeslice\.io/job-id=job-a, not job"):
        await asyncio.to_thread(announce_process, "job-z", group="trainer", socket_path=register)
    pid = await asyncio.to_thread(announce_process, "job-a", group="trainer", socket_path=register)
    assert pid == os.getpid()


def test_tslice_agent_kubernetes_serves_with_the_pods_of_its_node(
    api: ApiServerEmulator, short_tmp: Path
) -> None:
    api.apply(_pod("a-0", NODE, _job("job-a", "trainer")))
    api.apply(_pod("b-0", "node-b", _job("job-b", "trainer")))
    kubeconfig = api.write_kubeconfig(short_tmp / "kubeconfig")
    args = [
        "agent", "--kubernetes", "--kubeconfig", str(kubeconfig), "--node-name", NODE,
        "--host", "127.0.0.1", "--port", "0", "--state-dir", str(short_tmp / "state"),
        "--unix-socket", str(short_tmp / "agent.sock"),
    ]  # fmt: skip
    agent = Server(args[0], args[1:], short_tmp / "agent.log")
    try:
        agent.wait_for(rf"Kubernetes: 1 job pod\(s\) of 1 job\(s\) on node {NODE}")
        with grpc.insecure_channel(agent.wait_ready()) as channel:
            status = pb_grpc.SnapshotAgentServiceStub(channel).Status(
                pb.StatusRequest(), timeout=WAIT_S
            )
        assert status is not None
        api.apply(_pod("a-1", NODE, _job("job-a", "sampler")))
        agent.wait_for(r"pod rl/a-1 of job job-a on this node: added")
    finally:
        agent.stop()
