"""Node-local persistence of jobs, operations and grant epochs (SQLite, WAL).

The agent writes every change here *before* it replies, so an agent killed at any
moment (SIGKILL included) restarts knowing every job, every saved state and every
operation a caller may still ask about. Writes are serialised by one lock so that
they reach the database in the order the agent made its decisions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import aiosqlite

from tslice.agent import jobs

DB_FILE = "agent.sqlite3"
_SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    grp TEXT NOT NULL,
    state TEXT NOT NULL,
    backend TEXT NOT NULL,
    choice TEXT NOT NULL,
    config BLOB NOT NULL,
    footprint_bytes INTEGER NOT NULL,
    backend_state TEXT NOT NULL,
    error TEXT NOT NULL,
    operation_id TEXT NOT NULL,
    device_bytes INTEGER NOT NULL,
    host_bytes INTEGER NOT NULL,
    previous_state TEXT
);
CREATE TABLE IF NOT EXISTS operations (
    op_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    backend TEXT NOT NULL,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    finished_at REAL,
    storage_bytes INTEGER,
    device_bytes INTEGER,
    error TEXT
);
CREATE TABLE IF NOT EXISTS grants (
    grp TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL,
    job_id TEXT NOT NULL
);
"""


@dataclasses.dataclass(frozen=True)
class Loaded:
    job_map: dict[str, jobs.Job]
    operation_map: dict[str, jobs.Operation]
    grant_map: dict[str, jobs.GrantMark]


class Store:
    """Open with :meth:`open`; every ``put`` is one transaction."""

    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self._db = db
        self._lock = asyncio.Lock()
        self.path = path

    @classmethod
    async def open(cls, state_dir: Path) -> Store:
        await asyncio.to_thread(state_dir.mkdir, parents=True, exist_ok=True)
        path = state_dir / DB_FILE
        db = await aiosqlite.connect(path)
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable against a process crash in WAL mode; only power loss can drop
            # the last commits, and a GPU's memory does not survive that either.
            await db.execute("PRAGMA synchronous=NORMAL")
            async with db.execute("PRAGMA user_version") as cursor:
                row = await cursor.fetchone()
            version = int(row[0]) if row else 0
            if version > _SCHEMA_VERSION:
                raise RuntimeError(
                    f"{path} was written by a newer tslice (schema {version}); upgrade tslice "
                    "or use another --state-dir"
                )
            await db.executescript(_SCHEMA)
            await db.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
            await db.commit()
        except BaseException:
            await db.close()
            raise
        return cls(db, path)

    async def close(self) -> None:
        async with self._lock:
            await self._db.close()

    async def load(self) -> Loaded:
        loaded = Loaded(job_map={}, operation_map={}, grant_map={})
        async with self._db.execute("SELECT * FROM jobs") as cursor:
            async for row in cursor:
                job = _job_from_row(tuple(row))
                loaded.job_map[job.job_id] = job
        async with self._db.execute("SELECT * FROM operations") as cursor:
            async for row in cursor:
                op = _operation_from_row(tuple(row))
                loaded.operation_map[op.op_id] = op
        async with self._db.execute("SELECT grp, epoch, job_id FROM grants") as cursor:
            async for row in cursor:
                loaded.grant_map[str(row[0])] = jobs.GrantMark(
                    group=str(row[0]), epoch=int(row[1]), job_id=str(row[2])
                )
        return loaded

    async def put(
        self,
        *,
        job_records: Sequence[jobs.Job] = (),
        operation_records: Sequence[jobs.Operation] = (),
        grant_marks: Sequence[jobs.GrantMark] = (),
    ) -> None:
        async with self._lock:
            if job_records:
                await self._db.executemany(
                    "INSERT OR REPLACE INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    [_job_row(j) for j in job_records],
                )
            if operation_records:
                await self._db.executemany(
                    "INSERT OR REPLACE INTO operations VALUES (?,?,?,?,?,?,?,?,?,?)",
                    [_operation_row(o) for o in operation_records],
                )
            if grant_marks:
                await self._db.executemany(
                    "INSERT OR REPLACE INTO grants VALUES (?,?,?)",
                    [(g.group, g.epoch, g.job_id) for g in grant_marks],
                )
            await self._db.commit()

    async def delete_operations(self, op_ids: Iterable[str]) -> None:
        ids = [(op_id,) for op_id in op_ids]
        if not ids:
            return
        async with self._lock:
            await self._db.executemany("DELETE FROM operations WHERE op_id = ?", ids)
            await self._db.commit()


def _job_row(job: jobs.Job) -> tuple[object, ...]:
    return (
        job.job_id,
        job.group,
        job.state.value,
        job.backend,
        job.choice,
        job.config,
        job.footprint_bytes,
        json.dumps(dict(job.backend_state)),
        job.error,
        job.operation_id,
        job.device_bytes,
        job.host_bytes,
        job.previous_state.value if job.previous_state is not None else None,
    )


def _job_from_row(row: tuple[object, ...]) -> jobs.Job:
    (
        job_id,
        group,
        state,
        backend,
        choice,
        config,
        footprint,
        backend_state,
        error,
        op_id,
        dev,
        host,
        prev,
    ) = row
    return jobs.Job(
        job_id=str(job_id),
        group=str(group),
        state=jobs.State(state),
        backend=str(backend),
        choice=str(choice),
        config=bytes(config) if isinstance(config, (bytes, bytearray, memoryview)) else b"",
        footprint_bytes=int(str(footprint)),
        backend_state=json.loads(str(backend_state)),
        error=str(error),
        operation_id=str(op_id),
        device_bytes=int(str(dev)),
        host_bytes=int(str(host)),
        previous_state=jobs.State(prev) if prev is not None else None,
    )


def _operation_row(op: jobs.Operation) -> tuple[object, ...]:
    return (
        op.op_id,
        op.job_id,
        op.kind.value,
        op.backend,
        op.status.value,
        op.started_at,
        op.finished_at,
        op.storage_bytes,
        op.device_bytes,
        op.error,
    )


def _optional_int(value: object) -> int | None:
    return None if value is None else int(str(value))


def _operation_from_row(row: tuple[object, ...]) -> jobs.Operation:
    (op_id, job_id, kind, backend, status, started, finished, storage, device, error) = row
    return jobs.Operation(
        op_id=str(op_id),
        job_id=str(job_id),
        kind=jobs.Kind(kind),
        backend=str(backend),
        status=jobs.OpStatus(status),
        started_at=float(str(started)),
        finished_at=None if finished is None else float(str(finished)),
        storage_bytes=_optional_int(storage),
        device_bytes=_optional_int(device),
        error=None if error is None else str(error),
    )
