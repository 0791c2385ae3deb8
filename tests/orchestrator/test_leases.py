"""Holder leases: a holder that keeps no Hold stream open loses the lock after lease_ms.

Time passes in these tests through events only: the lease timer's own YIELDED
event, or keepalives of a Hold stream (sent every lease_ms/3), never sleeps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import validation

K = opb.OrchestratorEvent

LEASE_MS = 300


def hold(stub: Any, job: str, group: str, epoch: int = 0) -> Any:
    return stub.Hold(opb.HoldRequest(job_id=job, group_id=group, grant_epoch=epoch))


async def holder(stub: Any, group: str = "g") -> str:
    resp = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group))
    return str(resp.group.locking_job)


async def keepalives(call: Any, n: int) -> None:
    """Read ``n`` keepalives: at lease_ms/3 apart, 4 of them outlast the lease."""
    for _ in range(n):
        ev = await asyncio.wait_for(call.read(), 10)
        assert ev.lease_ms == LEASE_MS and not ev.released and not ev.lost


async def test_closed_hold_stream_loses_the_lock_within_the_lease(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    granted = await acquire(stub, "a", "g", lease_ms=LEASE_MS)
    call = hold(stub, "a", "g", granted.grant_epoch)
    assert (await call.read()).lease_ms == LEASE_MS
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    assert not b_task.done() and await holder(stub) == "a"
    closed = time.monotonic()
    call.cancel()  # as if the client process died
    lost = await ev.wait_for(K.KIND_YIELDED, job="a")
    elapsed = time.monotonic() - closed
    assert lost.detail == "lease expired"
    assert LEASE_MS / 1000 * 0.9 <= elapsed < 5.0
    b = await asyncio.wait_for(b_task, 10)
    assert b.grant_epoch == granted.grant_epoch + 1
    # The old holder no longer holds: b does, so its Yield and its Hold are refused.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await yield_(stub, "a", "g")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await hold(stub, "a", "g").read()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    ev.cancel()


async def test_no_hold_stream_at_all_expires_and_snapshot_is_deferred(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g", lease_ms=LEASE_MS)
    assert (await ev.wait_for(K.KIND_YIELDED, job="a")).detail == "lease expired"
    assert await holder(stub) == ""
    # It stays resident like after any yield: its re-acquire costs nothing.
    again = await acquire(stub, "a", "g")
    assert not again.context_restored
    ev.cancel()


async def test_reopened_hold_stream_keeps_the_lock(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    granted = await acquire(stub, "a", "g", lease_ms=LEASE_MS)
    first = hold(stub, "a", "g", granted.grant_epoch)
    await first.read()
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    first.cancel()  # a network blip...
    second = hold(stub, "a", "g", granted.grant_epoch)  # ...and the client reconnects
    await second.read()
    await keepalives(second, 5)  # well past the lease
    assert await holder(stub) == "a" and not b_task.done()
    await yield_(stub, "a", "g")
    final = await asyncio.wait_for(second.read(), 10)
    assert final.released and not final.lost
    assert await second.read() is grpc.aio.EOF
    await asyncio.wait_for(b_task, 10)
    assert "lease expired" not in [e.detail for e in ev.seen]
    ev.cancel()


async def test_lease_zero_never_expires(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    # Disjoint nodes: the two groups are held at the same time.
    await cluster.start_orchestrator(groups={"g": ["node-a"], "clock": ["node-b"]})
    stub = cluster.stub()
    small = 1 << 30
    await acquire(stub, "a", "g", footprint_bytes=small)  # lease_ms 0: the llm-d behaviour
    ev = await Events.open(stub, "")
    # A leased holder of another group is the clock: its lease ran out meanwhile.
    await acquire(stub, "c", "clock", lease_ms=LEASE_MS, footprint_bytes=small)
    assert (await ev.wait_for(K.KIND_YIELDED, job="c")).detail == "lease expired"
    assert await holder(stub, "g") == "a"
    assert [e for e in ev.seen if e.job_id == "a" and e.kind == K.KIND_YIELDED] == []
    ev.cancel()


async def test_hold_is_refused_unless_the_job_holds_the_group(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    granted = await acquire(stub, "a", "g", lease_ms=10_000)

    async def code(job: str, group: str, epoch: int = 0) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await hold(stub, job, group, epoch).read()
        return info.value.code()

    assert await code("b", "g") == grpc.StatusCode.FAILED_PRECONDITION
    assert await code("a", "g", granted.grant_epoch + 1) == grpc.StatusCode.FAILED_PRECONDITION
    assert await code("a", "nope") == grpc.StatusCode.NOT_FOUND
    assert await code("bad id!", "g") == grpc.StatusCode.INVALID_ARGUMENT
    assert await code("a", "g", -1) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await acquire(stub, "b", "g", lease_ms=-1)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await hold(stub, "b", "g").read()
    assert "does not hold group 'g'" in (info.value.details() or "")
    # The holder itself is served, with the current epoch or 0.
    call = hold(stub, "a", "g")
    assert (await call.read()).lease_ms == 10_000
    call.cancel()


async def test_restart_gives_the_holder_its_lease_to_reopen(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    granted = await acquire(stub, "a", "g", lease_ms=LEASE_MS)
    call = hold(stub, "a", "g", granted.grant_epoch)
    await call.read()
    await cluster.restart_orchestrator()
    assert await call.code() == grpc.StatusCode.UNAVAILABLE  # the client reconnects
    stub = cluster.stub()
    again = hold(stub, "a", "g", granted.grant_epoch)  # reopened in time: kept
    await again.read()
    await keepalives(again, 5)
    assert await holder(stub) == "a"
    again.cancel()
    # Restarted once more with no Hold stream: the lease runs out after the restart.
    await cluster.restart_orchestrator()
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    b = await asyncio.wait_for(acquire(stub, "b", "g"), 10)
    assert b.grant_epoch == granted.grant_epoch + 1
    assert (await ev.wait_for(K.KIND_YIELDED, job="a")).detail == "lease expired"
    ev.cancel()


async def test_a_lease_below_the_floor_is_refused_on_every_path_that_takes_one(
    cluster: Cluster,
) -> None:
    """lease_ms=1 was accepted and lapsed before any client could open its Hold stream."""
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    too_short = validation.MIN_LEASE_MS - 1

    def refused(err: grpc.aio.AioRpcError) -> None:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert f"at least {validation.MIN_LEASE_MS} ms" in (err.details() or "")

    for lease_ms in (1, too_short):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await acquire(stub, "a", "g", lease_ms=lease_ms)
        refused(info.value)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AcquireSet(
                opb.AcquireSetRequest(job_id="a", group_ids=["g", "h"], lease_ms=lease_ms)
            )
        refused(info.value)

    async def one(request: opb.SessionRequest) -> opb.SessionResponse:
        async def outgoing():  # type: ignore[no-untyped-def]
            yield request

        reply: opb.SessionResponse = await stub.Session(outgoing()).read()
        return reply

    for kind in ("acquire", "acquire_set"):
        if kind == "acquire":
            call = opb.SessionRequest(
                request_id=1, acquire=opb.AcquireRequest(job_id="a", group_id="g", lease_ms=1)
            )
        else:
            call = opb.SessionRequest(
                request_id=1,
                acquire_set=opb.AcquireSetRequest(job_id="a", group_ids=["g"], lease_ms=1),
            )
        reply = await one(call)
        assert reply.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
        assert f"at least {validation.MIN_LEASE_MS} ms" in reply.status_message
    # The refusals created nothing (local mode: not even the group); the floor is taken.
    assert list((await stub.ListGroups(opb.ListGroupsRequest())).group_ids) == []
    granted = await acquire(stub, "a", "g", lease_ms=validation.MIN_LEASE_MS)
    assert granted.success
    await yield_(stub, "a", "g")
