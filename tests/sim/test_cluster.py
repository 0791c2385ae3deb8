"""LocalCluster: real processes, ready files, SIGKILL and restart on the same port."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

import tslice.client as tsclient
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.sim import cluster


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cluster_serves_and_restarts_on_the_same_port(two_pools: cluster.LocalCluster) -> None:
    local = two_pools
    assert set(local.names) == {"orchestrator", "node-a", "node-b"}
    for name in local.names:
        assert local.address(name).startswith("127.0.0.1:")
        assert local.alive(name)
    assert local.group_nodes() == {"sampler": ("node-a",), "trainer": ("node-b",)}

    with tsclient.Client(local.orchestrator_address, job_id="job-x") as client:
        granted = client.acquire("sampler", timeout=30, footprint_bytes=10 * device.GiB)
        assert granted.success
        client.yield_("sampler")

    # The grant landed the job's bytes on node-a: the journal says so.
    journal = local.read_journals()
    assert any(e.job == "job-x" and e.node == "node-a" and e.event == "alloc" for e in journal)

    for name in ("node-a", "orchestrator"):
        before_address, before_pid = local.address(name), local.pid(name)
        assert before_pid is not None
        local.kill(name, signal=signal.SIGKILL)
        assert not local.alive(name)
        assert local.exited()[name] == -signal.SIGKILL
        local.restart(name)
        assert local.alive(name)
        assert local.address(name) == before_address
        assert local.pid(name) != before_pid

    # Clients reach the restarted orchestrator at the old address; the state survived.
    with tsclient.Client(local.orchestrator_address, job_id="job-y") as client:
        assert "sampler" in client.list_groups()
        assert client.acquire("sampler", timeout=30).success
        client.yield_("sampler")


async def test_stop_terminates_every_process(tmp_path: Path) -> None:
    async with cluster.LocalCluster(agents=1, base_dir=tmp_path, grace_s=10) as local:
        pids = [local.pid(n) for n in local.names]
        assert all(p is not None and pid_alive(p) for p in pids)
        assert local.group_nodes() is None  # local mode: groups appear on first acquire
        async with tsclient.AsyncClient(local.orchestrator_address, job_id="j") as client:
            assert (await client.acquire("any-group", timeout=30)).success
            assert (await client.status("any-group")).nodes == ("node-1",)
    assert not any(pid_alive(p) for p in pids if p is not None)
    # A given base dir is kept: logs and state stay for inspection.
    assert (tmp_path / "orchestrator.log").is_file()
    assert (tmp_path / "node-1").is_dir()


def test_failed_start_names_the_process_and_its_log(tmp_path: Path) -> None:
    bad = cluster.SimAgent(name="node-1", extra_args=("--no-such-flag",))
    with pytest.raises(cluster.ClusterError) as err:
        cluster.LocalCluster(agents=[bad], base_dir=tmp_path).start()
    message = str(err.value)
    assert "node-1 exited with code 2 before it was ready" in message
    assert "no-such-flag" in message and str(tmp_path / "node-1.log") in message
    assert "\n" not in message


def test_topology_must_name_known_agents() -> None:
    with pytest.raises(ValueError, match="unknown: \\['node-z'\\]"):
        cluster.LocalCluster(agents=1, groups={"g": ["node-z"]})
    with pytest.raises(ValueError, match="unique"):
        cluster.LocalCluster(agents=[cluster.SimAgent("a"), cluster.SimAgent("a")])


def test_sim_agent_flags_pass_every_setting_given() -> None:
    agent = cluster.SimAgent(
        name="n", bandwidth_bytes_per_s=5 * 10**9, restore_bandwidth_bytes_per_s=15 * 10**9
    )
    flags = agent.flags()
    assert flags[flags.index("--sim-bandwidth") + 1] == str(5 * 10**9)
    assert flags[flags.index("--sim-restore-bandwidth") + 1] == str(15 * 10**9)
    assert "--sim-restore-bandwidth" not in cluster.SimAgent(name="n").flags()


async def test_agent_process_restores_at_its_restore_bandwidth(tmp_path: Path) -> None:
    # Snapshot ~0.4 s, restore 100x faster; without the flag both would take ~0.4 s.
    agent = cluster.SimAgent(
        name="node-1",
        capacity_bytes=4 * device.GiB,
        bandwidth_bytes_per_s=int(device.GiB / 0.4),
        restore_bandwidth_bytes_per_s=int(device.GiB / 0.004),
        latency_s=0.0,
    )
    async with (
        cluster.LocalCluster(agents=[agent], base_dir=tmp_path) as local,
        grpc.aio.insecure_channel(local.address("node-1")) as channel,
    ):
        stub = pb_grpc.SnapshotAgentServiceStub(channel)
        granted = await stub.Grant(
            pb.GrantRequest(
                job_id="j",
                group="g",
                grant_epoch=1,
                footprint_bytes=device.GiB,
                wait_ms=10_000,
            )
        )
        assert granted.state == pb.JOB_STATE_RUNNING
        started = await stub.Snapshot(pb.SnapshotRequest(job_id="j", group="g"))
        snapshot = await stub.WaitOperation(
            pb.WaitOperationRequest(operation_id=started.operation_id, timeout_ms=10_000)
        )
        started = await stub.Restore(pb.RestoreRequest(job_id="j", group="g"))
        restore = await stub.WaitOperation(
            pb.WaitOperationRequest(operation_id=started.operation_id, timeout_ms=10_000)
        )
    done = pb.OPERATION_STATUS_COMPLETE
    assert (snapshot.status, restore.status) == (done, done)
    assert snapshot.elapsed_ms >= 350
    assert restore.elapsed_ms * 4 < snapshot.elapsed_ms
