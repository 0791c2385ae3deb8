"""A switch is one Grant per node (evict, restore, record); older agents get the steps."""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, GiB, acquire, yield_
from tslice.agent import server as agent_server
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
FOOTPRINT = 4 * GiB  # the sim's default: 40 % of a 10 GiB device


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
    # waited on the operations, then re-issued it; node-a needed one Grant per switch.
    assert calls[("node-b", "grant")] >= 5, calls
    assert calls[("node-a", "grant")] == 3, calls
    # Each operation is reported once, however many times a Grant listed it.
    both = [("node-a", FOOTPRINT), ("node-b", FOOTPRINT)]
    assert node_events(ev, K.KIND_SNAPSHOT_DONE, "b") == both
    assert node_events(ev, K.KIND_RESTORE_DONE, "a") == both
    for agent in cluster.agents.values():
        jobs = await agent.jobs()
        assert (jobs["a"].state, jobs["b"].state) == (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SAVED)
    ev.cancel()


class OlderAgentServicer(agent_server.SnapshotAgentServicer):
    """An agent from before the one-step Grant: it knows nothing of evict/restore/wait_ms
    and its replies carry only ``state`` (unknown fields are dropped on the wire)."""

    async def Grant(
        self, request: pb.GrantRequest, context: grpc.aio.ServicerContext
    ) -> pb.GrantResponse:
        older = pb.GrantRequest()
        older.CopyFrom(request)
        for field in ("evict", "restore", "wait_ms"):
            older.ClearField(field)
        reply = await super().Grant(older, context)
        return pb.GrantResponse(state=reply.state)

    async def GrantStream(self, request_iterator: Any, context: Any) -> None:
        # What a server without the method answers: the orchestrator falls back to Grant.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


async def test_an_agent_without_one_step_grant_gets_the_original_steps(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_server, "SnapshotAgentServicer", OlderAgentServicer)
    await cluster.start_agent("node-a")
    monkeypatch.undo()
    await cluster.start_agent("node-b")
    port = free_port()
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]}, metrics_port=port)
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")
    await hand_over(stub, ev, to="b", frm="a")
    a = await hand_over(stub, ev, to="a", frm="b")
    assert a.context_restored

    for agent in cluster.agents.values():
        jobs = await agent.jobs()
        assert (jobs["a"].state, jobs["b"].state) == (pb.JOB_STATE_RUNNING, pb.JOB_STATE_SAVED)
    calls = await agent_calls(port)
    # node-a: Snapshot and Restore calls, then a plain Grant (found out at the first switch,
    # whose Grant it answered without the one-step fields: two Grants there); node-b: one
    # Grant per switch.
    assert calls[("node-a", "grant")] == 4 and calls[("node-a", "status")] == 2, calls
    assert calls[("node-a", "snapshot")] == 2 and calls[("node-a", "restore")] == 1, calls
    assert calls[("node-b", "grant")] == 3 and calls[("node-b", "status")] == 1, calls
    both = [("node-a", FOOTPRINT), ("node-b", FOOTPRINT)]
    assert node_events(ev, K.KIND_RESTORE_DONE, "a") == both
    ev.cancel()
