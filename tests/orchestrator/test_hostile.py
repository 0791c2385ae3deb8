"""Hostile input at the orchestrator's edge (real in-process orchestrator and agents)."""

from __future__ import annotations

import asyncio
import sqlite3

import grpc
import httpx
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, yield_
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb


async def test_watch_of_an_unknown_event_kind_is_refused(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    call = stub.WatchEvents(opb.WatchEventsRequest(kinds=[opb.OrchestratorEvent.KIND_GRANTED, 42]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kinds" in info.value.details() and "KIND_GRANTED (2)" in info.value.details()


# ---- 2. ids and bounded messages -----------------------------------------------------------

HUGE = "x" * 3_000_000
SHORT = 1000


async def test_huge_node_name_of_clear_degraded_is_refused_with_a_short_message(
    cluster: Cluster,
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    for node in (HUGE, "no such node " * 100):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.ClearDegraded(opb.ClearDegradedRequest(group_id="g", node=node))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert "node" in info.value.details() and len(info.value.details()) < SHORT


@pytest.mark.parametrize("field", ["job_id", "group_id"])
async def test_huge_or_malformed_ids_are_refused_with_a_short_message(
    cluster: Cluster, field: str
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    for bad in (HUGE, "white space " * 20, "x" * 254, ""):
        fields = {"job_id": "j", "group_id": "g", field: bad}
        for call in (
            stub.Acquire(opb.AcquireRequest(**fields)),
            stub.Yield(opb.YieldRequest(**fields)),
            stub.Hold(opb.HoldRequest(**fields)).read(),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in info.value.details() and len(info.value.details()) < SHORT
    assert list((await stub.ListGroups(opb.ListGroupsRequest())).group_ids) == []


async def test_session_refusals_are_short(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    call = cluster.stub().Session()
    await call.write(
        opb.SessionRequest(request_id=1, acquire=opb.AcquireRequest(job_id=HUGE, group_id="g"))
    )
    reply = await call.read()
    assert reply.request_id == 1 and reply.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert len(reply.status_message) < SHORT
    await call.done_writing()


# ---- 3. a footprint that can never fit -----------------------------------------------------

GiB = 1024**3


@pytest.mark.parametrize("footprint", [11 * GiB, 10**15, 2**63 - 1])
@pytest.mark.parametrize("topology", ["local", "static"])
async def test_a_footprint_larger_than_a_node_is_refused_at_once_even_behind_a_holder(
    cluster: Cluster, footprint: int, topology: str
) -> None:
    # 10 GiB simulated devices (one per node): such a job can never be resident.
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    if topology == "static":
        await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    else:
        await cluster.start_orchestrator()
    stub = cluster.stub()
    await acquire(stub, "holder", "g")
    # Refused at once, not queued behind the holder until the caller's deadline.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Acquire(
            opb.AcquireRequest(job_id="big", group_id="g", footprint_bytes=footprint), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    details = info.value.details()
    assert "big" in details and "node-a" in details and str(footprint) in details
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert status.locking_job == "holder" and list(status.waiting_jobs) == []


async def test_a_footprint_that_fits_still_waits_its_turn(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    await acquire(stub, "holder", "g")
    waiting = asyncio.ensure_future(acquire(stub, "small", "g", footprint_bytes=4 * GiB))
    events = await Events.open(stub, "g")
    while (
        "small"
        not in (
            await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))
        ).group.waiting_jobs
    ):
        await events.wait_for(opb.OrchestratorEvent.KIND_QUEUED, job="small")
    await yield_(stub, "holder", "g")
    assert (await waiting).success
    events.cancel()


# ---- 4. duplicate request ids on a Session stream ------------------------------------------


def _acquire_on(rid: int, job: str) -> opb.SessionRequest:
    return opb.SessionRequest(request_id=rid, acquire=opb.AcquireRequest(job_id=job, group_id="g"))


async def test_a_duplicate_request_id_is_refused_and_leaves_no_ghost_waiter(
    cluster: Cluster,
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    await acquire(stub, "holder", "g")
    events = await Events.open(stub, "g")
    call = stub.Session()
    await call.write(_acquire_on(1, "w"))
    await events.wait_for(opb.OrchestratorEvent.KIND_QUEUED, job="w")
    await call.write(_acquire_on(1, "w"))  # same id while the first is in flight
    reply = await call.read()
    assert reply.request_id == 1
    assert reply.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
    assert "request_id 1" in reply.status_message and "in flight" in reply.status_message
    # The stream goes away: its one waiter leaves the queue (no ghost left behind).
    call.cancel()
    await events.wait_for(opb.OrchestratorEvent.KIND_CANCELLED, job="w")
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert list(status.waiting_jobs) == []
    await yield_(stub, "holder", "g")
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert status.locking_job == "" and status.group_state == opb.GroupStatus.STATE_IDLE_YIELDED
    events.cancel()


async def test_a_request_id_may_be_used_again_once_answered(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    call = cluster.stub().Session()
    for job in ("a", "a"):
        await call.write(_acquire_on(7, job))
        reply = await call.read()
        assert reply.request_id == 7 and reply.status_code == 0 and reply.acquire.success
    # A cancel of an id that is not in flight changes nothing.
    await call.write(opb.SessionRequest(request_id=9, cancel=True))
    await call.write(
        opb.SessionRequest(request_id=7, release=opb.YieldRequest(job_id="a", group_id="g"))
    )
    reply = await call.read()
    assert reply.request_id == 7 and reply.release.success
    await call.done_writing()


# ---- 6. grant epochs behind the agents' marks ----------------------------------------------


@pytest.mark.parametrize("mark", [7, 10**9])
async def test_grants_go_on_past_an_agent_mark_ahead_of_the_orchestrator(
    cluster: Cluster, mark: int
) -> None:
    # What an orchestrator that lost its database sees: the agents remember later epochs.
    a = await cluster.start_agent("node-a")
    b = await cluster.start_agent("node-b")
    await a.stub.Grant(pb.GrantRequest(job_id="old", group="g", grant_epoch=mark, wait_ms=1000))
    await b.stub.Grant(pb.GrantRequest(job_id="old", group="g", grant_epoch=3, wait_ms=1000))
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]}, max_refusals=2)
    stub = cluster.stub()
    first = await asyncio.wait_for(acquire(stub, "a", "g"), 30)
    assert first.success and first.grant_epoch == mark + 1
    for agent in (a, b):  # the old resident was moved out everywhere
        assert await agent.state("a") == pb.JOB_STATE_RUNNING
        assert await agent.state("old") == pb.JOB_STATE_SAVED
    await yield_(stub, "a", "g")
    assert (await asyncio.wait_for(acquire(stub, "b", "g"), 30)).grant_epoch == mark + 2
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert status.locking_job == "b" and not status.degraded and status.grant_epoch == mark + 2


# ---- 8. local mode: a bounded number of groups, idle ones collected -------------------------


BIG = 6 * GiB  # of 10 GiB devices


async def _groups(stub: object) -> list[str]:
    return list((await stub.ListGroups(opb.ListGroupsRequest())).group_ids)  # type: ignore[attr-defined]


async def test_local_groups_are_bounded_and_idle_ones_without_residents_collected(
    cluster: Cluster,
) -> None:
    # Two jobs never fit beside each other (60% footprints): a yielded resident gives way.
    agent = await cluster.start_agent("node-a")
    await cluster.start_orchestrator(max_local_groups=2, idle_group_ttl_s=0)
    stub = cluster.stub()
    for job, gid in (("a", "tmp-1"), ("b", "tmp-2")):
        await acquire(stub, job, gid, footprint_bytes=BIG)
        await yield_(stub, job, gid)
    assert await agent.state("a") == pb.JOB_STATE_SAVED  # gave way to b: tmp-1 holds nothing
    # A third group: tmp-1 (idle, nothing resident) is collected; tmp-2's resident stays.
    await acquire(stub, "c", "tmp-3", footprint_bytes=BIG)
    assert await _groups(stub) == ["tmp-2", "tmp-3"]
    await yield_(stub, "c", "tmp-3")
    # tmp-1 comes back as a new group, and its job's saved state with it.
    again = await asyncio.wait_for(acquire(stub, "a", "tmp-1"), 30)
    assert again.success and again.context_restored
    assert await _groups(stub) == ["tmp-1", "tmp-3"]
    # Full, and nothing may go (a holds both groups): a new group is refused at once.
    assert (await asyncio.wait_for(acquire(stub, "a", "tmp-3"), 30)).success
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await acquire(stub, "d", "tmp-4")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_local_groups" in info.value.details() and "tmp-4" in info.value.details()
    assert await _groups(stub) == ["tmp-1", "tmp-3"]


async def test_a_collected_group_leaves_no_rows_and_no_metrics_behind(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    cfg = cluster.config(max_local_groups=2, idle_group_ttl_s=0, metrics_port=free_port())
    await cluster.start_orchestrator(cfg)
    stub = cluster.stub()
    for job, gid in (("a", "old"), ("b", "mid"), ("c", "new")):  # each gives way to the next
        await acquire(stub, job, gid, footprint_bytes=BIG)
        await yield_(stub, job, gid)
    # "old" went to make room for "new"; "mid" (idle, its state given way) may go too at
    # any periodic sweep (every second with a TTL of 0): on a loaded machine one can fall
    # between any two lines here.
    listed = await _groups(stub)
    assert "old" not in listed and "new" in listed, listed
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{cfg.metrics_port}/metrics")).text
    assert 'group_id="new"' in text and 'group_id="old"' not in text
    await cluster.stop_orchestrator()
    with sqlite3.connect(cfg.state_dir / "orchestrator.db") as db:
        rows = {gid for (gid,) in db.execute("SELECT group_id FROM groups")}
    assert "new" in rows and rows <= set(listed), (rows, listed)


async def test_declared_groups_are_never_collected(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(local_groups=["s", "t"], idle_group_ttl_s=0)
    stub = cluster.stub()
    for job, gid in (("a", "s"), ("b", "t")):
        await acquire(stub, job, gid)
        await yield_(stub, job, gid)
    assert await _groups(stub) == ["s", "t"]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await acquire(stub, "c", "u")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
