"""Small pure pieces: recovery decisions, the event bus, backoff."""

from __future__ import annotations

import asyncio

from tests.orchestrator.recovery_views import F, R, S, T, decide, view
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import events, recovery, steps, switch


def test_intent_rolled_back_only_when_nothing_moved() -> None:
    d = decide("a", [view(a=R), view(a=R, b=S)], ("a", "b"))
    assert (d.rollback, d.resident, d.verified) == (True, "a", True)
    assert not decide("a", [view(a=S), view(a=R)], ("a", "b")).rollback  # node 0 moved
    assert not decide("a", [view(a=T), view(a=R)], ("a", "b")).rollback  # op in flight
    assert not decide("a", [view(a=R), view(b=R)], ("a", "b")).rollback
    assert decide(None, [view(), view(b=S)], (None, "b")).rollback  # from an idle group
    assert not decide(None, [view(b=R), view()], (None, "b")).rollback


def test_resident_verified_adopted_or_left_unverified() -> None:
    assert decide("a", [view(a=R), view(a=R)]) == recovery.RecoveryDecision(
        "a", True, False, "resident verified"
    )
    adopted = decide(None, [view(c=R, a=S), view(c=R)])
    assert (adopted.resident, adopted.verified) == ("c", True)
    nothing = decide("a", [view(a=S), view(a=S)])
    assert (nothing.resident, nothing.verified) == (None, True)
    disagree = decide("a", [view(a=R), view(c=R)])
    assert (disagree.resident, disagree.verified) == ("a", False)
    faulted = decide("a", [view(a=R), view(a=F)])
    assert not faulted.verified


def test_jobs_of_other_groups_are_ignored() -> None:
    other = {"z": steps.JobView(R, "other-group")}
    assert decide("a", [{**view(a=R), **other}]).verified


async def test_slow_watcher_drops_oldest_and_never_blocks() -> None:
    bus = events.EventBus(maxlen=3)
    dropped: list[int] = []
    bus.on_drop = dropped.append
    sub = bus.subscribe(group_id="g")
    for i in range(5):
        bus.publish(
            events.make_event(opb.OrchestratorEvent.KIND_QUEUED, group_id="g", job_id=f"j{i}")
        )
    bus.publish(events.make_event(opb.OrchestratorEvent.KIND_QUEUED, group_id="h", job_id="x"))
    assert sub.dropped == 2 and sum(dropped) == 2
    bus.close()
    got = [e.job_id async for e in sub]
    assert got == ["j2", "j3", "j4"]


async def test_subscription_wakes_on_publish() -> None:
    bus = events.EventBus()
    sub = bus.subscribe()
    it = sub.__aiter__()
    nxt = asyncio.ensure_future(it.__anext__())
    await asyncio.sleep(0)
    assert not nxt.done()
    bus.publish(events.make_event(opb.OrchestratorEvent.KIND_GRANTED, group_id="g", job_id="a"))
    assert (await asyncio.wait_for(nxt, 5)).job_id == "a"
    bus.close()


def test_events_reach_their_groups_watchers_and_the_watchers_of_all() -> None:
    bus = events.EventBus()
    queued = opb.OrchestratorEvent.KIND_QUEUED
    of_g, of_h, of_all = (bus.subscribe(group_id=g) for g in ("g", "h", ""))
    assert bus.wants("g", queued) and bus.wants("other", queued)
    for gid in ("g", "h", "other", ""):
        bus.publish(events.make_event(queued, group_id=gid, job_id=f"of-{gid}"))
    assert [e.job_id for e in of_g._buffer] == ["of-g"]
    assert [e.job_id for e in of_h._buffer] == ["of-h"]
    assert [e.job_id for e in of_all._buffer] == ["of-g", "of-h", "of-other", "of-"]
    bus.unsubscribe(of_all)
    assert bus.wants("g", queued) and not bus.wants("other", queued)
    bus.unsubscribe(of_g)
    bus.unsubscribe(of_g)  # twice: nothing left to remove
    assert not bus.wants("g", queued) and bus.wants("h", queued)
    bus.close()
    assert of_h.closed and not bus.wants("h", queued)


def test_backoff_grows_and_is_capped() -> None:
    b = switch.Backoff(0.05, 1.0)
    assert 0.025 <= b.delay(0) <= 0.05
    assert 0.2 <= b.delay(3) <= 0.4
    assert 0.5 <= b.delay(20) <= 1.0
