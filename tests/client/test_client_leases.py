"""Client side of holder leases against a real in-process orchestrator and agent.

A TCP proxy between client and orchestrator simulates a network cut long enough for
the lease to run out; the client then learns the loss from its Hold stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
from collections.abc import AsyncIterator

import grpc
import httpx
import pytest

import tslice
from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, one_node
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _lease
from tslice.client.compat import TimeSliceOrchestratorClient

K = opb.OrchestratorEvent


class Proxy:
    """Forwards TCP connections to ``target``; :meth:`cut` drops them all and refuses new ones."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()
        self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        dst.transport.abort()
        self._writers.discard(dst)


@pytest.fixture
async def cluster(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    async with one_node(tmp_path) as c:
        yield c


async def lease_of(cluster: Cluster, job: str, group: str = "g") -> int:
    """The lease the orchestrator keeps for ``job`` (from a Hold stream's first event)."""
    call = cluster.stub().Hold(opb.HoldRequest(job_id=job, group_id=group))
    try:
        return int((await call.read()).lease_ms)
    finally:
        call.cancel()


async def test_async_client_sends_its_lease_and_yield_ends_the_hold(cluster: Cluster) -> None:
    # A lease a stalled runner cannot outlast (0.3 s once ran out before lease_of's Hold).
    async with tslice.AsyncClient(cluster.orch_address, job_id="j", lease_s=3.0) as client:
        assert client.lease_s == 3.0
        ev = await Events.open(cluster.stub(), "g")
        await client.acquire("g")
        assert await lease_of(cluster, "j") == 3000
        keeper = client._keepers[("j", "g")]
        result = await client.yield_("g")
        assert result.success and ("j", "g") not in client._keepers
        assert keeper.done
        await ev.wait_for(K.KIND_YIELDED, job="j")
        assert "lease expired" not in [e.detail for e in ev.seen]
        ev.cancel()


async def test_lost_lease_is_reported_and_its_yield_succeeds(cluster: Cluster) -> None:
    proxy = Proxy(cluster.orch_address)
    await proxy.start()
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    async with tslice.AsyncClient(proxy.address, job_id="j", lease_s=0.3) as client:
        await client.acquire("g")
        keeper = client._keepers[("j", "g")]
        await proxy.cut()  # longer than the lease: the orchestrator releases the group
        assert (await ev.wait_for(K.KIND_YIELDED, job="j")).detail == "lease expired"
        await acquire(stub, "other", "g")  # somebody else holds it now
        await proxy.start()  # the network is back: the Hold stream is refused
        await asyncio.wait_for(keeper.wait(), 10)
        lost = client.lost_leases
        assert list(lost) == ["g"] and "does not hold group 'g'" in lost["g"]
        # Yield of the lost group: success, although 'other' holds it (no PERMISSION_DENIED).
        assert (await client.yield_("g")).success
        assert client.lost_leases == lost  # stays visible until the group is acquired again
        await stub.Yield(opb.YieldRequest(job_id="other", group_id="g"))
        await client.acquire("g")
        assert client.lost_leases == {}
        await client.yield_("g")
    ev.cancel()
    await proxy.cut()


async def hold_streams_opened(port: int) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    prefix = 'tslice_orchestrator_hold_streams_opened_total{group_id="g"} '
    values = [
        float(line.removeprefix(prefix)) for line in text.splitlines() if line.startswith(prefix)
    ]
    return values[0] if values else 0.0


async def test_a_slice_shorter_than_a_quarter_lease_opens_no_hold_stream(
    cluster: Cluster,
) -> None:
    await cluster.stop_orchestrator()
    port = free_port()
    await cluster.start_orchestrator(metrics_port=port)
    # lease 60 s: the keeper would open its stream 15 s after the grant.
    async with tslice.AsyncClient(cluster.orch_address, job_id="j", lease_s=60) as client:
        for _ in range(3):
            await client.acquire("g")
            assert (await client.yield_("g")).success
    with tslice.Client(cluster.orch_address, job_id="k", lease_s=60) as sync_client:
        await asyncio.to_thread(sync_client.acquire, "g")
        assert (await asyncio.to_thread(sync_client.yield_, "g")).success
        # Nor a thread: the keeper's thread starts only when its stream is due.
        assert not [t for t in threading.enumerate() if t.name.startswith("tslice-hold:")]
    assert await hold_streams_opened(port) == 0
    # A slice that outlasts a quarter of its lease does open one (and keeps the group). The
    # lease leaves a stalled runner 0.75 s to open it (0.2 s left it 0.15 s, and it lost).
    async with tslice.AsyncClient(cluster.orch_address, job_id="j", lease_s=1.0) as client:
        await client.acquire("g")
        keeper = client._keepers[("j", "g")]
        await asyncio.sleep(3.0)  # the subject: time passing, three leases long
        assert await hold_streams_opened(port) == 1 and not keeper.done
        assert (await client.status("g")).locking_job == "j" and client.lost_leases == {}
        assert (await client.yield_("g")).success


async def test_a_loss_while_yielding_is_held_back_and_reported_if_the_yield_fails(
    cluster: Cluster,
) -> None:
    stub = cluster.stub()
    async with tslice.AsyncClient(cluster.orch_address, job_id="j", lease_s=0.2) as client:
        await client.acquire("g")
        keeper = client._keepers[("j", "g")]
        keeper.releasing()  # as yield_ does before its Yield RPC
        # The Yield reaches the orchestrator before the keeper's (delayed) Hold stream:
        # that stream is refused, which is no loss for a job giving the group up.
        await stub.Yield(opb.YieldRequest(job_id="j", group_id="g"))
        await asyncio.wait_for(keeper.wait(), 10)
        assert client.lost_leases == {}
        keeper.resume()  # had the Yield failed, the loss is reported after all
        assert "does not hold group 'g'" in client.lost_leases["g"]


async def test_no_lease_and_the_llm_d_client_send_lease_zero(cluster: Cluster) -> None:
    async with tslice.AsyncClient(cluster.orch_address, job_id="j", lease_s=None) as client:
        assert client.lease_s is None
        await client.acquire("g")
        assert await lease_of(cluster, "j") == 0 and client._keepers == {}
        await client.yield_("g")
    compat = TimeSliceOrchestratorClient(cluster.orch_address)
    try:
        assert compat.client.lease_s is None
    finally:
        compat.client.close()


def test_lease_must_be_positive_or_none() -> None:
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="lease_s must be > 0"):
            tslice.Client("127.0.0.1:1", job_id="j", lease_s=bad)


def test_a_lease_below_the_servers_floor_is_refused_before_any_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match=r"lease_s=0.001 is shorter than .* floor of 0.1 s"):
        tslice.Client("127.0.0.1:1", job_id="j", lease_s=0.001)
    assert tslice.Client("127.0.0.1:1", job_id="j", lease_s=0.1).lease_s == 0.1
    monkeypatch.setenv("TSLICE_LEASE_S", "0.05")
    with pytest.raises(tslice.ConfigError, match=r"TSLICE_LEASE_S=0.05 is shorter"):
        tslice.Client("127.0.0.1:1", job_id="j")


def test_noop_client_keeps_no_lease() -> None:
    client = tslice.Client(job_id="j", lease_s=5.0)
    assert not client.enabled
    assert client.acquire("g").success and client._keepers == {}
    assert client.yield_("g").success and client.lost_leases == {}


def test_lease_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TSLICE_LEASE_S", "12.5")
    assert tslice.Client("127.0.0.1:1", job_id="j").lease_s == 12.5
    assert tslice.Client("127.0.0.1:1", job_id="j", lease_s=3).lease_s == 3  # argument wins
    assert tslice.Client("127.0.0.1:1", job_id="j", lease_s=None).lease_s is None
    for no_lease in ("none", "OFF", "0"):
        monkeypatch.setenv("TSLICE_LEASE_S", no_lease)
        assert tslice.Client("127.0.0.1:1", job_id="j").lease_s is None
    for bad in ("soon", "-5", "inf", "nan"):
        monkeypatch.setenv("TSLICE_LEASE_S", bad)
        with pytest.raises(tslice.ConfigError, match=r"TSLICE_LEASE_S=.* is not understood"):
            tslice.Client("127.0.0.1:1", job_id="j")
    monkeypatch.delenv("TSLICE_LEASE_S")
    assert tslice.Client("127.0.0.1:1", job_id="j").lease_s == 30.0


# ---- LeaseFlow: the keepers' decisions, without I/O ------------------------------------


def test_flow_reopens_with_growing_capped_back_off_reset_by_an_event() -> None:
    flow = _lease.LeaseFlow(lease_ms=30_000)
    assert flow.open_delay == 7.5
    delays = [flow.on_error(grpc.StatusCode.UNAVAILABLE, "down").reopen_in for _ in range(7)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert flow.on_event(released=False, lost="") is None  # a keep-alive event: read on
    assert flow.on_end().reopen_in == 0.05  # the server went away: again from the start


def test_flow_back_off_stays_well_within_a_short_lease() -> None:
    flow = _lease.LeaseFlow(lease_ms=200)
    assert [flow.on_end().reopen_in for _ in range(3)] == [0.04, 0.04, 0.04]


@pytest.mark.parametrize("code", [grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND])
def test_flow_reports_a_lost_lease_once_and_stops(code: grpc.StatusCode) -> None:
    flow = _lease.LeaseFlow(lease_ms=1000)
    assert flow.on_error(code, "job j does not hold group g") == _lease.Step(
        reopen_in=None, report="job j does not hold group g"
    )
    lost = _lease.LeaseFlow(lease_ms=1000).on_event(released=False, lost="lease expired")
    assert lost == _lease.Step(reopen_in=None, report="lease expired")


def test_flow_ends_quietly_on_release_on_stop_and_without_the_rpc() -> None:
    flow = _lease.LeaseFlow(lease_ms=1000)
    assert flow.on_event(released=True, lost="") is _lease.DONE
    unimplemented = flow.on_error(grpc.StatusCode.UNIMPLEMENTED, "")
    assert unimplemented.reopen_in is None and unimplemented.report is None
    assert unimplemented.note is not None and "no Hold RPC" in unimplemented.note
    flow.stop()
    assert flow.on_error(grpc.StatusCode.CANCELLED, "") is _lease.DONE
    assert flow.on_error(grpc.StatusCode.FAILED_PRECONDITION, "gone") is _lease.DONE
    assert flow.on_end() is _lease.DONE


def test_flow_holds_a_loss_back_while_yielding() -> None:
    flow = _lease.LeaseFlow(lease_ms=1000)
    flow.releasing()
    assert flow.on_error(grpc.StatusCode.FAILED_PRECONDITION, "not held") is _lease.DONE
    assert flow.resume() == "not held"  # the Yield failed: the loss is real after all
    assert flow.resume() is None  # reported once
    flow.releasing()
    flow.on_event(released=False, lost="lease expired")
    flow.stop()  # the Yield succeeded: the keeper stops, the loss is dropped
    assert flow.resume() is None
