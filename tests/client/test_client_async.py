"""AsyncClient against a real orchestrator (its Session stream, its lock), which runs on
a loop of its own in another thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

import tslice
from tests.client.servers import Orchestrator
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import errors

K = opb.OrchestratorEvent


@pytest.fixture
async def other(orchestrator: Orchestrator) -> AsyncIterator[tslice.AsyncClient]:
    async with tslice.AsyncClient(orchestrator.address, job_id="other", lease_s=None) as client:
        yield client


@contextlib.asynccontextmanager
async def expecting(
    client: tslice.AsyncClient, group: str, kind: tslice.client.EventKind, job: str
) -> AsyncIterator[None]:
    """Around a block that makes ``job`` ``kind`` (QUEUED, CANCELLED) in ``group``: waits
    for that event (subscribed before the block runs: none is missed)."""
    events = client.watch_events(group, kinds=[kind])
    await events.started()
    yield
    async for event in events:
        if event.job_id == job:
            break
    await events.aclose()


QUEUED = tslice.client.EventKind.QUEUED
CANCELLED = tslice.client.EventKind.CANCELLED


async def test_acquire_yield_status(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        assert (await client.acquire("g")).grant_epoch == 1
        status = await client.status("g")
        assert status.locking_job == "me"
        assert await client.list_groups() == ("a", "b", "g")
        assert (await client.yield_("g")).snapshot_deferred
    assert await asyncio.to_thread(orchestrator.holder, "g") == ""
    assert orchestrator.script.sessions == 1


async def test_waiting_acquire_completes_on_yield(
    orchestrator: Orchestrator, other: tslice.AsyncClient
) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as me:
        await other.acquire("g")
        async with expecting(other, "g", QUEUED, "me"):
            pending = asyncio.ensure_future(me.acquire("g"))
        assert (await other.yield_("g")).pending_waiters == 1
        assert (await pending).success


async def test_acquire_timeout(orchestrator: Orchestrator, other: tslice.AsyncClient) -> None:
    await other.acquire("g")
    async with (
        tslice.AsyncClient(orchestrator.address, job_id="me") as client,
        expecting(other, "g", CANCELLED, "me"),
    ):
        with pytest.raises(tslice.AcquireTimeout) as caught:
            await client.acquire("g", timeout=0.2)
    assert caught.value.waited_ms >= 200
    assert (await other.status("g")).waiting_jobs == ()


async def test_cancelling_the_task_removes_the_waiter(
    orchestrator: Orchestrator, other: tslice.AsyncClient
) -> None:
    await other.acquire("g")
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        async with expecting(other, "g", QUEUED, "me"):
            pending = asyncio.ensure_future(client.acquire("g"))
        async with expecting(other, "g", CANCELLED, "me"):
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
        assert (await other.status("g")).waiting_jobs == ()


async def test_status_mapping(orchestrator: Orchestrator) -> None:
    orchestrator.script.fail_next("Acquire", grpc.StatusCode.PERMISSION_DENIED, "no")
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        with pytest.raises(errors.NotHolder) as caught:
            await client.acquire("g")
        assert isinstance(caught.value.__cause__, grpc.RpcError)
        with pytest.raises(errors.UnknownGroup, match="'nope'"):
            await client.acquire("nope")


async def test_acquire_survives_an_orchestrator_restart(
    orchestrator: Orchestrator, other: tslice.AsyncClient
) -> None:
    await other.acquire("g")
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        async with expecting(other, "g", QUEUED, "me"):
            pending = asyncio.ensure_future(client.acquire("g"))
        await asyncio.to_thread(orchestrator.restart)
        # Re-issued on a new stream, its place kept.
        await asyncio.to_thread(orchestrator.until, lambda: orchestrator.waiting("g") == ("me",))
        await other.yield_("g")
        result = await asyncio.wait_for(pending, 30)
    assert result.success
    assert await asyncio.to_thread(orchestrator.holder, "g") == "me"


async def test_slice_order_and_release_on_exception(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        with pytest.raises(ValueError, match="inside"):
            async with client.slice("b", "a") as held:
                assert set(held) == {"a", "b"}
                holders = await asyncio.to_thread(orchestrator.holders)
                assert holders == {"a": "me", "b": "me", "g": ""}
                raise ValueError("inside")
    # One AcquireSet for both, then each yielded, in reverse order.
    assert [(c.method, c.group_id) for c in orchestrator.script.calls_of("AcquireSet")] == [
        ("AcquireSet", "")
    ]
    assert orchestrator.lock_calls() == [("Yield", "b"), ("Yield", "a")]


async def test_cancelled_slice_still_yields(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        inside = asyncio.Event()

        async def work() -> None:
            async with client.slice("a"):
                inside.set()
                await asyncio.Event().wait()

        task = asyncio.ensure_future(work())
        await inside.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await asyncio.to_thread(orchestrator.holder, "a") == ""


async def test_async_decorator_and_nesting(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me", default_group="g") as client:

        @client.sliced("a")
        async def step(x: int) -> int:
            async with client.slice("a"):
                assert (await client.status("a")).locking_job == "me"
            return x + 1

        assert await step(1) == 2
        assert (await client.status("a")).locking_job == ""
        assert orchestrator.lock_calls() == [("Acquire", "a"), ("Yield", "a")]

        def plain() -> None:
            pass

        with pytest.raises(TypeError, match=r"Client\.sliced"):
            client.sliced("a")(plain)  # type: ignore[arg-type]


async def test_watch_events(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        events = client.watch_events("g", kinds=[tslice.client.EventKind.GRANTED])
        await events.started()
        await client.acquire("a")
        await client.acquire("g")
        first = await events.__anext__()
        await events.aclose()
    assert (first.kind.value, first.group_id, first.job_id) == ("GRANTED", "g", "me")


async def test_raw_stub_on_the_aio_channel(orchestrator: Orchestrator) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        response = await client.orchestrator_stub.ListGroups(opb.ListGroupsRequest(), timeout=5)
    assert list(response.group_ids) == ["a", "b", "g"]
