"""The agent's SQLite store: one transaction per put, checkpoints off the writer."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from pathlib import Path

import pytest

from tslice.agent import store
from tslice.agent.jobs import model


def job(job_id: str, state: model.State = model.State.RUNNING) -> model.Job:
    return model.Job(job_id=job_id, group="g", state=state, backend="noop")


def operation(op_id: str, job_id: str) -> model.Operation:
    return model.Operation(
        op_id=op_id,
        job_id=job_id,
        kind=model.Kind.SNAPSHOT,
        backend="noop",
        status=model.OpStatus.PENDING,
        started_at=time.time(),
    )


async def test_records_survive_a_close_and_the_wal_is_emptied(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    for i in range(300):  # past the checkpoint interval (checkpoints run beside the writes)
        db.put(job_records=[job(f"job-{i % 3}")], operation_records=[operation(f"op-{i}", "x")])
    db.put(grant_marks=[model.GrantMark(group="g", epoch=7, job_id="job-1")])
    db.delete_operations(["op-0", "op-1"])
    await db.close()

    wal = tmp_path / f"{store.DB_FILE}-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # the last checkpoint truncated it
    with sqlite3.connect(tmp_path / store.DB_FILE) as conn:
        assert conn.execute("SELECT count(*) FROM operations").fetchone() == (298,)
    db = await store.Store.open(tmp_path)
    loaded = await db.load()
    await db.close()
    assert sorted(loaded.job_map) == [("job-0", "g"), ("job-1", "g"), ("job-2", "g")]
    assert len(loaded.operation_map) == 298 and "op-0" not in loaded.operation_map
    assert loaded.grant_map["g"] == model.GrantMark(group="g", epoch=7, job_id="job-1")


async def test_a_failed_put_changes_nothing(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    db.put(job_records=[job("job-a")])
    bad = model.Job(job_id="job-b", group="g", backend_state={"not json": object()})
    with pytest.raises(TypeError):
        db.put(job_records=[bad])
    # The writer is still usable, and the refused put left no trace.
    db.put(job_records=[job("job-c")])
    loaded = await db.load()
    await db.close()
    assert sorted(loaded.job_map) == [("job-a", "g"), ("job-c", "g")]


async def test_a_put_that_fails_inside_its_transaction_is_rolled_back_whole(
    tmp_path: Path,
) -> None:
    db = await store.Store.open(tmp_path)
    db.put(job_records=[job("job-a")])
    unbindable = dataclasses.replace(operation("op-1", "job-b"), started_at=object())
    with pytest.raises(sqlite3.Error):
        # The job row is written first, then the operation row fails to bind.
        db.put(job_records=[job("job-b")], operation_records=[unbindable])
    db.put(operation_records=[operation("op-2", "job-a")])
    loaded = await db.load()
    await db.close()
    assert sorted(loaded.job_map) == [("job-a", "g")]
    assert sorted(loaded.operation_map) == ["op-2"]


async def test_a_put_after_close_is_refused_clearly(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    await db.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        db.put(job_records=[job("job-a")])


async def test_one_row_per_job_and_group_and_a_moved_record_is_deleted(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    sampler = model.Job(job_id="job-a", group="sampler", state=model.State.SAVED)
    trainer = model.Job(job_id="job-a", group="trainer", state=model.State.RUNNING)
    ungrouped = model.Job(job_id="job-b", group="", state=model.State.RUNNING)
    db.put(job_records=[sampler, trainer, ungrouped])
    db.put(
        job_records=[model.Job(job_id="job-b", group="g", state=model.State.RUNNING)],
        deleted_jobs=[("job-b", "")],
    )
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
    db.put(operation_records=[op])
    await db.close()
    loaded = await (await store.Store.open(tmp_path)).load()
    assert sorted(loaded.job_map) == [("job-a", "sampler"), ("job-a", "trainer"), ("job-b", "g")]
    assert loaded.job_map[("job-a", "sampler")].state is model.State.SAVED
    assert loaded.operation_map["op-1"].group == "trainer"


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    path = tmp_path / store.DB_FILE
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

    async def load() -> store.Loaded:
        db = await store.Store.open(tmp_path)
        try:
            return await db.load()
        finally:
            await db.close()

    loaded = asyncio.run(load())
    assert list(loaded.job_map) == [("job-a", "sampler")]
    assert loaded.job_map[("job-a", "sampler")].host_bytes == 5
    assert loaded.operation_map["op-1"].group == ""
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (2,)


async def test_a_leader_term_kept_without_its_leader_reads_as_unnamed(tmp_path: Path) -> None:
    # The table as a release that kept no identity wrote it.
    conn = sqlite3.connect(tmp_path / store.DB_FILE)
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
    wal = tmp_path / f"{store.DB_FILE}-wal"
    largest = 0
    big = model.GrantMark(group="g", epoch=1, job_id="x" * 200)
    try:
        for i in range(20_000):
            db.put(
                job_records=[job(f"job-{i % 40}")],
                operation_records=[operation(f"op-{i % 500}", "x")],
                grant_marks=[dataclasses.replace(big, epoch=i + 1)],
            )
            if i % 100 == 0:
                largest = max(largest, wal.stat().st_size if wal.exists() else 0)
    finally:
        await db.close()
    assert largest <= 64 * 1024 * 1024, f"the WAL grew to {largest / 2**20:.0f} MiB"
