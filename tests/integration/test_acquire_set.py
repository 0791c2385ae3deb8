"""AcquireSet end to end: real orchestrator and sim agents on loopback, raw gRPC stubs.

Each scenario has groups of its own on device subsets of two agents (disjoint devices:
they never contend with another scenario's), one process stack for the module. The
scenarios synchronise on the orchestrator's events (subscribed before acting), on
replies and on status reads; where one needs an operation in flight, its agent is frozen
(SIGSTOP) so that it is in flight however slow the machine is. The crash scenarios are
in test_acquire_set_crash.py, local mode in test_acquire_set_local.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import grpc
import pytest

from tests.faults.processes import GroupNodes, Stack
from tests.faults.stack import GS, WAIT_S, K
from tests.integration.acquire_set_stack import (
    Recorder,
    SetOrchestrator,
    Taken,
    all_or_nothing_violations,
    at,
    connected,
    frozen,
    held_by,
    journal_violations,
    kept_for_a_set,
    no_violations,
    queued,
    queued_set,
    random_jobs,
    running_stack,
)
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

pytestmark = pytest.mark.slow

#: Random runs over groups of disjoint devices ...
DISJOINT: dict[str, GroupNodes] = {
    "d1": {"node-a": [0]},
    "d2": {"node-a": [1]},
    "d3": {"node-b": [0]},
    "d4": {"node-a": [2], "node-b": [1]},
}
#: ... and over groups that share devices: o1 and o2 share node-a/4, o2 and o3 node-b/3.
OVERLAPPING: dict[str, GroupNodes] = {
    "o1": {"node-a": [3, 4]},
    "o2": {"node-a": [4], "node-b": [3]},
    "o3": {"node-b": [3, 4]},
}
OVERLAPS = {"o1": {"o2"}, "o2": {"o1", "o3"}, "o3": {"o2"}}
#: One pair per scenario: the first group on node-a, the second on node-b.
PAIRS = {
    name: (f"{name}-a", f"{name}-b")
    for name in (
        "order", "sync", "cancel", "late", "lease", "evict", "alone", "nested", "nested-set",
        "kept-deadline", "kept-evicted", "held-evicted", "early-lease",
    )
}  # fmt: skip
GROUPS: dict[str, GroupNodes] = {
    **DISJOINT,
    **OVERLAPPING,
    **{
        group: {node: [5 + i]}
        for i, pair in enumerate(PAIRS.values())
        for group, node in zip(pair, ("node-a", "node-b"), strict=True)
    },
    "refused": {"node-a": [15]},
    "refused-b": {"node-b": [15]},
}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with running_stack(GROUPS) as running:
        yield running


# ---- 1. random jobs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups", "overlaps"),
    [(DISJOINT, None), (OVERLAPPING, OVERLAPS)],
    ids=["disjoint", "shared"],
)
async def test_random_jobs_taking_sets_and_single_groups_never_deadlock_nor_overlap(
    stack: Stack, groups: Mapping[str, GroupNodes], overlaps: Mapping[str, Collection[str]] | None
) -> None:
    windows = await random_jobs(stack.orchestrator.address, sorted(groups))
    journal = journal_violations(stack, windows.seen, groups, overlaps)
    assert journal == [], no_violations(journal)


# ---- 2. opposite orders ------------------------------------------------------------------


async def test_two_sets_naming_the_same_groups_in_opposite_orders_both_complete(
    stack: Stack,
) -> None:
    """Separate Acquires in these orders deadlock once the holders yield (x takes the
    first group, y the second, each waits for the other's): the sets do not."""
    first, second = PAIRS["order"]
    async with held_by(stack, {first: "h1", second: "h2"}) as (o, events):
        x = await queued_set(o, events, "x", first, second)
        y = await queued_set(o, events, "y", second, first)
        await o.yield_("h1", first)
        await o.yield_("h2", second)
        x_grants = (await x).grants
        assert (await o.waiting(first)) == ("x", ["y"])
        assert (await o.waiting(second)) == ("x", ["y"])
        await o.yield_("x", second)
        await o.yield_("x", first)
        y_grants = (await y).grants
        await o.yield_("y", first)
        await o.yield_("y", second)
        await events.until(2, K.KIND_YIELDED, (first, second), "y")
    assert [g.group_id for g in y_grants] == [second, first]
    taken = [Taken(job, {g.group_id: g.grant_epoch for g in grants}) for job, grants in
             (("x", x_grants), ("y", y_grants))]  # fmt: skip
    assert all_or_nothing_violations(events.seen, taken) == []


async def _alone(o: SetOrchestrator, first: str, second: str) -> None:
    assert (await o.acquire("w", second, timeout=10)).success


async def _as_a_set(o: SetOrchestrator, first: str, second: str) -> None:
    # The group it holds counts as granted: the reply carries that grant again.
    reply = await o.acquire_set("w", first, second, timeout=10)
    assert reply.grants[0].grant_epoch == 1


@pytest.mark.parametrize(
    ("pair", "ask"),
    [
        ("nested", _alone),
        ("nested-set", _as_a_set),
    ],
)
async def test_a_job_holding_one_group_of_a_waiting_set_gets_the_other_first(
    stack: Stack, pair: str, ask: Callable[[SetOrchestrator, str, str], Awaitable[None]]
) -> None:
    """w holds `first` (the lock-ordering convention: nested Acquires) when v's set
    {first, second} arrives; `second` is kept for v, which waits for w anyway: w asking
    for `second` (alone, or naming both as a set) must get it first, else neither moves."""
    first, second = PAIRS[pair]
    async with held_by(stack, {first: "w"}) as (o, events):
        v = await queued_set(o, events, "v", first, second)
        assert (await o.waiting(second)) == ("", ["v"])
        await ask(o, first, second)  # its own bound turns the deadlock into a failure
        assert not v.done()
        await o.yield_("w", second)
        await o.yield_("w", first)
        assert [g.grant_epoch for g in (await v).grants] == [2, 2]
        await o.yield_("v", first)
        await o.yield_("v", second)


# ---- 3. weight sync ------------------------------------------------------------------------


async def test_weight_sync_is_granted_once_both_pools_are_free_and_switches_both_at_once(
    stack: Stack,
) -> None:
    sampler, trainer = PAIRS["sync"]
    async with held_by(stack, {sampler: "s", trainer: "t"}) as (o, events):
        # The sampler is free but kept for the set: neither w (the trainer is still
        # busy) nor x (which came later) has it.
        sync, late = await kept_for_a_set(
            o, events, "w", (trainer, sampler), kept=sampler, holder="s", late="x"
        )
        assert (await o.status(sampler)).group_state == GS.STATE_IDLE_YIELDED
        # The sampler's agent is frozen: its switch cannot end before the trainer's.
        with frozen(stack.agents["node-a"]):
            await o.yield_("t", trainer)
            await events.wait_for(K.KIND_SWITCH_STARTED, sampler, "w")
            await events.wait_for(K.KIND_SWITCH_STARTED, trainer, "w")
            trainer_done = await events.wait_for(K.KIND_SWITCH_DONE, trainer, "w")
            assert events.count(K.KIND_SWITCH_DONE, (sampler,)) == 0
        reply = await sync
        assert [(g.group_id, g.grant_epoch) for g in reply.grants] == [
            (trainer, 2),
            (sampler, 2),
        ]
        assert not late.done()
        await o.yield_("w", sampler)
        assert (await late).grant_epoch == 3
        await o.yield_("x", sampler)
        await o.yield_("w", trainer)
        done = await events.wait_for(K.KIND_SWITCH_DONE, sampler, "w")
    started = [at(e) for e in events.seen if e.kind == K.KIND_SWITCH_STARTED and e.job_id == "w"]
    assert max(started) < min(at(trainer_done), at(done)), "the pools' switches did not overlap"


# ---- 4. cancellation and deadlines -----------------------------------------------------------


#: How a pending set ends: (orchestrator, the set's call, the group it still waits for).
SetEnd = Callable[[SetOrchestrator, "asyncio.Task[Any]", str], Awaitable[None]]


async def _cancelled(o: SetOrchestrator, pending: asyncio.Task[Any], second: str) -> None:
    pending.cancel()  # the caller goes away


async def _evicted(o: SetOrchestrator, pending: asyncio.Task[Any], second: str) -> None:
    request = opb.EvictRequest(job_id="w", group_id=second, reason="make room for h2")
    await o.stub.Evict(request, timeout=WAIT_S, wait_for_ready=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pending
    assert err.value.code() == grpc.StatusCode.ABORTED, err.value
    assert "make room for h2" in (err.value.details() or ""), err.value


@pytest.mark.parametrize(("pair", "end"), [("cancel", _cancelled), ("evict", _evicted)])
async def test_a_pending_set_that_ends_leaves_every_queue_and_the_kept_group_moves_on(
    stack: Stack, pair: str, end: SetEnd
) -> None:
    """Cancelled by its caller, or its job evicted (by an administrator) from the group
    it still waits for: either way its part in the group kept for it leaves too."""
    first, second = PAIRS[pair]
    async with held_by(stack, {first: "h1", second: "h2"}) as (o, events):
        pending, late = await kept_for_a_set(
            o, events, "w", (first, second), kept=first, holder="h1", late="x"
        )
        await end(o, pending, second)
        await events.wait_for(K.KIND_CANCELLED, first, "w")
        # The group kept for w goes to the next waiter; w waits nowhere.
        assert (await late).success
        assert (await o.waiting(first)) == ("x", [])
        assert (await o.waiting(second)) == ("h2", [])
        await o.yield_("x", first)
        await o.yield_("h2", second)


async def test_a_set_that_ends_leaves_the_job_s_own_acquire_of_one_of_its_groups_waiting_alone(
    stack: Stack,
) -> None:
    """w waits for `first` alone and in a set (one queue entry, two calls); the set is
    cancelled: the group is kept for it no longer, and w's own Acquire is granted."""
    first, second = PAIRS["alone"]
    async with held_by(stack, {first: "h1", second: "h2"}) as (o, events):
        alone = await queued(o, events, "w", first)
        pending = o.acquiring_set("w", first, second)
        # Its parts are posted to both groups together: once it is queued at `second`,
        # the part at `first` was posted before this status read.
        await events.wait_for(K.KIND_QUEUED, second, "w")
        assert (await o.waiting(first)) == ("h1", ["w"])
        await o.yield_("h1", first)
        assert (await o.waiting(first)) == ("", ["w"])  # kept for the set
        pending.cancel()
        await events.wait_for(K.KIND_CANCELLED, second, "w")
        # The bound only turns the stall into a failure: the grant is due at once.
        assert (await asyncio.wait_for(alone, 10)).success
        assert (await o.waiting(second)) == ("h2", [])
        await o.yield_("w", first)
        await o.yield_("h2", second)


async def test_a_deadline_passing_while_one_group_is_granted_and_one_switches_leaves_neither(
    stack: Stack,
) -> None:
    resident, switching = PAIRS["late"]
    async with connected(stack) as o:
        # w's state stays on `resident`, so its grant there costs nothing and is made at
        # once; `switching` must snapshot b and restore w on node-b, which is frozen.
        await o.acquire("w", resident)
        await o.yield_("w", resident)
        await o.acquire("b", switching)
        await o.yield_("b", switching)
        async with Recorder(o.stub) as events:
            with frozen(stack.agents["node-b"]):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await o.acquire_set("w", resident, switching, timeout=3.0)
                assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
                granted = await events.wait_for(K.KIND_GRANTED, resident, "w")
                assert granted.detail == "zero-cost", granted
                await events.wait_for(K.KIND_SWITCH_STARTED, switching, "w")
                # The granted part is given back; the part in its switch leaves it.
                given_back = await events.wait_for(K.KIND_CANCELLED, resident, "w")
                # (The call's deadline and the request's timeout_ms are the same instant:
                # the cancel or the orchestrator's own deadline ends the set first.)
                why = given_back.detail
                assert "AcquireSet was cancelled" in why or "within its deadline" in why, why
                await events.wait_for(K.KIND_CANCELLED, switching, "w")
            await events.wait_for(K.KIND_SWITCH_DONE, switching, "w")
            assert events.count(K.KIND_GRANTED, (switching,)) == 0
        for group in (resident, switching):
            assert (await o.waiting(group)) == ("", []), group
        # Nobody holds them: another job gets each at once.
        assert (await o.acquire("z", resident)).success
        assert (await o.acquire("z", switching)).success
        await o.yield_("z", resident)
        await o.yield_("z", switching)


# ---- 4b. a success answer is never taken back by the set (issue 21 §1) ------------------------


async def _set_deadline(o: SetOrchestrator, pending: asyncio.Task[Any], second: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pending
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value


async def _set_evicted(o: SetOrchestrator, pending: asyncio.Task[Any], second: str) -> None:
    request = opb.EvictRequest(job_id="j", group_id=second, reason="not now")
    await o.stub.Evict(request, timeout=WAIT_S, wait_for_ready=True)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pending  # (answered once the set's withdrawal is done)
    assert err.value.code() == grpc.StatusCode.ABORTED, err.value


@pytest.mark.parametrize(
    ("pair", "end"), [("kept-deadline", _set_deadline), ("kept-evicted", _set_evicted)]
)
async def test_a_failed_set_never_takes_back_a_group_another_acquire_of_its_job_was_granted(
    stack: Stack, pair: str, end: SetEnd
) -> None:
    """k holds `second`; j asks for both as a set (3-s deadline), and another process of j
    for `first` alone: granted at once, which also completes the set's part there. The
    set then fails (its deadline, or j evicted from `second`): its withdrawal must not
    yield `first`, which j was told it holds. (Before: l was granted `first` while j
    used it, and j's Yield was refused as 'held by l'.)"""
    first, second = PAIRS[pair]
    async with held_by(stack, {second: "k"}) as (o, events):
        pending = o.acquiring_set("j", first, second, timeout=3.0)
        for group in (first, second):
            await events.wait_for(K.KIND_QUEUED, group, "j")
        other = await queued(o, events, "l", first)
        assert (await o.acquire("j", first)).success  # j's other process
        await end(o, pending, second)
        # The set's part left `second` (CANCELLED there) before its share of `first` was
        # given back, and a status read of `first` is served after that: j still holds.
        await events.wait_for(K.KIND_CANCELLED, second, "j")
        assert (await o.waiting(first)) == ("j", ["l"])
        assert events.count(K.KIND_CANCELLED, (first,), "j") == 0
        assert not other.done()
        await o.yield_("j", first)  # j's own yield is what lets l in
        assert (await other).success
        await o.yield_("l", first)
        await o.yield_("k", second)


async def test_a_set_whose_held_group_was_evicted_meanwhile_is_refused_not_granted_stale(
    stack: Stack,
) -> None:
    """j holds `first` and asks for both; an administrator evicts j from `first`, and n
    is granted it. When `second` frees, the set must not answer success with `first`'s
    old grant: it fails ABORTED naming the eviction, and gives `second` back."""
    first, second = PAIRS["held-evicted"]
    async with held_by(stack, {first: "j", second: "k"}) as (o, events):
        pending = o.acquiring_set("j", first, second)
        await events.wait_for(K.KIND_QUEUED, second, "j")
        n = await queued(o, events, "n", first)
        request = opb.EvictRequest(job_id="j", group_id=first, reason="node maintenance")
        await o.stub.Evict(request, timeout=WAIT_S, wait_for_ready=True)
        assert (await n).success
        await o.yield_("k", second)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pending
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value
        message = err.value.details() or ""
        assert f"lost group {first!r}" in message and "node maintenance" in message, message
        assert (await o.waiting(first)) == ("n", [])
        assert (await o.waiting(second)) == ("", [])  # given back: nobody holds it
        # j's next call about `first` is told why.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await o.yield_("j", first)
        # (n holds it now: the refusal names the holder and the eviction.)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
        assert "node maintenance" in (err.value.details() or ""), err.value
        await o.yield_("n", first)


# ---- 5. leases ---------------------------------------------------------------------------------


async def test_a_set_s_lease_is_kept_per_group_by_its_own_hold_stream(stack: Stack) -> None:
    first, second = PAIRS["lease"]
    lease_ms = 1000
    async with connected(stack) as o, Recorder(o.stub) as events:
        reply = await o.acquire_set("w", first, second, lease_ms=lease_ms)
        epochs = {g.group_id: g.grant_epoch for g in reply.grants}
        holds = {g: o.hold("w", g, epochs[g]) for g in (first, second)}
        for hold in holds.values():
            assert (await hold.read()).lease_ms == lease_ms
        waiters = {
            first: await queued(o, events, "x", first),
            second: await queued(o, events, "y", second),
        }
        # A keepalive on the second stream: from here its lease, unkept, would end
        # before the first group's, which runs only once the first stream closes.
        assert (await holds[second].read()).lease_ms == lease_ms
        holds[first].cancel()
        lapsed = await events.wait_for(K.KIND_YIELDED, first, "w")
        assert lapsed.detail == "lease expired", lapsed
        assert (await waiters[first]).success
        # The second group is still w's, its stream alive.
        assert (await o.waiting(second)) == ("w", ["y"])
        still = await holds[second].read()
        assert still.lease_ms == lease_ms and not still.lost, still
        assert events.count(K.KIND_YIELDED, (second,)) == 0
        holds[second].cancel()
        assert (await waiters[second]).success
        assert (await events.wait_for(K.KIND_YIELDED, second, "w")).detail == "lease expired"
        await o.yield_("x", first)
        await o.yield_("y", second)


async def test_a_set_s_lease_starts_when_the_set_is_answered_not_when_a_part_is_granted(
    stack: Stack,
) -> None:
    """`resident` is granted to w's set at once (w's state is still there), `switching`
    only after a switch that takes longer than the lease (node-b frozen meanwhile). w can
    open no Hold stream before the set answers: the early part's lease must not run out
    meanwhile (it did, and the set was then answered with a group w no longer held)."""
    resident, switching = PAIRS["early-lease"]
    lease_ms = 1000
    async with connected(stack) as o:
        await o.acquire("w", resident)
        await o.yield_("w", resident)
        await o.acquire("b", switching)
        await o.yield_("b", switching)
        async with Recorder(o.stub) as events:
            with frozen(stack.agents["node-b"]):
                pending = o.acquiring_set("w", resident, switching, lease_ms=lease_ms)
                await events.wait_for(K.KIND_GRANTED, resident, "w")
                await events.wait_for(K.KIND_SWITCH_STARTED, switching, "w")
                # Three leases long; no event may end w's grant of `resident` meanwhile.
                await asyncio.sleep(3 * lease_ms / 1000)
            reply = await pending
            assert events.count(K.KIND_YIELDED, (resident,), "w") == 0
        epochs = {g.group_id: g.grant_epoch for g in reply.grants}
        assert (await o.waiting(resident)) == ("w", [])
        holds = {g: o.hold("w", g, epochs[g]) for g in (resident, switching)}
        for hold in holds.values():
            assert (await hold.read()).lease_ms == lease_ms
        for group, hold in holds.items():
            await o.yield_("w", group)
            hold.cancel()


# ---- 7. refusals ----------------------------------------------------------------------------


async def test_bad_sets_are_refused_with_what_to_fix_and_queue_nothing(stack: Stack) -> None:
    group = "refused"
    async with held_by(stack, {group: "h"}, kinds=(K.KIND_QUEUED,)) as (o, events):
        cases: list[tuple[opb.AcquireSetRequest, grpc.StatusCode, Sequence[str]]] = [
            (opb.AcquireSetRequest(job_id="w"), grpc.StatusCode.INVALID_ARGUMENT,
             ["group_ids is empty", "name the groups"]),
            (opb.AcquireSetRequest(job_id="w", group_ids=[group, "order-a", group]),
             grpc.StatusCode.INVALID_ARGUMENT, [repr(group), "more than once", "name each"]),
            (opb.AcquireSetRequest(job_id="w", group_ids=[f"g{i}" for i in range(17)]),
             grpc.StatusCode.INVALID_ARGUMENT, ["17 groups", "at most 16"]),
            (opb.AcquireSetRequest(job_id="w", group_ids=[group, "no-such-group"]),
             grpc.StatusCode.NOT_FOUND, ["no-such-group"]),
            (opb.AcquireSetRequest(job_id="", group_ids=[group]),
             grpc.StatusCode.INVALID_ARGUMENT, ["job_id"]),
            (opb.AcquireSetRequest(job_id="bad job/id", group_ids=[group]),
             grpc.StatusCode.INVALID_ARGUMENT, ["job_id"]),
            (opb.AcquireSetRequest(job_id="w", group_ids=[group], lease_ms=-1),
             grpc.StatusCode.INVALID_ARGUMENT, ["lease_ms", ">= 0"]),
            # More than the device memory of either group's node: never resident there.
            (opb.AcquireSetRequest(job_id="w", group_ids=[group, "refused-b"],
                                   footprint_bytes=2 * 1024**4),
             grpc.StatusCode.RESOURCE_EXHAUSTED, ["footprint"]),
        ]  # fmt: skip
        for request, code, words in cases:
            err = await o.refusal(request)
            assert err.code() == code, (request, err)
            message = err.details() or ""
            assert all(w in message for w in words), (request, message)
        # Nothing was queued anywhere: the first QUEUED event is this later waiter's.
        sentinel = await queued(o, events, "sentinel", group)
        seen = [(e.group_id, e.job_id) for e in events.seen]
        assert seen == [(group, "sentinel")], seen
        await o.yield_("h", group)
        await sentinel
        await o.yield_("sentinel", group)
