"""The pure per-group lock state machine: every rule, then randomized invariant checks."""

from __future__ import annotations

import random

import pytest

from tests.orchestrator.locks import locked
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.rpc import refusals


def kinds(actions: list[decisions.Action]) -> list[str]:
    out = []
    for a in actions:
        if isinstance(a, decisions.Emit):
            out.append(a.kind.value)
        else:
            out.append(type(a).__name__)
    return out


def only(actions: list[decisions.Action], cls: type) -> list:  # type: ignore[type-arg]
    return [a for a in actions if isinstance(a, cls)]


def test_first_acquire_on_empty_group_starts_a_switch_from_nothing() -> None:
    g = lk.GroupLock()
    acts = g.on_acquire("a", footprint_bytes=7, now=0)
    assert kinds(acts) == ["queued", "StartSwitch"]
    sw = only(acts, decisions.StartSwitch)[0]
    assert (sw.from_job, sw.to_job, sw.epoch, sw.footprint_bytes) == (None, "a", 1, 7)
    assert g.phase() is lk.Phase.SWITCHING and g.holder == "a" and g.loaded_job is None
    acts = g.on_switch_done(epoch=1, restored=False, now=2)
    (grant,) = only(acts, decisions.Granted)
    assert (grant.job, grant.epoch, grant.restored, grant.waited_s) == ("a", 1, False, 2)
    assert g.phase() is lk.Phase.LOCKED and g.loaded_job == "a" and g.switch_count == 1


def test_holder_reacquire_returns_at_once_with_the_same_epoch() -> None:
    g = locked()
    (grant,) = g.on_acquire("a", now=1)
    assert isinstance(grant, decisions.Granted) and grant.zero_cost and grant.epoch == 1


def test_yield_with_nobody_waiting_defers_the_snapshot_and_reacquire_is_zero_cost() -> None:
    g = locked()
    out = g.on_yield("a", now=1)
    assert out.ok and out.snapshot_deferred and out.pending_waiters == 0
    assert kinds(out.actions) == ["yielded"]
    assert g.phase() is lk.Phase.IDLE_YIELDED and g.loaded_job == "a" and g.holder is None
    (grant,) = g.on_acquire("a", now=2)
    assert isinstance(grant, decisions.Granted) and grant.zero_cost and not grant.restored
    assert grant.epoch == 2  # a new grant, no agent touched
    assert g.phase() is lk.Phase.LOCKED


def test_yield_with_a_waiter_switches_to_it_and_reports_no_deferral() -> None:
    g = locked()
    assert kinds(g.on_acquire("b", now=1)) == ["queued"]
    assert g.waiting_jobs == ["b"]
    out = g.on_yield("a", now=2)
    assert out.ok and not out.snapshot_deferred and out.pending_waiters == 1
    (sw,) = only(out.actions, decisions.StartSwitch)
    assert (sw.from_job, sw.to_job, sw.epoch) == ("a", "b", 2)
    (grant,) = only(g.on_switch_done(epoch=2, restored=True, now=5), decisions.Granted)
    assert grant.job == "b" and grant.restored and grant.waited_s == 4


def test_yield_by_another_job_is_refused_and_noop_yield_is_ok() -> None:
    g = locked()
    out = g.on_yield("b", now=1)
    assert not out.ok and out.holder == "a"
    assert g.on_yield("a", now=1).ok
    again = g.on_yield("a", now=2)
    assert again.ok and again.actions == [] and again.snapshot_deferred
    other = g.on_yield("b", now=2)
    assert other.ok and not other.snapshot_deferred


def test_resident_reacquire_queues_when_someone_waits() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)  # switch a -> b
    acts = g.on_acquire("a", now=3)
    assert kinds(acts) == ["queued"]


def test_cancelled_waiter_leaves_at_once_and_is_never_granted() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_acquire("c", now=2)
    assert kinds(g.on_cancel("b", now=3)) == ["cancelled"]
    assert g.waiting_jobs == ["c"]
    out = g.on_yield("a", now=4)
    (sw,) = only(out.actions, decisions.StartSwitch)
    assert sw.to_job == "c"


def test_concurrent_acquires_of_one_job_share_a_slot_with_refcount() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    assert g.on_acquire("b", now=1) == []
    assert g.waiting_jobs == ["b"]
    assert g.on_cancel("b", now=2) == []  # one RPC left: still waiting
    assert g.waiting_jobs == ["b"]
    assert kinds(g.on_cancel("b", now=2)) == ["cancelled"]
    assert g.waiting_jobs == []


def test_target_cancelling_during_its_switch_finishes_then_yields() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    assert kinds(g.on_cancel("b", now=3)) == ["cancelled"]
    assert g.phase() is lk.Phase.SWITCHING and g.holder is None
    acts = g.on_switch_done(epoch=2, restored=False, now=4)
    assert only(acts, decisions.Granted) == []
    assert g.phase() is lk.Phase.IDLE_YIELDED and g.resident == "b" and g.loaded_job == "b"


def test_target_cancelling_during_its_switch_hands_on_to_next_waiter() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    g.on_acquire("c", now=2.5)
    g.on_cancel("b", now=3)
    acts = g.on_switch_done(epoch=2, restored=False, now=4)
    (sw,) = only(acts, decisions.StartSwitch)
    assert (sw.from_job, sw.to_job, sw.epoch) == ("b", "c", 3)


def test_target_reattaching_during_its_switch_gets_the_grant() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    g.on_cancel("b", now=3)
    assert g.on_acquire("b", now=3.5) == []
    (grant,) = only(g.on_switch_done(epoch=2, restored=False, now=4), decisions.Granted)
    assert grant.job == "b"


def test_target_yielding_during_its_switch_aborts_its_acquires() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    out = g.on_yield("b", now=3)
    assert out.ok and out.snapshot_deferred
    assert kinds(out.actions) == ["Abort", "yielded"]
    assert only(g.on_switch_done(epoch=2, restored=False, now=4), decisions.Granted) == []
    assert g.phase() is lk.Phase.IDLE_YIELDED


def test_undelivered_grant_is_released_like_a_yield() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=1)
    g.on_acquire("b", now=1)  # second RPC of b
    g.on_switch_done(epoch=2, restored=False, now=2)
    assert g.on_undelivered("b", epoch=2, now=3) == []  # the other RPC may have got it
    assert kinds(g.on_undelivered("b", epoch=2, now=3)) == ["cancelled"]
    assert g.holder is None and g.phase() is lk.Phase.IDLE_YIELDED


def test_undelivered_of_an_old_epoch_is_ignored() -> None:
    g = locked()
    g.on_yield("a", now=1)
    g.on_acquire("a", now=1)  # epoch 2
    assert g.on_undelivered("a", epoch=1, now=2) == []
    assert g.holder == "a"


def test_switch_failed_leaves_group_unverified_so_resident_reacquire_switches() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=1)
    g.on_cancel("b", now=2)
    g.on_switch_failed(epoch=2, detail="node-x unreachable", now=3)
    assert g.holder is None and not g.verified and "abandoned" in g.detail
    acts = g.on_acquire("b", now=4)
    assert kinds(acts) == ["queued", "StartSwitch"]


def test_record_round_trip_and_recovery_detaches_queue() -> None:
    g = locked()
    g.on_acquire("b", footprint_bytes=5, now=1)
    g.on_acquire("c", now=1)
    rec = g.record()
    assert rec.holder == "a" and [q.job for q in rec.queue] == ["b", "c"] and rec.intent is None
    r = lk.GroupLock.from_record(rec, now=100, reattach_grace_s=30)
    assert r.recovering and r.waiting_jobs == ["b", "c"] and r.attached_waiters == 0
    assert r.footprint("b") == 5
    # holder keeps the lock: its re-acquire returns at once
    assert isinstance(r.on_acquire("a", now=101)[0], decisions.Granted)
    # c re-attaches during recovery: nothing is promoted until recovery is done
    assert kinds(r.on_acquire("c", now=101)) == ["queued"]  # re-attached, not promoted yet
    assert r.on_yield("a", now=102).ok
    acts = r.on_recovered(resident="a", verified=True, rollback=False, now=103)
    (sw,) = only(acts, decisions.StartSwitch)
    assert sw.to_job == "c"  # b is detached: skipped, keeps its place
    assert r.waiting_jobs == ["b"]
    # b never comes back: dropped after the grace
    assert r.on_expire(now=129) == []
    assert kinds(r.on_expire(now=130)) == ["cancelled"]
    assert r.waiting_jobs == []


def test_recovered_intent_roll_back_puts_target_back_at_head() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_acquire("c", now=1)
    g.on_yield("a", now=2)  # switch a -> b in progress
    rec = g.record()
    assert rec.intent == records.IntentRecord("a", "b", 2, 2) and rec.holder is None
    r = lk.GroupLock.from_record(rec, now=50)
    assert r.phase() is lk.Phase.SWITCHING
    r.on_acquire("c", now=51)
    acts = r.on_recovered(resident="a", verified=True, rollback=True, now=52)
    assert r.waiting_jobs[0] == "b"
    (sw,) = only(acts, decisions.StartSwitch)  # c is attached, b detached
    assert (sw.from_job, sw.to_job) == ("a", "c")


def test_recovered_intent_roll_forward_keeps_grant_for_reattaching_target() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    r = lk.GroupLock.from_record(g.record(), now=50, reattach_grace_s=30)
    acts = r.on_recovered(resident=None, verified=False, rollback=False, now=51)
    (sw,) = only(acts, decisions.StartSwitch)
    assert sw.recovered and sw.to_job == "b" and sw.epoch == 2
    assert r.on_switch_done(epoch=2, restored=True, now=52) == []
    assert r.holder == "b" and r.phase() is lk.Phase.LOCKED
    (grant,) = r.on_acquire("b", now=53)
    assert isinstance(grant, decisions.Granted) and grant.epoch == 2
    assert r.on_expire(now=100) == []  # confirmed: keeps the lock


def test_recovered_grant_released_when_target_never_returns() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)
    r = lk.GroupLock.from_record(g.record(), now=50, reattach_grace_s=30)
    r.on_recovered(resident=None, verified=False, rollback=False, now=51)
    r.on_switch_done(epoch=2, restored=True, now=52)
    assert r.wants_switch(now=60) is False
    assert kinds(r.on_expire(now=80)) == ["cancelled"]
    assert r.holder is None and r.phase() is lk.Phase.IDLE_YIELDED


def test_observed_mismatch_makes_resident_reacquire_switch() -> None:
    g = locked()
    g.on_yield("a", now=1)
    g.on_observed(epoch=g.grant_epoch, resident="a", running_everywhere=False)
    assert g.loaded_job is None
    assert kinds(g.on_acquire("a", now=2)) == ["queued", "StartSwitch"]


# ---- randomized invariant checks ----------------------------------------------------------


class Model:
    """Drives a GroupLock like the async driver would and checks invariants on every step."""

    def __init__(self, rng: random.Random, jobs: list[str]) -> None:
        self.rng = rng
        self.jobs = jobs
        self.g = lk.GroupLock(reattach_grace_s=5)
        self.rpcs: dict[str, int] = dict.fromkeys(jobs, 0)  # Acquire RPCs not answered yet
        self.told: dict[str, int] = {}  # job -> epoch it was told it holds
        self.receivers = 0  # RPCs that received the current grant
        self.undelivered = 0
        self.wait_order: list[str] = []  # jobs with RPCs out, in the order they started waiting
        self.now = 0.0
        self.grants = 0

    def first_waiting(self) -> str | None:
        return next((j for j in self.wait_order if self.rpcs[j] > 0), None)

    def apply(self, actions: list[decisions.Action]) -> None:
        for a in actions:
            if isinstance(a, decisions.Granted):
                assert self.rpcs[a.job] > 0, f"granted {a.job} with no Acquire RPC waiting"
                others = [j for j in self.told if j != a.job]
                assert not others, f"{a.job} granted while {others} hold the group"
                if a.job in self.told:
                    self.receivers += self.rpcs[a.job]
                else:
                    self.receivers, self.undelivered = self.rpcs[a.job], 0
                    self.wait_order.remove(a.job)
                self.rpcs[a.job] = 0
                self.told[a.job] = a.epoch
                self.grants += 1
            elif isinstance(a, decisions.StartSwitch):
                assert a.to_job == self.first_waiting(), ("FIFO", a.to_job, self.wait_order)
            elif isinstance(a, decisions.Abort):
                self.rpcs[a.job] = 0
                self.wait_order.remove(a.job)

    def check(self) -> None:
        g = self.g
        assert len(self.told) <= 1
        for job in self.told:
            assert g.holder == job, (job, g.holder)
        waiting = g.waiting_jobs
        assert len(waiting) == len(set(waiting))
        assert g.holder not in waiting
        if g.phase() is lk.Phase.LOCKED:
            assert g.holder is not None and g.holder in self.told
        if g.holder is None and g.switching is None:
            assert g.attached_waiters == 0, "a live waiter was left behind on a free group"
        live = {j for j, n in self.rpcs.items() if n > 0}
        sw = g.switching
        queued_live = {j for j in live if j not in self.told and (sw is None or sw.to_job != j)}
        assert queued_live <= set(waiting), (queued_live, waiting)

    def step(self) -> None:
        rng, g = self.rng, self.g
        self.now += rng.random()
        job = rng.choice(self.jobs)
        op = rng.random()
        sw = g.switching
        if op < 0.35:
            if job not in self.told and job not in self.wait_order:
                self.wait_order.append(job)
            self.rpcs[job] += 1
            self.apply(g.on_acquire(job, now=self.now))
        elif op < 0.5 and self.rpcs[job] > 0:
            self.rpcs[job] -= 1
            if self.rpcs[job] == 0:
                self.wait_order.remove(job)
            self.apply(g.on_cancel(job, now=self.now))
        elif op < 0.75:
            holder = g.holder
            out = g.on_yield(job, now=self.now)
            if job in self.told:
                assert out.ok and out.snapshot_deferred == (out.pending_waiters == 0)
                del self.told[job]
            elif holder is not None and holder != job:
                assert not out.ok and out.holder == holder
            else:
                assert out.ok
            self.apply(out.actions)
        elif op < 0.95 and sw is not None:
            self.apply(g.on_switch_done(epoch=sw.epoch, restored=rng.random() < 0.5, now=self.now))
        elif sw is not None and not g.wants_switch(now=self.now):
            self.apply(g.on_switch_failed(epoch=sw.epoch, detail="boom", now=self.now))
        elif job in self.told:
            # one receiver of the grant was cancelled before the reply went out
            self.undelivered += 1
            acts = g.on_undelivered(job, epoch=self.told[job], now=self.now)
            if self.undelivered >= self.receivers:
                assert kinds(acts)[:1] == ["cancelled"]
                del self.told[job]
            else:
                assert acts == []
            self.apply(acts)
        self.check()

    def drain(self) -> None:
        """Everybody still waiting must eventually be granted if holders keep yielding."""
        for _ in range(10 * len(self.jobs) + 10):
            sw = self.g.switching
            if sw is not None:
                self.apply(self.g.on_switch_done(epoch=sw.epoch, restored=False, now=self.now))
            elif self.told:
                (job,) = self.told
                del self.told[job]
                self.apply(self.g.on_yield(job, now=self.now).actions)
            elif not any(self.rpcs.values()):
                return
            self.check()
        pytest.fail(f"live waiters never granted: {self.rpcs}")


@pytest.mark.parametrize("seed", range(200))
def test_randomized_sequences_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    m = Model(rng, [f"j{i}" for i in range(rng.randint(2, 5))])
    for _ in range(200):
        m.step()
    m.drain()
    assert m.grants > 0


def test_switch_failed_while_target_waits_again_restarts_it_first() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_acquire("c", now=1)
    g.on_yield("a", now=1)  # switch a -> b
    acts = g.on_switch_failed(epoch=2, detail="boom", now=2)  # b still attached
    (sw,) = only(acts, decisions.StartSwitch)
    assert (sw.to_job, sw.epoch) == ("b", 3) and g.waiting_jobs == ["c"]


def test_a_degraded_node_ends_the_switch_and_fails_its_own_target_too() -> None:
    lock = lk.GroupLock()
    lock.on_acquire("a", now=0.0)
    lock.on_acquire("b", now=0.0)
    switching = lock.switching
    assert switching is not None
    actions = lock.on_degraded(epoch=switching.epoch, cause="no", reason="n degraded", now=1.0)
    unavailable = refusals.Code.UNAVAILABLE
    assert decisions.Abort("a", "n degraded", code=unavailable) in actions
    assert decisions.Abort("b", "n degraded", code=unavailable) in actions
    assert not any(isinstance(a, decisions.StartSwitch) for a in actions)
    assert (lock.switching, lock.waiting_jobs, lock.holder) == (None, [], None)
