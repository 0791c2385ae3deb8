"""The agent's store on disk: one transaction per change, a refused change leaves no
trace, checkpoints off the writer, older files upgraded."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from pathlib import Path

import pytest

from tslice.agent.jobs import model
from tslice.agent.state import schema, store
from tslice.rpc import refusals


def job(job_id: str, state: model.State = model.State.RUNNING) -> model.Job:
    return model.Job(job_id=job_id, group="g", state=state, backend="noop")


def operation(
    op_id: str, job_id: str, status: model.OpStatus = model.OpStatus.PENDING
) -> model.Operation:
    return model.Operation(
        op_id=op_id,
        job_id=job_id,
        kind=model.Kind.SNAPSHOT,
        backend="noop",
        status=status,
        started_at=time.time(),
        finished_at=time.time() if status is not model.OpStatus.PENDING else None,
    )


async def reopened(path: Path) -> store.Store:
    """The records of ``path`` as a restarted agent loads them."""
    db = await store.Store.open(path)
    await db.close()
    return db


async def test_records_survive_a_close_and_the_wal_is_emptied(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path, max_operations=298)
    for i in range(300):  # past the checkpoint interval (checkpoints run beside the writes)
        done = operation(f"op-{i}", "x", model.OpStatus.COMPLETE)
        db.commit(jobs=[job(f"job-{i % 3}")], ops=[done], previous=None)
    db.commit(marks=[model.GrantMark(group="g", epoch=7, job_id="job-1")], previous=None)
    assert db.prune(now=time.time()) == 2  # the oldest two, past the count limit
    await db.close()

    wal = tmp_path / f"{schema.DB_FILE}-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # the last checkpoint truncated it
    with sqlite3.connect(tmp_path / schema.DB_FILE) as conn:
        assert conn.execute("SELECT count(*) FROM operations").fetchone() == (298,)
    loaded = await reopened(tmp_path)
    assert sorted(loaded.jobs) == [("job-0", "g"), ("job-1", "g"), ("job-2", "g")]
    assert len(loaded.operations) == 298 and "op-0" not in loaded.operations
    assert loaded.marks["g"] == model.GrantMark(group="g", epoch=7, job_id="job-1")


async def test_a_refused_commit_changes_nothing_in_memory_or_on_disk(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    db.commit(jobs=[job("job-a")], previous=None)
    bad = model.Job(job_id="job-b", group="g", backend_state={"not json": object()})
    with pytest.raises(refusals.Refused) as refused:
        db.commit(jobs=[bad], previous=None)
    assert refused.value.code is refusals.Code.UNAVAILABLE
    assert "nothing was changed" in refused.value.message
    assert ("job-b", "g") not in db.jobs
    # The writer is still usable, and the refused commit left no trace.
    db.commit(jobs=[job("job-c")], previous=None)
    await db.close()
    assert sorted((await reopened(tmp_path)).jobs) == [("job-a", "g"), ("job-c", "g")]


async def test_a_commit_that_fails_inside_its_transaction_is_rolled_back_whole(
    tmp_path: Path,
) -> None:
    db = await store.Store.open(tmp_path)
    db.commit(jobs=[job("job-a")], previous=None)
    unbindable = dataclasses.replace(operation("op-1", "job-b"), started_at=object())
    with pytest.raises(refusals.Refused):
        # The job row is written first, then the operation row fails to bind.
        db.commit(jobs=[job("job-b")], ops=[unbindable], previous=None)
    assert ("job-b", "g") not in db.jobs and "op-1" not in db.operations
    db.commit(ops=[operation("op-2", "job-a")], previous=None)
    await db.close()
    loaded = await reopened(tmp_path)
    assert sorted(loaded.jobs) == [("job-a", "g")]
    assert sorted(loaded.operations) == ["op-2"]


async def test_a_commit_after_close_is_refused_clearly(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    await db.close()
    with pytest.raises(refusals.Refused, match="closed"):
        db.commit(jobs=[job("job-a")], previous=None)


async def test_one_row_per_job_and_group_and_a_moved_record_is_deleted(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    sampler = model.Job(job_id="job-a", group="sampler", state=model.State.SAVED)
    trainer = model.Job(job_id="job-a", group="trainer", state=model.State.RUNNING)
    ungrouped = model.Job(job_id="job-b", group="", state=model.State.RUNNING)
    db.commit(jobs=[sampler, trainer, ungrouped], previous=None)
    # A record made without a group takes the group of the first request naming one.
    grouped = model.Job(job_id="job-b", group="g", state=model.State.RUNNING)
    db.commit(jobs=[grouped], previous=ungrouped)
    assert ("job-b", "") not in db.jobs
    op = model.Operation(
        op_id="op-1",
        job_id="job-a",
        group="trainer",
        kind=model.Kind.RESTORE,
        backend="noop",
        status=model.OpStatus.COMPLETE,
        started_at=1.0,
        finished_at=2.0,
    )
    db.commit(ops=[op], previous=None)
    await db.close()
    loaded = await reopened(tmp_path)
    assert sorted(loaded.jobs) == [("job-a", "sampler"), ("job-a", "trainer"), ("job-b", "g")]
    assert loaded.jobs[("job-a", "sampler")] == sampler  # every field, read back
    assert loaded.operations["op-1"] == op


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / schema.DB_FILE
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE jobs (job_id TEXT PRIMARY KEY, grp TEXT NOT NULL, state TEXT NOT NULL,
            backend TEXT NOT NULL, choice TEXT NOT NULL, config BLOB NOT NULL,
            footprint_bytes INTEGER NOT NULL, backend_state TEXT NOT NULL, error TEXT NOT NULL,
            operation_id TEXT NOT NULL, device_bytes INTEGER NOT NULL,
            host_bytes INTEGER NOT NULL, previous_state TEXT);
        CREATE TABLE operations (op_id TEXT PRIMARY KEY, job_id TEXT NOT NULL,
            kind TEXT NOT NULL, backend TEXT NOT NULL, status TEXT NOT NULL,
            started_at REAL NOT NULL, finished_at REAL, storage_bytes INTEGER,
            device_bytes INTEGER, error TEXT);
        CREATE TABLE grants (grp TEXT PRIMARY KEY, epoch INTEGER NOT NULL, job_id TEXT NOT NULL);
        INSERT INTO jobs VALUES ('job-a', 'sampler', 'SAVED', 'sim', '', x'', 5, '{}', '',
            'op-1', 0, 5, NULL);
        INSERT INTO operations VALUES ('op-1', 'job-a', 'snapshot', 'sim', 'COMPLETE', 1.0,
            2.0, 5, 5, NULL);
        PRAGMA user_version=1;
        """
    )
    conn.close()

    loaded = asyncio.run(reopened(tmp_path))
    assert list(loaded.jobs) == [("job-a", "sampler")]
    assert loaded.jobs[("job-a", "sampler")].host_bytes == 5
    assert loaded.operations["op-1"].group == ""
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (2,)


async def test_a_leader_term_kept_without_its_leader_reads_as_unnamed(tmp_path: Path) -> None:
    # The table as a release that kept no identity wrote it.
    conn = sqlite3.connect(tmp_path / schema.DB_FILE)
    conn.executescript(
        """
        CREATE TABLE leader_term (id INTEGER PRIMARY KEY CHECK (id = 0), term INTEGER NOT NULL);
        INSERT INTO leader_term VALUES (0, 6);
        """
    )
    conn.close()
    db = await store.Store.open(tmp_path)
    try:
        assert await db.leader_term() == (6, "")
        db.put_leader_term(7, "orch-a")
        assert await db.leader_term() == (7, "orch-a")
    finally:
        await db.close()


async def test_the_wal_stays_bounded_under_steady_writes(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    wal = tmp_path / f"{schema.DB_FILE}-wal"
    largest = 0
    big = model.GrantMark(group="g", epoch=1, job_id="x" * 200)
    try:
        for i in range(20_000):
            db.commit(
                jobs=[job(f"job-{i % 40}")],
                ops=[operation(f"op-{i % 500}", "x")],
                marks=[dataclasses.replace(big, epoch=i + 1)],
                previous=None,
            )
            if i % 100 == 0:
                largest = max(largest, wal.stat().st_size if wal.exists() else 0)
    finally:
        await db.close()
    assert largest <= 64 * 1024 * 1024, f"the WAL grew to {largest / 2**20:.0f} MiB"


async def test_the_records_of_a_group_follow_every_change(tmp_path: Path) -> None:
    """in_group is what the runner's resident-neighbour check reads: it must never miss a
    record, whichever way the record came (commit, move, refused commit, outcome, load)."""

    def group(db: store.Store, name: str) -> set[model.Key]:
        return {(j.job_id, j.group) for j in db.in_group(name)}

    db = await store.Store.open(tmp_path)
    ungrouped = model.Job(job_id="b", group="", state=model.State.RUNNING)
    db.commit(jobs=[job("a"), ungrouped], previous=None)
    assert group(db, "g") == {("a", "g")} and group(db, "") == {("b", "")}
    db.commit(jobs=[dataclasses.replace(ungrouped, group="g")], previous=ungrouped)  # moved
    assert group(db, "g") == {("a", "g"), ("b", "g")} and group(db, "") == set()
    with pytest.raises(refusals.Refused):
        db.commit(
            jobs=[model.Job(job_id="c", group="g", backend_state={"x": object()})], previous=None
        )
    assert group(db, "g") == {("a", "g"), ("b", "g")}  # the refused record left no trace
    db.keep_outcome(job("d", model.State.SAVED), operation("op-d", "d", model.OpStatus.COMPLETE))
    assert group(db, "g") == {("a", "g"), ("b", "g"), ("d", "g")}
    await db.close()
    assert group(await reopened(tmp_path), "g") == {("a", "g"), ("b", "g"), ("d", "g")}
