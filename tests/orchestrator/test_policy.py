"""Each scheduling policy's rules on the pure lock, the prefetch decision, and a real
orchestrator scheduling by the topology file's policy."""

from __future__ import annotations

import asyncio

import pytest

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import policy
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk

K = opb.OrchestratorEvent


def with_policy(spec: policy.PolicySpec, *, woken: bool = False) -> lk.GroupLock:
    g = lk.GroupLock()
    g.use_policy(policy.build(spec), woken=woken)
    return g


def switch_to(actions: list[decisions.Action]) -> str:
    (sw,) = [a for a in actions if isinstance(a, decisions.StartSwitch)]
    return sw.to_job


def hand_over(g: lk.GroupLock, holder: str, now: float) -> str:
    """``holder`` yields; the switch to the next waiter completes; who got it."""
    job = switch_to(g.on_yield(holder, now=now).actions)
    sw = g.switching
    assert sw is not None
    g.on_switch_done(epoch=sw.epoch, restored=True, now=now)
    return job


def started(g: lk.GroupLock, job: str, now: float = 0.0) -> None:
    g.on_acquire(job, now=now)
    sw = g.switching
    assert sw is not None and sw.to_job == job
    g.on_switch_done(epoch=sw.epoch, restored=False, now=now)


# ---- priority -------------------------------------------------------------------------------


def test_priority_grants_the_higher_priority_first_and_aging_lets_the_low_one_catch_up() -> None:
    g = with_policy(policy.PrioritySpec(aging_s=10, priorities={"hi": 2}))
    started(g, "a")
    g.on_acquire("lo", now=0)
    g.on_acquire("hi", now=5)  # 2 levels above, 5 s later: ahead (5 < 2 * 10)
    assert hand_over(g, "a", 6) == "hi"
    g2 = with_policy(policy.PrioritySpec(aging_s=10, priorities={"hi": 2}))
    started(g2, "a")
    g2.on_acquire("lo", now=0)
    g2.on_acquire("hi", now=25)  # 25 s later: lo has aged past it
    assert hand_over(g2, "a", 26) == "lo"
    pol = g2.policy
    assert isinstance(pol, policy.Priority)
    assert pol.aging_bound_s("lo") == 20 and pol.aging_bound_s("hi") == 0


def test_priority_waits_survive_a_restart_through_the_record() -> None:
    spec = policy.PrioritySpec(aging_s=10, priorities={"hi": 2})
    g = lk.GroupLock(wall_offset_s=1000.0, policy=policy.build(spec))
    started(g, "a")
    g.on_acquire("lo", now=0)
    g.on_acquire("hi", now=25)
    rec = g.record()
    assert [(q.job, q.queued_at) for q in rec.queue] == [("lo", 1000.0), ("hi", 1025.0)]
    # Restarted 100 s later (wall clock 1100 at now=0 of the new process).
    r = lk.GroupLock.from_record(rec, now=0.0, wall_now=1100.0, policy=policy.build(spec))
    for job in ("lo", "hi"):
        r.on_acquire(job, now=0.1)
    r.on_recovered(resident="a", verified=True, rollback=False, now=0.2)
    assert r.next_waiter(now=0.2) == "lo"  # lo kept its 25 s of aging over hi
    # FIFO records no wait times: its records stay as they were.
    f = lk.GroupLock()
    started(f, "a")
    f.on_acquire("b", now=3)
    assert [q.queued_at for q in f.record().queue] == [None]


# ---- fair share -----------------------------------------------------------------------------


def test_fair_share_grants_the_least_served_per_weight() -> None:
    g = with_policy(policy.FairShareSpec(weights={"big": 3}, quantum_s=0.1))
    started(g, "big", 0)
    g.on_acquire("s1", now=0)
    g.on_acquire("s2", now=0)
    turns = []
    holder, now = "big", 0.0
    for _ in range(40):
        now += 1.0  # every turn lasts a second; the holder queues again after it
        nxt = hand_over(g, holder, now)
        g.on_acquire(holder, now=now)
        holder = nxt
        turns.append(holder)
    # FIFO would rotate (a third each); big (weight 3) goes every time it waits, once
    # the two others have caught up with its first turn.
    assert turns[:3] == ["s1", "s2", "big"] and turns[3::2] == ["s1", "s2"] * 9 + ["s1"]
    assert turns[4::2] == ["big"] * 18


def test_fair_share_gives_a_newcomer_no_credit_for_the_time_it_was_away() -> None:
    g = with_policy(policy.FairShareSpec(quantum_s=0.1))
    pol = g.policy
    assert isinstance(pol, policy.FairShare)
    started(g, "old", 0)
    g.on_yield("old", now=1000)  # 1000 s of use, alone
    g.on_acquire("old", now=1000)  # zero-cost again
    g.on_acquire("new", now=1000)
    # No 1000 s of credit for new (and old's lead beyond memory_s, 600 s, is forgiven).
    assert pol.usage("new") == pol.usage("old") == 600
    assert hand_over(g, "old", 1001) == "new"
    g.on_acquire("old", now=1001)
    assert hand_over(g, "new", 1002) == "old"


# ---- cost-aware -----------------------------------------------------------------------------


@pytest.mark.parametrize(("yield_at", "first"), [(3, "light"), (10, "heavy")])
def test_cost_aware_prefers_the_cheapest_waiter_until_another_is_overdue(
    yield_at: float, first: str
) -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=1.0, max_defer_s=10))
    started(g, "a")
    g.on_switch_measured(None, "heavy", seconds=8.0)
    g.on_switch_measured(None, "light", seconds=0.5)
    g.on_acquire("heavy", now=0)
    g.on_acquire("light", now=1)
    # At 10 s heavy has waited max_defer_s: overdue, it goes first.
    assert hand_over(g, "a", yield_at) == first


def bursty(g: lk.GroupLock, job: str = "a", gap: float = 0.2) -> float:
    """``job`` holds and comes back after short gaps twice (the policy learns the gap)."""
    started(g, job)
    now = 0.0
    for _ in range(2):
        now += 1
        g.on_yield(job, now=now)
        now += gap
        g.on_acquire(job, now=now)  # zero cost: nobody waits
    return now


def test_cost_aware_waits_out_a_residents_short_gap_instead_of_switching_twice() -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=2.0, gap_patience=1.5), woken=True)
    now = bursty(g)
    g.on_acquire("b", now=now)  # b's switch-in (2 s) costs more than a's gap (0.2 s)
    out = g.on_yield("a", now=now + 1)
    assert not [x for x in out.actions if isinstance(x, decisions.StartSwitch)]
    assert g.wake_at is not None and abs(g.wake_at - (now + 1 + 0.3)) < 1e-9
    (grant,) = [x for x in g.on_acquire("a", now=now + 1.2) if isinstance(x, decisions.Granted)]
    assert grant.job == "a" and grant.zero_cost and g.wake_at is None
    # This time a does not come back within its patience: at the wake-up b is switched in.
    g.on_yield("a", now=now + 2)
    assert g.wake_at is not None
    assert g.on_expire(now=now + 2.1) == []  # woken early: still waiting
    assert switch_to(g.on_expire(now=g.wake_at)) == "b"


def test_a_hold_for_the_resident_needs_no_wake_up_once_its_waiters_left() -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=2.0), woken=True)
    now = bursty(g)
    g.on_acquire("b", now=now)
    g.on_yield("a", now=now + 1)
    assert g.wake_at is not None
    g.on_cancel("b", now=now + 1.1)
    assert g.wake_at is None
    g.on_acquire("a", now=now + 1.2)  # zero cost: nobody waits
    g.on_acquire("b", now=now + 1.3)  # queued behind the holder: no hold to end
    assert g.wake_at is None
    assert g.on_expire(now=now + 5) == []


def test_cost_aware_never_holds_for_the_resident_past_a_waiters_max_defer() -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=2.0, max_defer_s=3), woken=True)
    now = bursty(g, gap=1.0)
    g.on_acquire("b", now=now)
    out = g.on_yield("a", now=now + 2.5)
    assert not [x for x in out.actions if isinstance(x, decisions.StartSwitch)]
    assert g.wake_at == now + 3  # b's max defer, not a's patience (1.5 s)
    g.on_acquire("a", now=now + 2.9)  # a is cheaper, and b is not overdue yet
    g.on_yield("a", now=now + 3.0)  # b is overdue: no hold, b now
    assert g.switching is not None and g.switching.to_job == "b"


def test_cost_aware_does_not_hold_where_the_driver_does_not_wake_it_or_the_gap_is_long() -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=2.0))  # not woken
    now = bursty(g)
    g.on_acquire("b", now=now)
    assert switch_to(g.on_yield("a", now=now + 1).actions) == "b"
    g = with_policy(policy.CostAwareSpec(default_switch_s=0.1), woken=True)
    now = bursty(g)  # gaps of 0.2 s, switch-in 0.1 s: worth switching
    g.on_acquire("b", now=now)
    assert switch_to(g.on_yield("a", now=now + 1).actions) == "b"


def test_a_hold_for_the_resident_ends_when_another_group_wants_the_devices() -> None:
    g = with_policy(policy.CostAwareSpec(default_switch_s=2.0), woken=True)
    now = bursty(g)
    g.on_acquire("b", now=now)
    g.on_yield("a", now=now + 1)
    assert g.wake_at is not None
    actions = g.on_contended(now=now + 1.1)
    assert decisions.ReleaseClaim() in actions and decisions.NeedClaim("b") in actions


# ---- prefetch -------------------------------------------------------------------------------


def test_prefetch_starts_just_in_time_and_only_where_the_state_fits() -> None:
    decide = policy.should_prefetch
    assert decide(switch_in_s=2, holder_left_s=1, free_bytes=10, footprint_bytes=5)[0]
    assert not decide(switch_in_s=2, holder_left_s=5, free_bytes=10, footprint_bytes=5)[0]
    assert decide(switch_in_s=2, holder_left_s=None, free_bytes=10, footprint_bytes=5)[0]
    tight = decide(
        switch_in_s=2, holder_left_s=0, free_bytes=10, footprint_bytes=5, reserve_bytes=6
    )
    assert tight == (False, "does not fit beside the holder (5 B needed, 4 B free)")
    assert not decide(switch_in_s=2, holder_left_s=0, free_bytes=10, footprint_bytes=0)[0]


def test_the_locks_prefetch_advice_uses_what_it_measured() -> None:
    g = with_policy(policy.CostAwareSpec())
    assert g.prefetch_advice(now=0, free_bytes=100) == policy.Prefetch("", False, "nobody waits")
    started(g, "a")
    g.on_switch_measured(None, "b", seconds=2.0)
    g.on_yield("a", now=10)  # a's turns last 10 s
    g.on_acquire("a", now=10)
    g.on_acquire("b", footprint_bytes=50, now=11)
    early = g.prefetch_advice(now=12, free_bytes=100)
    assert (early.job, early.start) == ("b", False) and "too early" in early.reason
    assert g.prefetch_advice(now=18.5, free_bytes=100).start  # 1.5 s left < 2 s switch-in
    assert not g.prefetch_advice(now=18.5, free_bytes=40).start  # does not fit


# ---- a real orchestrator ----------------------------------------------------------------------


async def test_the_orchestrator_schedules_each_group_by_its_topology_policy(
    cluster: Cluster,
) -> None:
    agent = await cluster.start_agent("node-a")
    node = {"name": "node-a", "agent": agent.address}
    topology = {
        "groups": {
            "prio": {"nodes": [node], "policy": {"kind": "priority", "priority": {"hi": 5}}},
            "plain": {"nodes": [node]},
        }
    }
    await cluster.start_orchestrator(topology=topology)
    stub = cluster.stub()
    for group in ("prio", "plain"):
        ev = await Events.open(stub, group)
        await acquire(stub, "a", group)
        lo = asyncio.ensure_future(acquire(stub, "lo", group))
        await ev.wait_for(K.KIND_QUEUED, job="lo")
        hi = asyncio.ensure_future(acquire(stub, "hi", group))
        await ev.wait_for(K.KIND_QUEUED, job="hi")
        await yield_(stub, "a", group)
        first, second = (hi, lo) if group == "prio" else (lo, hi)
        assert (await first).success and not second.done()
        await yield_(stub, "hi" if group == "prio" else "lo", group)
        assert (await second).success
        await yield_(stub, "lo" if group == "prio" else "hi", group)
        ev.cancel()
