"""AcquireSet against the in-process orchestrator and real sim agents: what the service
itself does (status detail of a reserved group, Session requests, rollback). End to end
on separate processes: tests/integration/test_acquire_set*.py."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

K = opb.OrchestratorEvent
GS = opb.GroupStatus


async def _two_groups(cluster: Cluster, **overrides: object) -> object:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(groups={"g1": ["node-a"], "g2": ["node-b"]}, **overrides)
    return cluster.stub()


async def _metrics(port: int) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"http://127.0.0.1:{port}/metrics")).text


def _acquire_set(stub: object, job: str, *groups: str, **kw: object) -> asyncio.Task[object]:
    request = opb.AcquireSetRequest(job_id=job, group_ids=groups, **kw)  # type: ignore[arg-type]
    return asyncio.ensure_future(stub.AcquireSet(request, timeout=30))  # type: ignore[attr-defined]


async def _status(stub: object, group: str) -> opb.GroupStatus:
    request = opb.GetGroupStatusRequest(group_id=group)
    return (await stub.GetGroupStatus(request)).group  # type: ignore[attr-defined, no-any-return]


async def test_a_free_group_is_kept_for_the_set_and_says_what_it_waits_for(
    cluster: Cluster,
) -> None:
    port = free_port()
    stub = await _two_groups(cluster, metrics_port=port)
    await acquire(stub, "a", "g1")
    await acquire(stub, "b", "g2")
    events = await Events.open(stub, "g1")
    pending = _acquire_set(stub, "c", "g1", "g2")
    await events.wait_for(K.KIND_QUEUED, job="c")
    await yield_(stub, "a", "g1")
    await events.wait_for(K.KIND_YIELDED, job="a")
    # g1 is free, but kept for c: a later single waiter does not pass it.
    late = asyncio.ensure_future(acquire(stub, "d", "g1"))
    await events.wait_for(K.KIND_QUEUED, job="d")
    g1 = await _status(stub, "g1")
    assert g1.locking_job == "" and list(g1.waiting_jobs) == ["c", "d"], g1
    assert "kept free for job 'c'" in g1.detail and "waiting for: g2" in g1.detail, g1.detail
    assert not pending.done() and not late.done()
    assert 'tslice_orchestrator_group_reserved{group_id="g1"} 1.0' in await _metrics(port)
    await yield_(stub, "b", "g2")
    reply = await pending
    assert [(g.group_id, g.grant_epoch) for g in reply.grants] == [("g1", 2), ("g2", 2)]
    assert (await _status(stub, "g1")).detail == ""
    text = await _metrics(port)
    assert 'tslice_orchestrator_group_reserved{group_id="g1"} 0.0' in text
    assert 'tslice_orchestrator_acquire_sets_total{outcome="granted"} 1.0' in text
    assert "tslice_orchestrator_acquire_set_wait_duration_seconds_count 1.0" in text
    await yield_(stub, "c", "g1")
    assert (await late).grant_epoch == 3
    events.cancel()


async def test_a_set_over_a_session_is_granted_and_a_cancelled_one_leaves_every_queue(
    cluster: Cluster,
) -> None:
    stub = await _two_groups(cluster)
    await acquire(stub, "a", "g2")
    requests: asyncio.Queue[opb.SessionRequest | None] = asyncio.Queue()

    async def outgoing():  # type: ignore[no-untyped-def]
        while (request := await requests.get()) is not None:
            yield request

    session = stub.Session(outgoing())  # type: ignore[attr-defined]
    events = await Events.open(stub, "g2")
    other = await Events.open(stub, "g1")
    await requests.put(
        opb.SessionRequest(
            request_id=1, acquire_set=opb.AcquireSetRequest(job_id="c", group_ids=["g2", "g1"])
        )
    )
    await events.wait_for(K.KIND_QUEUED, job="c")
    await requests.put(opb.SessionRequest(request_id=1, cancel=True))
    await events.wait_for(K.KIND_CANCELLED, job="c")
    await other.wait_for(K.KIND_CANCELLED, job="c")
    other.cancel()
    for group in ("g1", "g2"):
        assert list((await _status(stub, group)).waiting_jobs) == [], group
    await yield_(stub, "a", "g2")
    await requests.put(
        opb.SessionRequest(
            request_id=2, acquire_set=opb.AcquireSetRequest(job_id="c", group_ids=["g2", "g1"])
        )
    )
    reply = await session.read()
    assert reply.request_id == 2 and reply.status_code == 0, reply
    assert [g.group_id for g in reply.acquire_set.grants] == ["g2", "g1"]
    assert (await _status(stub, "g1")).locking_job == "c"
    await requests.put(None)
    events.cancel()


async def test_a_set_whose_deadline_passes_leaves_no_group_granted(cluster: Cluster) -> None:
    stub = await _two_groups(cluster)
    await acquire(stub, "b", "g2")
    watched = {group: await Events.open(stub, group) for group in ("g1", "g2")}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.AcquireSet(  # type: ignore[attr-defined]
            opb.AcquireSetRequest(job_id="c", group_ids=["g1", "g2"]), timeout=0.5
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    for events in watched.values():  # the orchestrator learns of the deadline on its own
        await events.wait_for(K.KIND_CANCELLED, job="c")
        events.cancel()
    g1, g2 = await _status(stub, "g1"), await _status(stub, "g2")
    assert g1.locking_job == "" and list(g1.waiting_jobs) == [], g1
    assert g2.locking_job == "b" and list(g2.waiting_jobs) == [], g2
    # g1 was never granted to c (a set is granted whole): the next Acquire is the first.
    assert (await acquire(stub, "d", "g1")).grant_epoch == 1


@pytest.mark.parametrize(
    ("groups", "code", "words"),
    [
        ((), grpc.StatusCode.INVALID_ARGUMENT, "group_ids is empty"),
        (("g1", "g1"), grpc.StatusCode.INVALID_ARGUMENT, "more than once"),
        (tuple(f"g{i}" for i in range(17)), grpc.StatusCode.INVALID_ARGUMENT, "at most 16"),
        (("g1", "nope"), grpc.StatusCode.NOT_FOUND, "'nope' is not in the topology"),
    ],
    ids=["empty", "repeated", "too-many", "unknown"],
)
async def test_a_bad_set_is_refused_and_queues_nothing(
    cluster: Cluster, groups: tuple[str, ...], code: grpc.StatusCode, words: str
) -> None:
    stub = await _two_groups(cluster)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.AcquireSet(opb.AcquireSetRequest(job_id="c", group_ids=groups))  # type: ignore[attr-defined]
    assert err.value.code() == code and words in (err.value.details() or ""), err.value
    assert list((await _status(stub, "g1")).waiting_jobs) == []
    assert (await _status(stub, "g1")).group_state == GS.STATE_IDLE


async def test_a_holder_of_another_group_of_the_set_passes_the_group_kept_for_it(
    cluster: Cluster,
) -> None:
    """k holds g2 and then asks for g1 (a nested acquire: hold and wait), where g1 is kept
    for c's set {g1, g2}: the set waits for k's g2 anyway, so k goes first; kept back, k
    would wait for c's set, which waits for k: a deadlock."""
    stub = await _two_groups(cluster)
    await acquire(stub, "k", "g2")
    events = await Events.open(stub, "g1")
    pending = _acquire_set(stub, "c", "g1", "g2")
    await events.wait_for(K.KIND_QUEUED, job="c")
    assert "kept free for job 'c'" in (await _status(stub, "g1")).detail
    # (The deadline only turns the deadlock into a failure.)
    request = opb.AcquireRequest(job_id="k", group_id="g1")
    nested = await stub.Acquire(request, timeout=15)  # type: ignore[attr-defined]
    assert nested.grant_epoch == 1 and not pending.done()
    await yield_(stub, "k", "g1")
    await yield_(stub, "k", "g2")
    reply = await pending
    assert [(g.group_id, g.grant_epoch) for g in reply.grants] == [("g1", 2), ("g2", 2)]
    events.cancel()


async def test_a_second_pending_set_of_one_job_over_a_shared_group_is_refused(
    cluster: Cluster,
) -> None:
    """It would take the first one's place in each queue and neither would be granted."""
    stub = await _two_groups(cluster)
    await acquire(stub, "b", "g2")
    events = await Events.open(stub, "g2")
    first = _acquire_set(stub, "c", "g1", "g2")
    await events.wait_for(K.KIND_QUEUED, job="c")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _acquire_set(stub, "c", "g2", "g1")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "already waits in an AcquireSet" in (err.value.details() or "")
    await yield_(stub, "b", "g2")
    assert [g.group_id for g in (await first).grants] == ["g1", "g2"]
    # Granted: the same set again is answered at once (the job holds both).
    again = await _acquire_set(stub, "c", "g2", "g1")
    assert [g.grant_epoch for g in again.grants] == [2, 1]
    events.cancel()
