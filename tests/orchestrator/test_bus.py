"""The event bus behind WatchEvents (issue 21 §4): publishing is one append per ring, only
the subscribers an event is for are woken, a subscriber that falls behind its ring is
dropped with the reason, and subscribers are capped per caller and in all."""

from __future__ import annotations

import asyncio

import pytest

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import limits
from tslice.orchestrator.events import bus
from tslice.rpc import refusals

K = opb.OrchestratorEvent


def event(kind: int, group: str, job: str) -> bus.Event:
    return bus.Event(kind, group, job)


async def test_a_subscriber_that_falls_behind_its_ring_is_dropped_with_the_reason() -> None:
    events = bus.EventBus(ring_events=3)
    dropped: list[int] = []
    events.on_drop = dropped.append
    sub = events.subscribe(group_id="g")
    for i in range(5):
        events.publish(event(K.KIND_QUEUED, "g", f"j{i}"))
    events.publish(event(K.KIND_QUEUED, "h", "x"))  # another group's ring: not g's
    with pytest.raises(bus.FellBehind) as behind:
        async for _ in sub:
            pass
    assert behind.value.missed == 2
    assert "2 events were not read" in str(behind.value) and "since" in str(behind.value)
    events.unsubscribe(sub, missed=behind.value.missed)
    assert dropped == [2]


async def test_a_waiting_subscriber_is_woken_by_the_fan_out_not_by_publish() -> None:
    events = bus.EventBus()
    sub = events.subscribe()
    it = sub.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    assert not nxt.done()
    events.publish(event(K.KIND_GRANTED, "g", "a"))
    assert not nxt.done()  # publishing only appended: the fan-out comes after
    assert (await asyncio.wait_for(nxt, 5)).job_id == "a"
    events.close()


async def test_events_reach_their_groups_watchers_and_the_watchers_of_all() -> None:
    events = bus.EventBus()
    of_g, of_h, of_all = (events.subscribe(group_id=g) for g in ("g", "h", ""))
    for gid in ("g", "h", "other"):
        events.publish(event(K.KIND_QUEUED, gid, f"of-{gid}"))
    events.close()
    assert [e.job_id async for e in of_g] == ["of-g"]
    assert [e.job_id async for e in of_h] == ["of-h"]
    assert [e.job_id async for e in of_all] == ["of-g", "of-h", "of-other"]


async def test_a_filtered_subscriber_sleeps_through_what_it_does_not_watch() -> None:
    events = bus.EventBus()
    sub = events.subscribe(group_id="g", kinds=frozenset({K.KIND_QUEUED}), job_id="b")
    it = sub.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    events.publish(event(K.KIND_GRANTED, "g", "b"))  # another kind
    events.publish(event(K.KIND_QUEUED, "g", "a"))  # another job
    for _ in range(3):
        await asyncio.sleep(0)  # the fan-outs run: nothing wakes it
    assert not nxt.done()
    events.publish(event(K.KIND_QUEUED, "g", "b"))
    got = await asyncio.wait_for(nxt, 5)
    assert (got.kind, got.job_id) == (K.KIND_QUEUED, "b")
    events.close()


def test_subscribers_are_capped_per_caller_and_in_all() -> None:
    events = bus.EventBus(caps=limits.Limits(max_watchers=3, max_watchers_per_caller=2))
    first = [events.subscribe(caller="scraper") for _ in range(2)]
    with pytest.raises(refusals.Refused) as per_caller:
        events.subscribe(caller="scraper")
    assert per_caller.value.code is refusals.Code.RESOURCE_EXHAUSTED
    assert "max_watchers_per_caller" in per_caller.value.message
    events.subscribe(caller="dashboard")
    with pytest.raises(refusals.Refused) as in_all:
        events.subscribe(caller="cli")
    assert "max_watchers" in in_all.value.message
    events.unsubscribe(first[0])
    events.unsubscribe(first[0])  # twice: nothing left to remove
    events.subscribe(caller="scraper")  # a slot is free again


def test_nobody_watching_costs_a_publish_one_append() -> None:
    events = bus.EventBus()
    events.tap = []
    events.publish(event(K.KIND_GRANTED, "g", "a"))
    assert [e.job_id for e in events.tap] == ["a"] and events._rings == {}
