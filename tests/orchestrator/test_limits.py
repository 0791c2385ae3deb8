"""Bounded queues (issue 21 §4): a group's waiters are capped, and a status read of a huge
queue stays under the gRPC message limit, saying how many waiters it left out."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import limits

K = opb.OrchestratorEvent.Kind


async def test_a_group_refuses_waiters_beyond_its_cap_and_lets_a_queued_job_back(
    cluster: Cluster,
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(limits={"max_waiters_per_group": 2})
    stub = cluster.stub()
    assert (await acquire(stub, "holder", "g")).success
    events = await Events.open(stub, "g")
    first = acquire(stub, "w1", "g")
    second = acquire(stub, "w2", "g")
    for job in ("w1", "w2"):
        await events.wait_for(K.KIND_QUEUED, job=job)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await acquire(stub, "w3", "g")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiters_per_group = 2" in refused.value.details(), refused.value.details()
    # A queued job's re-issued Acquire is no new waiter; the holder's neither.
    again = acquire(stub, "w1", "g")
    assert (await acquire(stub, "holder", "g")).success
    await yield_(stub, "holder", "g")
    assert (await first).success and (await again).success
    # Room again: one waits (w2), the cap is 2.
    third = acquire(stub, "w3", "g")
    await events.wait_for(K.KIND_QUEUED, job="w3")
    await yield_(stub, "w1", "g")
    assert (await second).success
    await yield_(stub, "w2", "g")
    assert (await third).success
    events.cancel()


async def test_a_status_read_of_a_huge_queue_lists_the_first_waiters_and_counts_the_rest(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (The orchestrator runs in this process: its list is made short, not its queue long.)
    monkeypatch.setattr(limits, "MAX_LISTED_WAITERS", 5)
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    assert (await acquire(stub, "holder", "g")).success
    waiting = 45
    events = await Events.open(stub, "g")
    calls = [acquire(stub, f"w{i:05d}", "g") for i in range(waiting)]
    queued = 0
    async for event in events.call:
        queued += event.kind == K.KIND_QUEUED
        if queued == waiting:
            break
    reply = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert reply.waiter_queue_depth == waiting
    assert len(reply.waiting_jobs) == len(reply.waiting_since) == 5
    assert reply.waiting_jobs_omitted == 40
    assert set(reply.waiting_jobs) < {f"w{i:05d}" for i in range(waiting)}
    for call in calls:
        call.cancel()
    events.cancel()


def test_a_long_queue_is_named_whole_where_the_orchestrator_acts_on_it_and_counted_on_screen() -> (
    None
):
    """Slurm mode evicts ended jobs among a group's holder and waiters: it reads the lock,
    not the (truncated) status. A waiting `tslice acquire` beyond the listed waiters says
    where it is, and `tslice status` counts the waiters it does not list."""
    import datetime

    from tslice import client as tsclient
    from tslice.cli import render
    from tslice.orchestrator.group import discovered
    from tslice.orchestrator.group import lock as lk

    g = lk.GroupLock()
    g.on_acquire("holder", now=0)
    g.on_switch_done(epoch=g.grant_epoch, restored=False, now=0)
    for i in range(limits.MAX_LISTED_WAITERS + 5):
        g.on_acquire(f"w{i}", now=1)

    class Driver:
        lock = g

    class Groups:
        def get(self, gid: str) -> Driver | None:
            return Driver() if gid == "g" else None

    jobs = asyncio.run(discovered.jobs_in(Groups(), "g"))  # type: ignore[arg-type]
    assert len(jobs) == limits.MAX_LISTED_WAITERS + 6 and "w1004" in jobs
    listed = tuple(f"w{i}" for i in range(3))
    status = tsclient.GroupStatus(
        group_id="g",
        group_state=tsclient.GroupState.LOCKED,
        state_timestamp=datetime.datetime.now(datetime.timezone.utc),
        locking_job="holder",
        active_job="holder",
        waiter_queue_depth=8,
        loaded_job="holder",
        waiting_jobs=listed,
    )
    line = render.acquire_waiting(group="g", job="w6", status=status, waited_s=1).plain
    assert "behind position 3 of 8 in the queue" in line, line
    line = render.acquire_waiting(group="g", job="w1", status=status, waited_s=1).plain
    assert "position 2 of 8 in the queue" in line, line
