"""Group commit: the saves of one event-loop turn share one transaction, none is
acknowledged before its commit, and a save that cannot be written fails alone."""

from __future__ import annotations

import asyncio
import pathlib
import sqlite3

import pytest

from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.persistence import records
from tslice.orchestrator.persistence import store as st


def whole(record: records.LockRecord) -> records.Changes:
    """A record written whole (as a group's first save writes what it started from)."""
    return records.Changes(row=record.row, queued=record.queue, footprints=record.footprints)


NODES = [("node-a", "127.0.0.1:9001")]


def _held_by(job: str) -> records.LockRecord:
    g = lk.GroupLock()
    g.on_acquire(job, now=0)
    g.on_switch_done(epoch=1, restored=False, now=0)
    return g.record()


def _holders_on_disk(path: pathlib.Path) -> dict[str, str]:
    """What another connection reads: only what was committed."""
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT group_id, holder FROM groups"))
    finally:
        conn.close()


@pytest.mark.parametrize("synchronous", ["normal", "full"])
async def test_saves_of_one_turn_share_one_commit_and_return_once_committed(
    tmp_path: pathlib.Path, synchronous: str
) -> None:
    s = await st.Store.open(tmp_path, synchronous=synchronous)
    commits: list[str] = []
    assert s._conn is not None
    s._conn.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    saves = [s.save(f"g{i}", nodes=NODES, changes=whole(_held_by(f"job-{i}"))) for i in range(5)]
    await asyncio.gather(*saves)
    # Acknowledged: each is on disk for any reader.
    assert _holders_on_disk(s.path) == {f"g{i}": f"job-{i}" for i in range(5)}
    assert commits == ["COMMIT"]
    await s.save("g0", nodes=NODES, changes=whole(_held_by("job-x")))
    assert commits == ["COMMIT", "COMMIT"]  # a save alone still commits at once
    await s.close()


async def test_a_save_that_cannot_be_written_fails_alone_and_holds_no_other_back(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = await st.Store.open(tmp_path)
    write_rows = s._write_rows
    tried: list[str] = []

    def failing(conn: sqlite3.Connection, save: st._Save) -> None:
        tried.append(save.group_id)
        if save.group_id == "g-bad":
            raise sqlite3.OperationalError("disk I/O error")
        write_rows(conn, save)

    monkeypatch.setattr(s, "_write_rows", failing)
    outcomes = await asyncio.gather(
        s.save("g-good", nodes=NODES, changes=whole(_held_by("a"))),
        s.save("g-bad", nodes=NODES, changes=whole(_held_by("b"))),
        s.save("g-also", nodes=NODES, changes=whole(_held_by("c"))),
        return_exceptions=True,
    )
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], st.StoreError)
    assert "g-bad" in str(outcomes[1]) and "disk I/O error" in str(outcomes[1])
    # The batch was tried at once, then each save in its own transaction.
    assert tried == ["g-good", "g-bad", "g-good", "g-bad", "g-also"]
    assert _holders_on_disk(s.path) == {"g-good": "a", "g-also": "c"}
    monkeypatch.setattr(s, "_write_rows", write_rows)
    # The group retries its own save (as the driver does), and it sticks.
    await s.save("g-bad", nodes=NODES, changes=whole(_held_by("b")))
    assert _holders_on_disk(s.path) == {"g-good": "a", "g-bad": "b", "g-also": "c"}
    await s.close()
