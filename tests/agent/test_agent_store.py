"""The agent's SQLite store: one transaction per put, checkpoints off the writer."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from tslice.agent import jobs, store


def job(job_id: str, state: jobs.State = jobs.State.RUNNING) -> jobs.Job:
    return jobs.Job(job_id=job_id, group="g", state=state, backend="noop")


def operation(op_id: str, job_id: str) -> jobs.Operation:
    return jobs.Operation(
        op_id=op_id,
        job_id=job_id,
        kind=jobs.Kind.SNAPSHOT,
        backend="noop",
        status=jobs.OpStatus.PENDING,
        started_at=time.time(),
    )


async def test_records_survive_a_close_and_the_wal_is_emptied(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    for i in range(300):  # past the checkpoint interval (checkpoints run beside the writes)
        db.put(job_records=[job(f"job-{i % 3}")], operation_records=[operation(f"op-{i}", "x")])
    db.put(grant_marks=[jobs.GrantMark(group="g", epoch=7, job_id="job-1")])
    db.delete_operations(["op-0", "op-1"])
    await db.close()

    wal = tmp_path / f"{store.DB_FILE}-wal"
    assert not wal.exists() or wal.stat().st_size == 0  # the last checkpoint truncated it
    with sqlite3.connect(tmp_path / store.DB_FILE) as conn:
        assert conn.execute("SELECT count(*) FROM operations").fetchone() == (298,)
    db = await store.Store.open(tmp_path)
    loaded = await db.load()
    await db.close()
    assert sorted(loaded.job_map) == ["job-0", "job-1", "job-2"]
    assert len(loaded.operation_map) == 298 and "op-0" not in loaded.operation_map
    assert loaded.grant_map["g"] == jobs.GrantMark(group="g", epoch=7, job_id="job-1")


async def test_a_failed_put_changes_nothing(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    db.put(job_records=[job("job-a")])
    bad = jobs.Job(job_id="job-b", group="g", backend_state={"not json": object()})
    with pytest.raises(TypeError):
        db.put(job_records=[bad])
    # The writer is still usable, and the refused put left no trace.
    db.put(job_records=[job("job-c")])
    loaded = await db.load()
    await db.close()
    assert sorted(loaded.job_map) == ["job-a", "job-c"]


async def test_a_put_after_close_is_refused_clearly(tmp_path: Path) -> None:
    db = await store.Store.open(tmp_path)
    await db.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):
        db.put(job_records=[job("job-a")])
