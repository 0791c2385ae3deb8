"""Client failover: a list of orchestrator addresses, and a follower's redirect followed.

A real orchestrator and a sim agent run on loopback (``Servers``); in front of them a
stand-in follower (a tiny grpc.aio server) answers every orchestrator call as an HA
follower does: UNAVAILABLE with the leader's address in the ``x-tslice-leader`` trailer,
on a stream only after reading the first request (an Acquire in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

import tslice
from tests.client.servers import QUEUED, Servers, wait_for_event, watching
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _address, _config, _failover
from tslice.common import errors

_SERVICE = opb.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"]


class Follower(grpc.GenericRpcHandler):
    """Refuses every orchestrator call, naming ``leader``; counts what it refused."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.refused: list[str] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        name = str(details.method).rsplit("/", 1)[-1]
        method = _SERVICE.methods_by_name.get(name)
        if method is None:
            return None
        trailers = ((_failover.LEADER_METADATA_KEY, self.leader),)

        async def refuse(context: Any) -> None:
            self.refused.append(name)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "a follower", trailers)

        async def unary(request: Any, context: Any) -> None:
            await refuse(context)

        async def stream(requests: Any, context: Any) -> Any:
            async for _first in requests:  # the Acquire is on its way: then refuse
                break
            await refuse(context)
            yield  # pragma: no cover

        async def server_stream(request: Any, context: Any) -> Any:
            await refuse(context)
            yield  # pragma: no cover

        if method.client_streaming:
            return grpc.stream_stream_rpc_method_handler(stream)
        if method.server_streaming:
            return grpc.unary_stream_rpc_method_handler(server_stream)
        return grpc.unary_unary_rpc_method_handler(unary)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    cluster = Servers(tmp_path_factory.mktemp("failover"))
    try:
        cluster.start_agent("node-a")
        cluster.start_orchestrator()
        yield cluster
    finally:
        cluster.close()


@contextlib.contextmanager
def _following(servers: Servers, leader: str) -> Iterator[tuple[str, Follower]]:
    """A stand-in follower on the servers' loop, naming ``leader``."""
    handler = Follower(leader)

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), servers.loop).result(10)
    try:
        yield f"127.0.0.1:{port}", handler
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), servers.loop).result(10)


@pytest.fixture(scope="module")
def follower(servers: Servers) -> Iterator[tuple[str, Follower]]:
    with _following(servers, servers.orchestrator) as running:
        yield running


@pytest.fixture
def executor() -> Iterator[futures.ThreadPoolExecutor]:
    with futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def _dead_address() -> str:
    """A loopback port where nothing listens (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_the_redirect_trailer_is_pinned() -> None:
    # The HA followers' side of the wire: the client may not import the orchestrator's.
    from tslice.orchestrator.kube import leadership

    assert _failover.LEADER_METADATA_KEY == leadership.LEADER_METADATA_KEY == "x-tslice-leader"


def test_addresses_as_a_list_or_comma_separated(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tslice.Client(address=["a", "b:2"], job_id="j").config
    assert (config.address, config.addresses) == ("a:50051,b:2", ("a:50051", "b:2"))
    monkeypatch.setenv("TSLICE_ORCHESTRATOR", " a:1 , [::1] ")
    assert tslice.Client(job_id="j").config.addresses == ("a:1", "[::1]:50051")
    with pytest.raises(errors.ConfigError, match=r"\$TSLICE_ORCHESTRATOR\[1\] is empty"):
        _config.resolve(
            address=None, job_id="j", default_group=None, timeout=None, call_timeout=1,
            footprint_bytes=None, retry=tslice.RetryPolicy(), channel_options=None,
            environ={"TSLICE_ORCHESTRATOR": "a:1,"},
        )  # fmt: skip
    with pytest.raises(errors.ConfigError, match="cannot be in a list"):
        _address.grpc_targets(["a:1", "unix:/s"], default_port=1, source="address")


def test_sync_client_follows_the_redirect_with_an_acquire_in_flight(
    servers: Servers, follower: tuple[str, Follower], executor: futures.ThreadPoolExecutor
) -> None:
    address, stand_in = follower
    with (
        tslice.Client(servers.orchestrator, job_id="job-a", default_group="trainer") as a,
        tslice.Client(address, job_id="job-b", default_group="trainer") as b,
    ):
        assert a.acquire().success
        with watching(servers.orchestrator, "trainer") as events:
            # job-b's Acquire reaches the follower first, which refuses it mid-stream.
            waiting = executor.submit(b.acquire)
            wait_for_event(events, QUEUED, "job-b")
        assert "Session" in stand_in.refused
        status = a.status()
        assert (status.locking_job, status.waiter_queue_depth) == ("job-a", 1)  # queued once
        a.yield_()
        assert waiting.result(30).success
        assert b.status().locking_job == "job-b"
        b.yield_()
    # A call of a method never retried (Drain) is re-issued too: the follower ran nothing.
    with tslice.Client(address, job_id="admin", default_group="trainer") as admin:
        refused = len(stand_in.refused)
        assert admin.drain().draining
        assert stand_in.refused[refused:] == ["Drain"]
        assert not admin.resume().draining


async def test_async_client_skips_a_dead_address_and_follows_a_redirect(
    servers: Servers, follower: tuple[str, Follower], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, _ = follower
    async with tslice.AsyncClient(
        [_dead_address(), servers.orchestrator], job_id="job-c", default_group="other"
    ) as client:
        assert (await client.acquire()).success
        assert (await client.status()).locking_job == "job-c"
        await client.yield_()
    monkeypatch.setenv("TSLICE_ORCHESTRATOR", f"{_dead_address()},{address}")
    async with tslice.AsyncClient(job_id="job-d", default_group="other") as client:
        assert (await client.acquire()).success
        assert "other" in await client.list_groups()
        await client.yield_()


async def test_no_address_answering_fails_naming_them_all() -> None:
    dead = [_dead_address(), _dead_address()]
    async with tslice.AsyncClient(dead, job_id="job-e", connect_timeout=1.0) as client:
        with pytest.raises(tslice.Unavailable, match="failed to connect to the orchestrator at"):
            await client.list_groups()
        assert ",".join(dead) in str(client.address)


def test_followers_naming_each_other_end_in_unavailable(servers: Servers) -> None:
    with _following(servers, "") as (one, first), _following(servers, one) as (two, second):
        first.leader = two  # a loop: each says the other leads
        with (
            tslice.Client(two, job_id="admin", default_group="trainer") as admin,
            pytest.raises(tslice.Unavailable, match="a follower"),
        ):
            admin.drain()  # never retried: refused once the redirects are spent
        assert len(first.refused) + len(second.refused) == _failover.MAX_REDIRECTS + 1


class _Refusal(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, leader: str | None = None) -> None:
        self._code = code
        self._trailers = () if leader is None else ((_failover.LEADER_METADATA_KEY, leader),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def trailing_metadata(self) -> Any:
        return self._trailers


def test_targets_move_on_once_and_follow_only_wellformed_redirects() -> None:
    targets = _failover.Targets(["a:1", "b:2", "c:3"])
    down = _Refusal(grpc.StatusCode.UNAVAILABLE)
    assert not targets.after_error("a:1", down)
    assert not targets.after_error("a:1", down)  # a second call that failed on a:1 too
    assert targets.current == "b:2"
    assert not targets.after_error("b:2", _Refusal(grpc.StatusCode.NOT_FOUND))
    assert targets.current == "b:2"
    # A malformed or empty trailer is no redirect: on to the next address.
    assert not targets.after_error("b:2", _Refusal(grpc.StatusCode.UNAVAILABLE, "http://x:1"))
    assert targets.current == "c:3"
    assert not targets.after_error("c:3", _Refusal(grpc.StatusCode.UNAVAILABLE, ""))
    assert targets.current == "a:1"
    assert targets.after_error("a:1", _Refusal(grpc.StatusCode.UNAVAILABLE, "leader"))
    assert targets.current == "leader:50051"
    assert not targets.after_error("leader:50051", down)
    assert targets.current == "a:1"  # the learnt address is one of the list now
