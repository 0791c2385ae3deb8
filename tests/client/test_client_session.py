"""AsyncClient's Acquire and Yield over the orchestrator's Session stream (real servers)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

import tslice
from tests.orchestrator.orch_harness import Cluster, Events, free_port, one_node
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import errors
from tslice.orchestrator import server as orch_server
from tslice.rpc import multiplex

K = opb.OrchestratorEvent


class CountingServicer(orch_server.OrchestratorServicer):
    """The orchestrator's servicer, counting unary calls and Session streams."""

    calls: collections.Counter[str] = collections.Counter()

    async def Acquire(self, request: Any, context: Any) -> Any:
        self.calls["Acquire"] += 1
        return await super().Acquire(request, context)

    async def Yield(self, request: Any, context: Any) -> Any:
        self.calls["Yield"] += 1
        return await super().Yield(request, context)

    async def Session(self, request_iterator: Any, context: Any) -> Any:
        self.calls["Session"] += 1
        async for reply in super().Session(request_iterator, context):
            yield reply


@pytest.fixture
async def cluster(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Cluster]:
    monkeypatch.setattr(orch_server, "OrchestratorServicer", CountingServicer)
    CountingServicer.calls.clear()
    async with one_node(tmp_path) as c:
        yield c


async def test_acquire_and_yield_share_one_session_stream(cluster: Cluster) -> None:
    ev = await Events.open(cluster.stub(), "g")
    async with (
        tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a,
        tslice.AsyncClient(cluster.orch_address, job_id="b", lease_s=None) as b,
    ):
        first = await a.acquire("g")
        assert first.success and first.grant_epoch == 1
        waiting = asyncio.ensure_future(b.acquire("g"))
        await ev.wait_for(K.KIND_QUEUED, job="b")
        released = await a.yield_("g")
        assert released.success and released.pending_waiters == 1
        second = await waiting
        assert second.success and second.grant_epoch == 2
        assert (await b.yield_("g")).snapshot_deferred
    # One stream per client, and no unary Acquire or Yield at all.
    assert CountingServicer.calls == {"Session": 2}, CountingServicer.calls
    ev.cancel()


async def test_refusals_come_back_as_the_unary_errors(cluster: Cluster) -> None:
    async with tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a:
        with pytest.raises(errors.InvalidArgument, match="group_id 'no group' is malformed"):
            await a.acquire("no group")
        # The stream survived the refusal.
        assert (await a.acquire("g")).success
        async with tslice.AsyncClient(cluster.orch_address, job_id="b", lease_s=None) as b:
            with pytest.raises(errors.NotFound):
                await b.yield_("never-created")
        await a.yield_("g")
    assert CountingServicer.calls["Acquire"] == 0


async def test_a_cancelled_or_timed_out_acquire_leaves_the_queue(cluster: Cluster) -> None:
    ev = await Events.open(cluster.stub(), "g")
    async with (
        tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a,
        tslice.AsyncClient(cluster.orch_address, job_id="b", lease_s=None) as b,
    ):
        await a.acquire("g")
        waiting = asyncio.ensure_future(b.acquire("g"))
        await ev.wait_for(K.KIND_QUEUED, job="b")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await ev.wait_for(K.KIND_CANCELLED, job="b")
        with pytest.raises(errors.AcquireTimeout):
            await b.acquire("g", timeout=0.2)
        cancelled = [e for e in ev.seen if e.kind == K.KIND_CANCELLED and e.job_id == "b"]
        if len(cancelled) < 2:
            await ev.wait_for(K.KIND_CANCELLED, job="b")  # the second departure
        status = await a.status("g")
        assert status.waiting_jobs == () and status.locking_job == "a"
        # The group goes to nobody (no ghost waiter), so a's yield defers the snapshot.
        assert (await a.yield_("g")).snapshot_deferred
    ev.cancel()


async def test_a_call_cancelled_while_its_request_is_written_leaves_the_stream_usable(
    cluster: Cluster,
) -> None:
    """gRPC cancels the whole stream when a write on it is cancelled: a call abandoned at
    that moment (a cancelled task, as asyncio.wait_for makes) must not leave its client's
    next calls on a dead stream, each waiting out its deadline with no reply (a chaos run
    saw Yields time out so, and the groups they should have freed wedged)."""
    async with (
        tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a,
        tslice.AsyncClient(cluster.orch_address, job_id="b", lease_s=None) as b,
    ):
        for steps in range(12):  # cancelled after 0..11 turns of the loop: mid-write too
            await a.acquire("g", timeout=10)  # b's acquire waits: only the cancel ends it
            waiting = asyncio.ensure_future(b.acquire("g"))
            for _ in range(steps):
                await asyncio.sleep(0)
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await a.yield_("g", timeout=10)
            # b's next calls are answered (before: each waited out its deadline).
            assert (await b.acquire("g", timeout=10)).success, steps
            assert (await b.yield_("g", timeout=10)).success, steps


class Either:
    """``tslice.Client`` or ``tslice.AsyncClient``, awaited alike (sync calls in a thread)."""

    def __init__(self, kind: str, address: str, job: str) -> None:
        self.sync = kind == "sync"
        self.client: Any = (tslice.Client if self.sync else tslice.AsyncClient)(
            address, job_id=job, lease_s=None
        )

    async def call(self, method: str, *args: Any) -> Any:
        bound = getattr(self.client, method)
        return await (asyncio.to_thread(bound, *args) if self.sync else bound(*args))

    async def close(self) -> None:
        await (asyncio.to_thread(self.client.close) if self.sync else self.client.close())


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_session_broken_by_an_orchestrator_restart_is_reopened(
    cluster: Cluster, kind: str
) -> None:
    await cluster.stop_orchestrator()
    await cluster.start_orchestrator(port=free_port())  # restarts keep this port
    a = Either(kind, cluster.orch_address, "a")
    try:
        assert (await a.call("acquire", "g")).success
        await cluster.restart_orchestrator()
        # The old stream is gone: the next calls retry on a new one, transparently.
        assert (await a.call("yield_", "g")).success
        assert (await a.call("acquire", "g")).success
        await a.call("yield_", "g")
    finally:
        await a.close()
    assert CountingServicer.calls["Session"] == 2 and CountingServicer.calls["Acquire"] == 0


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_an_orchestrator_without_session_gets_unary_calls(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    async def no_session(self: Any, request_iterator: Any, context: Any) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    monkeypatch.setattr(CountingServicer, "Session", no_session)
    await cluster.restart_orchestrator()
    a = Either(kind, cluster.orch_address, "a")
    try:
        assert (await a.call("acquire", "g")).success
        assert (await a.call("yield_", "g")).success
        assert (await a.call("acquire", "g")).success
    finally:
        await a.close()
    assert CountingServicer.calls["Acquire"] == 2 and CountingServicer.calls["Yield"] == 1


# ---- the sync Client: the same stream, read by a thread ---------------------------------


async def test_sync_client_uses_one_session_stream_too(cluster: Cluster) -> None:
    ev = await Events.open(cluster.stub(), "g")
    with (
        tslice.Client(cluster.orch_address, job_id="a", lease_s=None) as a,
        tslice.Client(cluster.orch_address, job_id="b", lease_s=None) as b,
    ):
        assert (await asyncio.to_thread(a.acquire, "g")).grant_epoch == 1
        waiting = asyncio.ensure_future(asyncio.to_thread(b.acquire, "g"))
        await ev.wait_for(K.KIND_QUEUED, job="b")
        assert (await asyncio.to_thread(a.yield_, "g")).pending_waiters == 1
        assert (await waiting).grant_epoch == 2
        with pytest.raises(errors.InvalidArgument, match="malformed"):
            await asyncio.to_thread(b.acquire, "no group")
        # A timed-out acquire sends its cancel: a leaves the queue at once.
        with pytest.raises(errors.AcquireTimeout):
            await asyncio.to_thread(a.acquire, "g", timeout=0.2)
        await ev.wait_for(K.KIND_CANCELLED, job="a")
        assert (await asyncio.to_thread(b.status, "g")).waiting_jobs == ()
        assert (await asyncio.to_thread(b.yield_, "g")).snapshot_deferred
    assert CountingServicer.calls == {"Session": 2}, CountingServicer.calls
    ev.cancel()


async def test_open_streams_do_not_hold_a_shutdown(cluster: Cluster) -> None:
    """Session and GrantStream calls live as long as their clients: stopping a server ends
    them at once instead of waiting out the grace period (here far longer than the bound)."""
    await cluster.stop_orchestrator()
    await cluster.stop_agent("node-a")
    await cluster.start_agent("node-a", grace_period_s=300.0)
    await cluster.start_orchestrator(shutdown_grace_s=300.0)
    async with (
        tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a,
        tslice.AsyncClient(cluster.orch_address, job_id="b", lease_s=None) as b,
    ):
        await a.acquire("g")  # a Session stream, and a GrantStream to node-a
        # The agent stops while the orchestrator's GrantStream to it is open...
        agent = cluster.agents["node-a"]
        await asyncio.wait_for(cluster.stop_agent("node-a"), 30)
        assert agent.task.done()
        # ... and the orchestrator while b waits on its Session stream.
        ev = await Events.open(cluster.stub(), "g")
        waiting = asyncio.ensure_future(b.acquire("g", timeout=60))
        await ev.wait_for(K.KIND_QUEUED, job="b")
        ev.cancel()
        await asyncio.wait_for(cluster.stop_orchestrator(), 30)
        waiting.cancel()  # it was retrying against the stopped orchestrator
        await asyncio.wait({waiting})
        assert waiting.cancelled()


async def test_a_failing_request_is_answered_not_left_hanging(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(self: Any, request: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(CountingServicer, "acquire", broken)
    async with tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a:
        with pytest.raises(errors.RPCError, match="RuntimeError: a bug") as caught:
            await asyncio.wait_for(a.acquire("g"), 30)
        assert caught.value.status == grpc.StatusCode.INTERNAL
        monkeypatch.undo()  # the bug is fixed; the same stream carries on
        assert (await a.acquire("g")).success
    assert CountingServicer.calls == {"Session": 1}


async def test_an_acquire_carries_its_timeout_and_a_negative_one_is_refused(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[int] = []
    servicer_acquire = CountingServicer.acquire

    async def recording(self: Any, request: Any, **kwargs: Any) -> Any:
        sent.append(request.timeout_ms)
        return await servicer_acquire(self, request, **kwargs)

    monkeypatch.setattr(CountingServicer, "acquire", recording)
    async with tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a:
        await a.acquire("g", timeout=30)
        await a.yield_("g")
        await a.acquire("g", timeout=None)
        await a.yield_("g")
    assert len(sent) == 2 and 0 < sent[0] <= 30_000 and sent[1] == 0, sent
    negative = opb.AcquireRequest(job_id="a", group_id="g", timeout_ms=-1)
    call = cluster.stub().Session(iter([opb.SessionRequest(request_id=1, acquire=negative)]))
    reply = await call.read()
    call.cancel()
    assert reply.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
    assert "timeout_ms must be >= 0" in reply.status_message, reply


# ---- multiplex.Pending: the bookkeeping both callers share ---------------------------------


def test_pending_routes_replies_by_id_and_fails_the_rest_when_the_stream_breaks() -> None:
    pending: multiplex.Pending[opb.SessionResponse] = multiplex.Pending(
        reply_id=lambda r: r.request_id, name="the orchestrator"
    )
    first, second = concurrent.futures.Future(), concurrent.futures.Future()
    one, two = pending.add(first), pending.add(second)
    assert (one, two) == (1, 2) and pending.supported is None
    pending.deliver(opb.SessionResponse(request_id=two))
    pending.deliver(opb.SessionResponse(request_id=99))  # abandoned meanwhile: dropped
    assert second.result(0).request_id == 2 and pending.supported is True
    pending.ended(grpc.StatusCode.UNAVAILABLE, "restart")
    with pytest.raises(multiplex.Broken, match="UNAVAILABLE: restart"):
        first.result(0)
    assert pending.supported is True  # it worked once: worth re-opening


def test_pending_gives_up_on_a_stream_that_never_worked() -> None:
    pending: multiplex.Pending[opb.SessionResponse] = multiplex.Pending(
        reply_id=lambda r: r.request_id, name="the orchestrator"
    )
    waiting: concurrent.futures.Future[opb.SessionResponse] = concurrent.futures.Future()
    pending.add(waiting)
    pending.ended(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    with pytest.raises(multiplex.Unsupported):
        waiting.result(0)
    assert pending.supported is False
    with pytest.raises(multiplex.Unsupported):
        pending.add(concurrent.futures.Future())
