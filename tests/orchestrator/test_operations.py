"""Local mode, shutdown, metrics, event stream and the command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import grpc
import httpx
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
GS = opb.GroupStatus


async def test_local_mode_creates_groups_on_first_acquire(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    # addresses only: the orchestrator names the nodes as the agents report themselves
    cfg = cluster.config(local_agents=[a.address for a in cluster.agents.values()])
    await cluster.start_orchestrator(cfg)
    stub = cluster.stub()
    assert list((await stub.ListGroups(opb.ListGroupsRequest())).group_ids) == []
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await yield_(stub, "a", "sampler")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "created by its first Acquire" in (info.value.details() or "")
    # Local groups share every device: one job may hold both when its states fit.
    await acquire(stub, "a", "sampler", footprint_bytes=1 << 30)
    await acquire(stub, "a", "trainer", footprint_bytes=1 << 30)
    groups = await stub.ListGroups(opb.ListGroupsRequest())
    assert list(groups.group_ids) == ["sampler", "trainer"]
    st = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="sampler"))).group
    assert list(st.nodes) == ["node-a", "node-b"] and st.locking_job == "a"
    await cluster.restart_orchestrator()
    stub = cluster.stub()
    groups = await stub.ListGroups(opb.ListGroupsRequest())
    assert list(groups.group_ids) == ["sampler", "trainer"]  # persisted
    again = await acquire(stub, "a", "sampler")
    assert again.grant_epoch == 1


async def test_shutdown_fails_waiters_with_unavailable_and_keeps_their_place(
    cluster: Cluster,
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await cluster.stop_orchestrator()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await b_task
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down; retry" in (info.value.details() or "")
    await cluster.start_orchestrator(cluster.orch_config)
    stub = cluster.stub()
    st = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert list(st.waiting_jobs) == ["b"] and st.locking_job == "a"


async def test_metrics_endpoint_exposes_dashboard_names(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    port = free_port()
    await cluster.start_orchestrator(
        groups={"g": ["node-a"]}, metrics_port=port, history={"flush_interval_s": 0.05}
    )
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    await yield_(stub, "a", "g")  # deferred
    await acquire(stub, "b", "g")  # switch
    # Grants and their waits are counted from the events, in the tap's batches.
    wait_count = 'timeslice_orchestrator_acquire_wait_duration_seconds_count{group_id="g"} 2.0'
    async with httpx.AsyncClient() as http:
        for _ in range(100):  # the tap drains every flush_interval_s (0.05 s here)
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            if wait_count in text:
                break
            await asyncio.sleep(0.05)
    for name in (
        'timeslice_orchestrator_queue_depth{group_id="g"} 0.0',
        'timeslice_orchestrator_acquire_wait_duration_seconds_count{group_id="g"} 2.0',
        'timeslice_orchestrator_deferred_snapshots_total{group_id="g"} 1.0',
        'tslice_orchestrator_switches_total{group_id="g",outcome="completed"} 2.0',
        'tslice_orchestrator_switch_duration_seconds_count{group_id="g"} 2.0',
        'tslice_orchestrator_group_state{group_id="g",state="LOCKED"} 1.0',
        'tslice_orchestrator_group_state{group_id="g",state="IDLE"} 0.0',
    ):
        assert name in text, name
    ops = [
        line
        for line in text.splitlines()
        if line.startswith("timeslice_orchestrator_agent_operation_duration_seconds_count")
    ]
    labels = {line.split("{")[1].split("}")[0] for line in ops}
    assert 'group_id="g",node="node-a",operation="snapshot"' in labels
    assert 'group_id="g",node="node-a",operation="grant"' in labels
    assert all("job" not in label for label in labels)


async def test_watch_events_filter_and_unknown_group(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(groups={"g": ["node-a"], "h": ["node-b"]})
    stub = cluster.stub()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await Events(stub, "nope").call.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    only_h = await Events.open(stub, "h")
    every = await Events.open(stub)
    await acquire(stub, "x", "g")
    await acquire(stub, "y", "h")
    granted = await only_h.wait_for(K.KIND_GRANTED)
    assert granted.group_id == "h" and granted.job_id == "y" and granted.grant_epoch == 1
    await every.wait_for(K.KIND_GRANTED, job="y")
    assert {e.group_id for e in only_h.seen} == {"h"}
    assert {e.group_id for e in every.seen} == {"g", "h"}
    started = next(e for e in every.seen if e.kind == K.KIND_SWITCH_STARTED and e.group_id == "g")
    assert started.job_id == "x" and started.from_job == ""
    only_h.cancel()
    every.cancel()


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path: object) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tslice", "orchestrator", "--local-agent", "nohost"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --local-agent 'nohost'")
    assert "Traceback" not in result.stderr
