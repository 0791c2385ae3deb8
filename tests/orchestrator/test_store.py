"""SQLite persistence of group lock records."""

from __future__ import annotations

import pathlib
import random
import sqlite3
import time

import pytest

from tslice.orchestrator import policy
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.orchestrator.persistence import store as st
from tslice.orchestrator.policy import spec as policy_spec
from tslice.server import sqlite_wal

NODES = [("node-a", "127.0.0.1:9001"), ("node-b", "127.0.0.1:9002")]


def whole(record: records.LockRecord) -> records.Changes:
    """A record written whole (as a group's first save writes what it started from)."""
    return records.Changes(row=record.row, queued=record.queue, footprints=record.footprints)


class Saver:
    """Saves a lock as its group's executor does: what changed since the last save."""

    def __init__(self, store: st.Store, group: str, lock: lk.GroupLock) -> None:
        self.store, self.group, self.lock = store, group, lock
        self.saved: records.GroupRow | None = None

    async def save(self, nodes: list[tuple[str, str]] = NODES) -> records.LockRecord:
        changes = self.lock.changes(self.saved)
        if changes is not None:
            await self.store.save(self.group, nodes=nodes, changes=changes)
            self.saved = changes.row or self.saved
        return self.lock.record()


async def test_save_and_load_round_trip(tmp_path: pathlib.Path) -> None:
    s = await st.Store.open(tmp_path)
    g = lk.GroupLock()
    g.on_acquire("a", footprint_bytes=10, now=0)
    g.on_switch_done(epoch=1, restored=False, now=0)
    g.on_acquire("b", footprint_bytes=20, now=1)
    g.on_acquire("c", now=1)
    saver = Saver(s, "g1", g)
    await saver.save()
    g.on_yield("a", now=2)  # switch a -> b: intent
    r2 = await saver.save()
    await s.save("g2", nodes=NODES[:1], changes=whole(records.LockRecord.empty()))
    await s.close()

    s2 = await st.Store.open(tmp_path)
    loaded = await s2.load()
    await s2.close()
    assert set(loaded) == {"g1", "g2"}
    nodes, rec = loaded["g1"]
    assert nodes == NODES
    assert rec == r2
    assert rec.intent == records.IntentRecord("a", "b", 2, 2)
    assert [q.job for q in rec.queue] == ["c"]
    assert dict(rec.footprints) == {"a": 10, "b": 20}
    assert loaded["g2"][1] == records.LockRecord.empty()


async def test_intent_cleared_after_switch(tmp_path: pathlib.Path) -> None:
    s = await st.Store.open(tmp_path)
    g = lk.GroupLock()
    g.on_acquire("a", now=0)
    saver = Saver(s, "g", g)
    await saver.save()
    g.on_switch_done(epoch=1, restored=False, now=0)
    await saver.save()
    (_, rec) = (await s.load())["g"]
    await s.close()
    assert rec.intent is None and rec.holder == "a" and rec.resident == "a"
    assert rec.switch_count == 1 and rec.grant_epoch == 1


async def test_database_uses_wal(tmp_path: pathlib.Path) -> None:
    s = await st.Store.open(tmp_path)
    await s.close()
    conn = sqlite3.connect(tmp_path / "orchestrator.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


async def test_unwritable_state_dir_is_a_clear_error(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(st.StoreError, match="--state-dir"):
        await st.Store.open(blocker / "sub")


@pytest.mark.parametrize("scheduling", ["fifo", "priority"])
async def test_every_saved_record_loads_back_after_random_changes(
    tmp_path: pathlib.Path, scheduling: str
) -> None:
    """Saves write only what changed since the last one; what loads is the last record
    (with priority, the waits' beginnings too: its aging bound holds across a restart)."""
    rng = random.Random(7)
    s = await st.Store.open(tmp_path)
    spec = policy_spec.PrioritySpec() if scheduling == "priority" else policy_spec.FifoSpec()
    g = lk.GroupLock(policy=policy.build(spec))
    saver = Saver(s, "g", g)
    jobs = ["a", "b", "c", "d"]
    for step in range(300):
        job = rng.choice(jobs)
        move = rng.random()
        if g.switching is not None and move < 0.3:
            g.on_switch_done(epoch=g.switching.epoch, restored=rng.random() < 0.5, now=step)
        elif move < 0.6:
            g.on_acquire(job, footprint_bytes=rng.randrange(4) * 10, now=step)
        elif move < 0.8:
            g.on_yield(job, now=step)
        else:
            g.on_cancel(job, now=step)
        record = await saver.save()
        if step % 50 == 49:
            (_, loaded) = (await s.load())["g"]
            assert loaded == record, step
            if scheduling == "priority" and record.queue:
                assert all(q.queued_at is not None for q in loaded.queue)
    await s.close()


async def _largest_wal_over_saves(directory: pathlib.Path, saves: int) -> int:
    # Saves back to back, as under load: checkpoints run beside them and must keep up.
    s = await st.Store.open(directory)
    wal = directory / "orchestrator.db-wal"
    largest = 0
    try:
        for i in range(saves):
            queue = tuple(records.QueueRecord(f"job-{k}", k, 0) for k in range(i % 7))
            rec = records.LockRecord(f"h{i % 3}", "r", i, i, i + 10, queue, None, (), 0)
            await s.save(f"g{i % 50}", nodes=NODES, changes=whole(rec))
            if i % 100 == 0:
                largest = max(largest, wal.stat().st_size if wal.exists() else 0)
    finally:
        await s.close()
    return largest


async def test_the_wal_stays_bounded_under_steady_writes(tmp_path: pathlib.Path) -> None:
    largest = await _largest_wal_over_saves(tmp_path, 20_000)
    # 20,000 saves write some 240 MB of WAL frames; the file stays near its 16 MiB limit.
    assert largest <= 40 * 1024 * 1024, f"the WAL grew to {largest / 2**20:.0f} MiB"


async def test_the_wal_stays_bounded_when_checkpoints_fall_behind(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow disk (CI's, once): each checkpoint takes 0.2 s while the writer goes on.
    # Without the writer's own check the WAL reached 4-5 times its limit.
    limit = 2 * 1024 * 1024

    class SlowDisk(sqlite_wal.WalCheckpointer):
        def __init__(self, path: pathlib.Path) -> None:
            super().__init__(path, limit_bytes=limit)

        def _checkpoint(self, mode: str) -> None:
            time.sleep(0.2)
            super()._checkpoint(mode)

    monkeypatch.setattr(st.sqlite_wal, "WalCheckpointer", SlowDisk)
    largest = await _largest_wal_over_saves(tmp_path, 6_000)
    # Twice the limit, plus the commits of one round between the writer's checks.
    assert largest <= 2 * limit + 4 * 1024 * 1024, f"the WAL grew to {largest / 2**20:.1f} MiB"


async def test_the_drain_mark_is_saved_and_loads_back(tmp_path: pathlib.Path) -> None:
    s = await st.Store.open(tmp_path)
    g = lk.GroupLock()
    g.on_drain(True, now=0)
    r1 = await Saver(s, "g", g).save()
    await s.close()
    s2 = await st.Store.open(tmp_path)
    (_, rec) = (await s2.load())["g"]
    g.on_drain(False, now=1)
    await Saver(s2, "g", g).save()
    (_, resumed) = (await s2.load())["g"]
    await s2.close()
    assert rec.draining and rec == r1
    assert not resumed.draining


async def test_a_database_from_before_drains_opens_with_no_group_drained(
    tmp_path: pathlib.Path,
) -> None:
    s = await st.Store.open(tmp_path)
    await s.save("g", nodes=NODES, changes=whole(records.LockRecord.empty()))
    await s.close()
    rec = await _loaded_without(tmp_path, "draining")
    assert not rec.draining


async def _loaded_without(tmp_path: pathlib.Path, column: str) -> records.LockRecord:
    """Group g's record, loaded from the database as an older release wrote it: without
    ``column`` (the store adds it on open)."""
    conn = sqlite3.connect(tmp_path / "orchestrator.db")
    conn.execute(f"ALTER TABLE groups DROP COLUMN {column}")
    conn.close()
    s = await st.Store.open(tmp_path)
    (_, rec) = (await s.load())["g"]
    await s.close()
    return rec


async def test_evictions_are_saved_and_load_back_also_from_an_older_database(
    tmp_path: pathlib.Path,
) -> None:
    s = await st.Store.open(tmp_path)
    g = lk.GroupLock()
    g.on_acquire("a", now=0)
    g.on_switch_done(epoch=1, restored=False, now=0)
    g.on_evict("a", why="evicted from group 'g' by an administrator: stuck", now=1)
    saved = await Saver(s, "g", g).save()
    await s.close()
    s2 = await st.Store.open(tmp_path)
    (_, rec) = (await s2.load())["g"]
    await s2.close()
    assert rec == saved and dict(rec.evictions) == {"a": g.eviction("a")} and g.eviction("a")
    old = await _loaded_without(tmp_path, "evictions")
    assert old.evictions == () and old.holder == rec.holder


async def test_an_arrival_builds_and_writes_its_own_entry_whatever_the_queue_length(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 21 §4: an arrival cost O(queue), 9 ms at 5,000 waiters: every command rebuilt
    the group's whole record (``LockState.record()``, an entry per waiter) to diff it with
    the saved one. Now a command builds the entries it changed, and writes those."""
    s = await st.Store.open(tmp_path)
    g = lk.GroupLock()
    g.on_acquire("holder", now=0)
    g.on_switch_done(epoch=1, restored=False, now=0)
    for i in range(2000):
        g.on_acquire(f"w{i}", now=1)
    saver = Saver(s, "g", g)
    await saver.save()
    assert s._conn is not None
    before = s._conn.total_changes
    built: list[str] = []
    entry_record = lk.GroupLock._queue_record

    def counted(lock: lk.GroupLock, entry: object) -> records.QueueRecord:
        built.append(getattr(entry, "job", ""))
        return entry_record(lock, entry)  # type: ignore[arg-type]

    monkeypatch.setattr(lk.GroupLock, "_queue_record", counted)
    g.on_acquire("late", now=2)
    changes = g.changes(saver.saved)
    assert built == ["late"]  # (the whole record built 2,001)
    monkeypatch.undo()
    assert changes is not None and [q.job for q in changes.queued] == ["late"]
    await s.save("g", nodes=NODES, changes=changes)
    assert s._conn.total_changes - before <= 2  # its queue row (and the group's row)
    await s.close()
    s2 = await st.Store.open(tmp_path)
    (_, rec) = (await s2.load())["g"]
    await s2.close()
    assert len(rec.queue) == 2001 and rec.queue[-1].job == "late"
