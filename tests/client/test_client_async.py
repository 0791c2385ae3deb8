"""AsyncClient against the same orchestrator double (which runs in its own thread)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

import tslice
from tests.client.client_fakes import FakeOrchestrator, ServerThread
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import errors


def fake(server: ServerThread) -> FakeOrchestrator:
    return server.servicer  # type: ignore[no-any-return]


def holders(server: ServerThread) -> dict[str, str]:
    return server.call(lambda: {name: g.holder for name, g in fake(server).groups.items()})


def sequence(server: ServerThread) -> list[tuple[str, str]]:
    return server.call(
        lambda: [
            (c.method, c.group_id) for c in fake(server).calls if c.method in {"Acquire", "Yield"}
        ]
    )


async def test_acquire_yield_status(orchestrator: ServerThread) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        assert (await client.acquire("g")).grant_epoch == 1
        status = await client.status("g")
        assert status.locking_job == "me"
        assert await client.list_groups() == ("a", "b", "g")
        assert (await client.yield_("g")).snapshot_deferred
    assert holders(orchestrator)["g"] == ""


async def test_waiting_acquire_completes_on_yield(orchestrator: ServerThread) -> None:
    async with (
        tslice.AsyncClient(orchestrator.address, job_id="me") as me,
        tslice.AsyncClient(orchestrator.address, job_id="other") as other,
    ):
        await other.acquire("g")
        pending = asyncio.ensure_future(me.acquire("g"))
        await orchestrator.await_for(lambda f: "me" in f.groups["g"].waiters)
        assert (await other.yield_("g")).pending_waiters == 1
        assert (await pending).success


async def test_acquire_timeout(orchestrator: ServerThread) -> None:
    orchestrator.call(lambda: setattr(fake(orchestrator).groups["g"], "holder", "other"))
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        with pytest.raises(tslice.AcquireTimeout) as caught:
            await client.acquire("g", timeout=0.2)
    assert caught.value.waited_ms >= 200
    await orchestrator.await_for(lambda f: not f.groups["g"].waiters)


async def test_cancelling_the_task_removes_the_waiter(orchestrator: ServerThread) -> None:
    orchestrator.call(lambda: setattr(fake(orchestrator).groups["g"], "holder", "other"))
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        pending = asyncio.ensure_future(client.acquire("g"))
        await orchestrator.await_for(lambda f: "me" in f.groups["g"].waiters)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await orchestrator.await_for(lambda f: not f.groups["g"].waiters)


async def test_status_mapping(orchestrator: ServerThread) -> None:
    orchestrator.call(
        lambda: (
            fake(orchestrator).failures["Acquire"].append((grpc.StatusCode.PERMISSION_DENIED, "no"))
        )
    )
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        with pytest.raises(errors.NotHolder) as caught:
            await client.acquire("g")
        assert isinstance(caught.value.__cause__, grpc.RpcError)
        with pytest.raises(errors.UnknownGroup, match="unknown group 'nope'"):
            await client.acquire("nope")


async def test_acquire_survives_an_orchestrator_restart(orchestrator: ServerThread) -> None:
    orchestrator.call(lambda: setattr(fake(orchestrator).groups["g"], "holder", "other"))
    port = orchestrator.port
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        pending = asyncio.ensure_future(client.acquire("g"))
        await orchestrator.await_for(lambda f: "me" in f.groups["g"].waiters)
        await asyncio.to_thread(orchestrator.stop)
        restarted = FakeOrchestrator()
        await asyncio.to_thread(orchestrator.start, restarted, port=port)
        result = await asyncio.wait_for(pending, 30)
    assert result.success
    assert orchestrator.call(lambda: restarted.groups["g"].holder) == "me"


async def test_slice_order_and_release_on_exception(orchestrator: ServerThread) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        with pytest.raises(ValueError, match="inside"):
            async with client.slice("b", "a") as held:
                assert set(held) == {"a", "b"}
                assert holders(orchestrator) == {"a": "me", "b": "me", "g": ""}
                raise ValueError("inside")
    assert sequence(orchestrator) == [
        ("Acquire", "a"),
        ("Acquire", "b"),
        ("Yield", "b"),
        ("Yield", "a"),
    ]


async def test_cancelled_slice_still_yields(orchestrator: ServerThread) -> None:
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
    assert holders(orchestrator)["a"] == ""


async def test_async_decorator_and_nesting(orchestrator: ServerThread) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me", default_group="g") as client:

        @client.sliced("a")
        async def step(x: int) -> int:
            async with client.slice("a"):
                assert holders(orchestrator)["a"] == "me"
            return x + 1

        assert await step(1) == 2
        assert holders(orchestrator)["a"] == ""
        assert sequence(orchestrator) == [("Acquire", "a"), ("Yield", "a")]

        def plain() -> None:
            pass

        with pytest.raises(TypeError, match=r"Client\.sliced"):
            client.sliced("a")(plain)  # type: ignore[arg-type]


async def test_watch_events(orchestrator: ServerThread) -> None:
    event = opb.OrchestratorEvent(
        kind=opb.OrchestratorEvent.KIND_SWITCH_DONE, group_id="g", duration_ms=12
    )
    orchestrator.call(lambda: fake(orchestrator).events.append(event))
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        seen = [e async for e in client.watch_events("g")]
    assert [(e.kind.value, e.duration_ms) for e in seen] == [("SWITCH_DONE", 12)]


async def test_raw_stub_on_the_aio_channel(orchestrator: ServerThread) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
        response = await client.orchestrator_stub.ListGroups(opb.ListGroupsRequest(), timeout=5)
    assert list(response.group_ids) == ["a", "b", "g"]
