"""A grant nobody received (a switch rolled forward after a restart granted a job whose
Acquire died with the old process) survives further restarts as *unclaimed*, with the
wall-clock deadline by which the job must come back: a restart neither forgets it (a
leaseless ghost holder) nor extends it. The real-process form of the bug is
tests/chaos/test_unclaimed_grant_ghost.py."""

from __future__ import annotations

import pathlib
import sqlite3

from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.orchestrator.persistence import store as st


def whole(record: records.LockRecord) -> records.Changes:
    """A record written whole (as a group's first save writes what it started from)."""
    return records.Changes(row=record.row, queued=record.queue, footprints=record.footprints)


GRACE_S = 10.0
NODES = [("node-a", "127.0.0.1:9001")]


def _unclaimed_holder_b() -> records.LockRecord:
    """A restart mid-switch a -> b (b leaseless, its Acquire gone), the switch rolled
    forward at monotonic 100 = wall 1000: b holds, its grant undelivered."""
    g = lk.GroupLock(reattach_grace_s=GRACE_S)
    g.on_acquire("a", now=0)
    g.on_switch_done(epoch=1, restored=False, now=0)
    g.on_acquire("b", now=1)
    g.on_yield("a", now=2)  # the switch a -> b starts; the orchestrator dies
    g = lk.GroupLock.from_record(g.record(), now=100, reattach_grace_s=GRACE_S, wall_now=1000)
    (start,) = g.on_recovered(resident="a", verified=False, rollback=False, now=100)
    assert isinstance(start, act.StartSwitch) and start.to_job == "b"
    assert g.on_switch_done(epoch=start.epoch, restored=True, now=101) == []
    assert g.holder == "b"
    return g.record()


def _restarted(record: records.LockRecord) -> lk.GroupLock:
    """The second restart: 5 s of wall clock later, on a new monotonic clock (at 50)."""
    g = lk.GroupLock.from_record(record, now=50, reattach_grace_s=GRACE_S, wall_now=1005)
    g.on_recovered(resident="b", verified=True, rollback=False, now=50)
    return g


def test_the_unclaimed_grant_is_recorded_with_its_wall_clock_deadline() -> None:
    record = _unclaimed_holder_b()
    assert record.holder == "b" and record.intent is None
    assert record.holder_unclaimed_until == 1000 + GRACE_S


def test_after_a_second_restart_the_unclaimed_holder_loses_the_lock_at_its_first_deadline() -> None:
    g = _restarted(_unclaimed_holder_b())
    # Kept, not extended: wall 1010 is monotonic 55 now, before this restart's grace (60).
    assert g.expiry_deadlines() == [55.0, 50 + GRACE_S]
    assert g.on_acquire("c", now=52)[0] == act.Emit(act.EventKind.QUEUED, "c")
    assert g.on_expire(now=54) == []
    assert g.holder == "b"
    released, start = g.on_expire(now=55)
    assert isinstance(released, act.Emit) and released.kind is act.EventKind.CANCELLED
    assert released.job == "b" and "never claimed" in released.detail
    assert isinstance(start, act.StartSwitch) and (start.from_job, start.to_job) == ("b", "c")


def test_an_unclaimed_holder_that_comes_back_in_time_claims_its_grant() -> None:
    g = _restarted(_unclaimed_holder_b())
    (granted,) = g.on_acquire("b", now=52)
    assert isinstance(granted, act.Granted) and granted.job == "b" and granted.held
    assert g.record().holder_unclaimed_until is None
    assert g.on_expire(now=60) == [] and g.holder == "b"
    # Claimed, it is an ordinary holder after yet another restart.
    again = _restarted(g.record())
    assert again.expiry_deadlines() == [50 + GRACE_S]
    assert again.on_expire(now=60) == [] and again.holder == "b"


def test_a_deadline_that_passed_while_the_orchestrator_was_down_releases_at_once() -> None:
    record = _unclaimed_holder_b()
    g = lk.GroupLock.from_record(record, now=7, reattach_grace_s=GRACE_S, wall_now=2000)
    assert g.expiry_deadlines()[0] < 7
    (released,) = g.on_expire(now=7)  # nothing is promoted while recovering
    assert isinstance(released, act.Emit) and released.job == "b"
    assert g.holder is None


async def test_the_unclaimed_deadline_is_stored_and_an_older_database_migrates(
    tmp_path: pathlib.Path,
) -> None:
    record = _unclaimed_holder_b()
    s = await st.Store.open(tmp_path)
    await s.save("g", nodes=NODES, changes=whole(record))
    await s.close()
    s = await st.Store.open(tmp_path)
    (_, loaded) = (await s.load())["g"]
    await s.close()
    assert loaded == record
    # A database from before unclaimed grants were kept: every holder had got its grant.
    conn = sqlite3.connect(tmp_path / "orchestrator.db")
    conn.execute("ALTER TABLE groups DROP COLUMN holder_unclaimed_until")
    conn.close()
    s = await st.Store.open(tmp_path)
    (_, old) = (await s.load())["g"]
    await s.save("g", nodes=NODES, changes=whole(record))
    (_, saved) = (await s.load())["g"]
    await s.close()
    assert old.holder == "b" and old.holder_unclaimed_until is None
    assert saved == record


def test_a_wall_clock_stepped_back_across_a_restart_keeps_the_grant_no_longer_than_the_grace() -> (
    None
):
    """The clock was set back an hour while the orchestrator was down: the deadline on disk
    is then an hour away. What is left is capped at the re-attach grace (it was kept for
    about an hour, a leaseless ghost holder)."""
    record = _unclaimed_holder_b()
    g = lk.GroupLock.from_record(record, now=50, reattach_grace_s=GRACE_S, wall_now=1000 - 3600)
    assert max(g.expiry_deadlines()) == 50 + GRACE_S
    # The capped deadline is what is persisted: another restart does not bring the hour back.
    assert g.record().holder_unclaimed_until == 1000 - 3600 + GRACE_S
    g.on_recovered(resident="b", verified=True, rollback=False, now=50)
    (released,) = g.on_expire(now=50 + GRACE_S)
    assert isinstance(released, act.Emit) and released.job == "b"
    assert "never claimed" in released.detail and g.holder is None


# ---- a grant made to the parts of a set not answered yet (issue 21 §3) --------------------


def _granted_to_a_set_part(g: lk.GroupLock, now: float) -> int:
    """j's set part is granted (the driver tells the lock it was a set's part)."""
    start = g.on_acquire("j", now=now)[-1]  # (the gate is the driver's: a free group)
    assert isinstance(start, act.StartSwitch)
    (granted,) = g.on_switch_done(epoch=start.epoch, restored=False, now=now)
    assert isinstance(granted, act.Granted)
    g.on_granted_to_set_parts("j", epoch=granted.epoch, parts=1, now=now)
    return granted.epoch


def test_a_grant_only_a_set_s_part_received_is_unclaimed_on_disk_until_the_set_is_answered() -> (
    None
):
    g = lk.GroupLock(reattach_grace_s=GRACE_S, wall_offset_s=1000)
    epoch = _granted_to_a_set_part(g, now=5)
    assert g.provisional and g.holder == "j"
    assert g.record().holder_unclaimed_until == 1000 + 5 + GRACE_S
    # Live, nothing expires it: its part is attached (the set waits for other groups).
    assert g.on_expire(now=5 + GRACE_S + 1) == [] and g.holder == "j"
    g.on_set_answered("j", epoch=epoch)
    assert not g.provisional and g.record().holder_unclaimed_until is None


def test_after_a_restart_an_unanswered_set_part_s_grant_ends_at_the_grace_unless_claimed() -> None:
    g = lk.GroupLock(reattach_grace_s=GRACE_S, wall_offset_s=1000)
    _granted_to_a_set_part(g, now=5)
    # The restart comes 3 s later (wall 1008, a new monotonic clock at 50): the grant's
    # deadline (wall 1015) is monotonic 57.
    back = lk.GroupLock.from_record(g.record(), now=50, reattach_grace_s=GRACE_S, wall_now=1008)
    back.on_recovered(resident="j", verified=True, rollback=False, now=50)
    assert back.on_expire(now=56) == [] and back.holder == "j"
    (released,) = back.on_expire(now=57)
    assert isinstance(released, act.Emit) and released.kind is act.EventKind.CANCELLED
    assert back.holder is None


def test_a_plain_acquire_among_the_receivers_claims_the_grant() -> None:
    g = lk.GroupLock(reattach_grace_s=GRACE_S, wall_offset_s=1000)
    _granted_to_a_set_part(g, now=5)
    (again,) = g.on_acquire("j", now=6)  # another process of j: answered at once
    assert isinstance(again, act.Granted) and again.held
    assert not g.provisional and g.record().holder_unclaimed_until is None
    # The set then fails: its share goes back, the grant stands (j was told).
    assert g.on_undelivered("j", epoch=again.epoch, now=7) == []
    assert g.holder == "j"
