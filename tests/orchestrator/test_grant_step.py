"""A switch is one Grant per node on tslice agents; llm-d's agents get directives.

Which one is negotiated: an agent declares what it speaks in its Status reply."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from tests.orchestrator.llmd_agent import LlmdAgent
from tests.orchestrator.orch_harness import (
    Cluster,
    Events,
    GiB,
    acquire,
    agent_calls,
    free_port,
    yield_,
)
from tslice.agent import server as agent_server
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
FOOTPRINT = 4 * GiB  # the sim's default: 40 % of a 10 GiB device


async def read_until(ev: Events, found: Callable[[opb.OrchestratorEvent], bool]) -> None:
    """Read the stream until an event ``found`` accepts (events already seen do not count)."""

    async def read() -> None:
        async for e in ev.call:
            ev.seen.append(e)
            if found(e):
                return
        raise AssertionError("event stream ended")

    await asyncio.wait_for(read(), 10)


async def hand_over(stub: Any, ev: Events, *, to: str, frm: str) -> opb.AcquireResponse:
    waiter = asyncio.ensure_future(acquire(stub, to, "g"))
    await read_until(ev, lambda e: e.kind == K.KIND_QUEUED and e.job_id == to)
    await yield_(stub, frm, "g")
    result: opb.AcquireResponse = await waiter
    await read_until(ev, lambda e: e.kind == K.KIND_GRANTED and e.grant_epoch == result.grant_epoch)
    return result


def node_events(ev: Events, kind: int, job: str) -> list[tuple[str, int]]:
    return sorted((e.node, e.bytes) for e in ev.seen if e.kind == kind and e.job_id == job)


class CountingServicer(agent_server.SnapshotAgentServicer):
    """The agent's own servicer, counting the calls it gets (by method)."""

    calls: collections.Counter[str] = collections.Counter()

    async def Snapshot(self, request: Any, context: Any) -> Any:
        self.calls["Snapshot"] += 1
        return await super().Snapshot(request, context)

    async def Restore(self, request: Any, context: Any) -> Any:
        self.calls["Restore"] += 1
        return await super().Restore(request, context)

    async def WaitOperation(self, request: Any, context: Any) -> Any:
        self.calls["WaitOperation"] += 1
        return await super().WaitOperation(request, context)

    async def grant_reply(self, request: Any) -> Any:
        self.calls["Grant"] += 1  # unary or streamed
        return await super().grant_reply(request)

    async def GrantStream(self, request_iterator: Any, context: Any) -> Any:
        self.calls["GrantStream"] += 1
        async for reply in super().GrantStream(request_iterator, context):
            yield reply


async def test_each_node_takes_one_grant_per_switch_and_no_status_read(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_server, "SnapshotAgentServicer", CountingServicer)
    CountingServicer.calls.clear()
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    port = free_port()
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]}, metrics_port=port)
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")  # first switch: each node's Status is read once
    b = await hand_over(stub, ev, to="b", frm="a")
    a = await hand_over(stub, ev, to="a", frm="b")
    assert not b.context_restored and a.context_restored

    # Three switches on two nodes: six Grants over one stream per node, and nothing else
    # that changes state.
    assert CountingServicer.calls == {"Grant": 6, "GrantStream": 2}, CountingServicer.calls
    calls = await agent_calls(port)
    for node in ("node-a", "node-b"):
        assert calls[(node, "grant")] == 3, calls
        assert calls[(node, "status")] == 1, calls
        assert (node, "reset") not in calls, calls
    # Events come from the operations the Grants report: durations and bytes per node.
    both = [("node-a", FOOTPRINT), ("node-b", FOOTPRINT)]
    assert node_events(ev, K.KIND_SNAPSHOT_DONE, "a") == both
    assert node_events(ev, K.KIND_SNAPSHOT_DONE, "b") == both
    assert node_events(ev, K.KIND_RESTORE_DONE, "a") == both
    # The last switch's events, in the order a watcher gets them.
    last = ev.seen[max(i for i, e in enumerate(ev.seen) if e.kind == K.KIND_QUEUED) + 1 :]
    kinds = [K.Kind.Name(e.kind).removeprefix("KIND_") for e in last]
    assert kinds[:2] == ["YIELDED", "SWITCH_STARTED"] and kinds[-2:] == ["SWITCH_DONE", "GRANTED"]
    assert sorted(kinds[2:-2]) == ["RESTORE_DONE"] * 2 + ["SNAPSHOT_DONE"] * 2
    ev.cancel()


async def test_a_slow_node_is_waited_on_and_its_grant_reissued(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b", sim={"extra_latency_s": 0.3})
    port = free_port()
    await cluster.start_orchestrator(
        groups={"g": ["node-a", "node-b"]}, metrics_port=port, wait_chunk_s=0.05
    )
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")
    await hand_over(stub, ev, to="b", frm="a")
    a = await hand_over(stub, ev, to="a", frm="b")
    assert a.context_restored

    calls = await agent_calls(port)
    # node-b's Grant came back unfinished (50 ms chunks, 300 ms copies): the orchestrator
    # waited on the operations, then re-issued it; node-a needed one Grant per switch (more
    # only if a loaded machine kept its few-ms copies past a 50-ms chunk).
    assert calls[("node-b", "grant")] >= 5, calls
    assert calls[("node-a", "grant")] >= 3, calls
    # Each operation is reported once, however many times a Grant listed it.
    both = [("node-a", FOOTPRINT), ("node-b", FOOTPRINT)]
    assert node_events(ev, K.KIND_SNAPSHOT_DONE, "b") == both
    assert node_events(ev, K.KIND_RESTORE_DONE, "a") == both
    for agent in cluster.agents.values():
        jobs = await agent.jobs()
        assert (jobs["a"].state, jobs["b"].state) == (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SAVED)
    ev.cancel()


def topology(**agents: str) -> dict[str, Any]:
    """One group ``g`` over the named nodes at the given addresses."""
    nodes = [{"name": name, "agent": address} for name, address in agents.items()]
    return {"groups": {"g": {"nodes": nodes}}}


async def test_tslice_agents_declare_what_they_speak(cluster: Cluster) -> None:
    agent = await cluster.start_agent("node-a")
    status = await agent.stub.Status(pb.StatusRequest())
    assert status.HasField("features")
    assert status.features.grant_step and status.features.grant_stream


async def test_an_llmd_agent_gets_snapshot_and_restore_directives_only(
    cluster: Cluster,
) -> None:
    llmd = LlmdAgent({"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED})
    await llmd.start()
    try:
        await cluster.start_agent("node-b")
        port = free_port()
        await cluster.start_orchestrator(
            topology=topology(
                **{"node-a": llmd.address, "node-b": cluster.agents["node-b"].address}
            ),
            metrics_port=port,
        )
        stub = cluster.stub()
        ev = await Events.open(stub, "g")
        first = await acquire(stub, "a", "g")  # a already runs on node-a: nothing to move
        b = await hand_over(stub, ev, to="b", frm="a")
        a = await hand_over(stub, ev, to="a", frm="b")
        assert not first.context_restored and b.context_restored and a.context_restored
        ev.cancel()
    finally:
        await llmd.stop()

    # node-a heard only llm-d's RPCs: the start-up check's Status read (is every agent of
    # the topology there?), a Status read before each switch (workloads register there
    # behind the orchestrator's back), the directives, and GetOperation polls.
    assert set(llmd.calls) == {"Status", "Snapshot", "Restore", "GetOperation"}, llmd.calls
    assert (llmd.calls["Status"], llmd.calls["Snapshot"], llmd.calls["Restore"]) == (4, 2, 2)
    assert llmd.jobs == {"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED}
    # node-b, a tslice agent in the same group, took one Grant per switch.
    calls = await agent_calls(port)
    assert calls[("node-b", "grant")] == 3 and calls[("node-b", "status")] == 1, calls
    assert calls[("node-a", "snapshot")] == 2 and calls[("node-a", "restore")] == 2, calls
    assert ("node-a", "grant") not in calls, calls
    # Both kinds of node report their moves as events, with the bytes they moved.
    assert node_events(ev, K.KIND_RESTORE_DONE, "a") == [("node-a", 1000), ("node-b", FOOTPRINT)]
    assert node_events(ev, K.KIND_SNAPSHOT_DONE, "b") == [("node-a", 1000), ("node-b", FOOTPRINT)]


async def test_a_faulted_job_on_an_llmd_agent_degrades_the_node(cluster: Cluster) -> None:
    llmd = LlmdAgent({"a": pb.JOB_STATE_FAULTED})
    await llmd.start()
    try:
        await cluster.start_orchestrator(
            topology=topology(**{"node-a": llmd.address}),
            backoff_initial_s=0.001,
            backoff_max_s=0.01,
            max_refusals=2,
        )
        stub = cluster.stub()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(acquire(stub, "a", "g"), 10)
    finally:
        await llmd.stop()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "llm-d's agent cannot reset it" in (err.value.details() or "")
    assert set(llmd.calls) == {"Status"}, llmd.calls  # no ResetJob tried, nothing moved


async def test_the_protocol_is_read_again_when_another_agent_answers_the_address(
    cluster: Cluster,
) -> None:
    port = free_port()
    llmd = LlmdAgent({"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED})
    await llmd.start(port)
    await cluster.start_orchestrator(topology=topology(**{"node-a": llmd.address}))
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")
    await hand_over(stub, ev, to="b", frm="a")
    await llmd.stop()
    assert llmd.calls["Snapshot"] == 1 and llmd.calls["Restore"] == 1, llmd.calls

    # A tslice agent takes the address over: the next switch reads its Status and grants.
    agent = await cluster.start_agent("node-a", port=port)
    await hand_over(stub, ev, to="a", frm="b")
    assert await agent.state("a") == pb.JOB_STATE_RUNNING
    await cluster.stop_agent("node-a")

    # And back: the Grant stream breaks, the node is read again and gets directives.
    again = LlmdAgent({"a": pb.JOB_STATE_RUNNING, "b": pb.JOB_STATE_SAVED})
    await again.start(port)
    try:
        await hand_over(stub, ev, to="b", frm="a")
    finally:
        await again.stop()
    assert again.calls["Snapshot"] == 1 and again.calls["Restore"] == 1, again.calls
    assert "Grant" not in again.calls and "GrantStream" not in again.calls
    assert again.jobs == {"a": pb.JOB_STATE_SAVED, "b": pb.JOB_STATE_RUNNING}
    ev.cancel()


class RecordingServicer(agent_server.SnapshotAgentServicer):
    """The agent's own servicer, keeping every Grant it gets."""

    grants: list[pb.GrantRequest] = []

    async def grant_reply(self, request: Any) -> Any:
        self.grants.append(request)
        return await super().grant_reply(request)


async def test_grants_name_the_devices_the_topology_gives_the_group(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_server, "SnapshotAgentServicer", RecordingServicer)
    RecordingServicer.grants = []
    a = await cluster.start_agent("node-a")
    b = await cluster.start_agent("node-b")
    nodes = [
        {"name": "node-a", "agent": a.address, "devices": [1, 3]},
        {"name": "node-b", "agent": b.address},
    ]
    await cluster.start_orchestrator(topology={"groups": {"g": {"nodes": nodes}}})
    await acquire(cluster.stub(), "a", "g")
    devices = sorted((g.group, list(g.devices)) for g in RecordingServicer.grants)
    assert devices == [("g", []), ("g", [1, 3])]
