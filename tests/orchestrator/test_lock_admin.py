"""The lock's administrator events: evicting a holder or a waiter, draining and resuming."""

from __future__ import annotations

from tests.orchestrator.locks import locked
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.rpc import refusals

WHY = "evicted from group 'g' by an administrator: stuck"


def test_evicting_the_holder_releases_it_like_a_lapsed_lease_and_switches_to_the_waiter() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    out = g.on_evict("a", why=WHY, now=2)
    assert out.role is decisions.Role.HOLDER and out.next_job == "b"
    emitted, switch = out.actions
    assert isinstance(emitted, decisions.Emit) and emitted.kind is decisions.EventKind.YIELDED
    assert emitted.detail == WHY
    assert isinstance(switch, decisions.StartSwitch) and (switch.from_job, switch.to_job) == (
        "a",
        "b",
    )
    # Its late Yield is told why it lost the lock, naming the new holder.
    late = g.on_yield("a", now=3)
    assert not late.ok and late.holder == "b" and late.evicted == WHY


def test_an_evicted_holder_with_nobody_waiting_stays_resident_and_its_yield_is_refused() -> None:
    g = locked()
    out = g.on_evict("a", why=WHY, now=1)
    assert out.role is decisions.Role.HOLDER and out.next_job == ""
    assert g.holder is None and g.phase() is lk.Phase.IDLE_YIELDED
    late = g.on_yield("a", now=2)
    assert not late.ok and late.holder is None and late.evicted == WHY
    # Acquiring again forgets the eviction.
    g.on_acquire("a", now=3)
    assert g.eviction("a") == "" and g.on_yield("a", now=4).ok


def test_an_evicted_holder_asking_again_is_still_told_why_until_it_is_granted_again() -> None:
    """Another process of the job asks again while b holds: a late Yield of the evicted
    process must still name the eviction (found by the grant-promise runs)."""
    g = locked()
    g.on_acquire("b", now=1)
    g.on_evict("a", why=WHY, now=2)
    g.on_acquire("a", now=3)  # a waits behind b
    late = g.on_yield("a", now=4)
    assert not late.ok and late.holder == "b" and late.evicted == WHY
    g.on_cancel("a", now=5)
    assert g.eviction("a") == WHY


def test_evicting_the_target_of_the_switch_in_progress_aborts_its_acquire() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)  # switch a -> b starts
    out = g.on_evict("b", why=WHY, now=3)
    assert out.role is decisions.Role.HOLDER
    (abort,) = [a for a in out.actions if isinstance(a, decisions.Abort)]
    assert (abort.job, abort.message, abort.code) == ("b", WHY, refusals.Code.ABORTED)
    assert g.holder is None
    # The switch finishes; nobody is granted.
    assert g.on_switch_done(epoch=g.grant_epoch, restored=False, now=4) == []
    assert g.holder is None and g.resident == "b"


def test_evicting_a_waiter_aborts_its_acquire_and_it_leaves_the_queue() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    g.on_acquire("c", now=1)
    out = g.on_evict("b", why=WHY, now=2)
    assert out.role is decisions.Role.WAITER
    abort, emitted = out.actions
    assert isinstance(abort, decisions.Abort) and abort.code is refusals.Code.ABORTED
    assert abort.message == WHY
    assert isinstance(emitted, decisions.Emit) and emitted.kind is decisions.EventKind.CANCELLED
    assert g.waiting_jobs == ["c"] and g.holder == "a"


def test_evicting_a_job_that_neither_holds_nor_waits_changes_nothing() -> None:
    g = locked()
    before = g.record()
    out = g.on_evict("z", why=WHY, now=1)
    assert out.role is None and out.actions == [] and g.record() == before


def test_a_drained_group_grants_no_new_turn_until_resumed() -> None:
    g = locked()
    g.on_acquire("b", now=1)
    assert g.on_drain(True, now=2) == []
    # The holder keeps its turn; its yield hands on nothing.
    out = g.on_yield("a", now=3)
    assert out.ok and [a for a in out.actions if isinstance(a, decisions.StartSwitch)] == []
    assert g.waiting_jobs == ["b"] and g.holder is None
    # Not even a zero-cost re-acquire of the resident, and new Acquires are queued.
    assert not [a for a in g.on_acquire("a", now=4) if isinstance(a, decisions.Granted)]
    assert g.waiting_jobs == ["b", "a"]
    (switch,) = g.on_drain(False, now=5)
    assert isinstance(switch, decisions.StartSwitch) and switch.to_job == "b"


def test_the_drain_mark_is_part_of_the_record_and_comes_back_from_it() -> None:
    g = locked()
    g.on_drain(True, now=1)
    record = g.record()
    assert record.draining and record != locked().record()
    again = lk.GroupLock.from_record(record, now=2)
    assert again.draining
    assert not lk.GroupLock.from_record(records.LockRecord.empty(), now=2).draining


def test_an_eviction_is_still_named_after_a_restart() -> None:
    """The reason lived in memory only: after an orchestrator restart the evicted job's
    late Yield was refused without it (found by the long grant-promise run)."""
    g = locked()
    g.on_acquire("b", now=1)
    g.on_evict("a", why=WHY, now=2)
    back = lk.GroupLock.from_record(g.record(), now=3)
    late = back.on_yield("a", now=4)
    assert not late.ok and late.evicted == WHY
    assert back.eviction("b") == ""
