"""Node-local persistence of jobs, operations and grant epochs (SQLite, WAL).

The agent writes every change here *before* it replies, so an agent killed at any
moment (SIGKILL included) restarts knowing every job, every saved state and every
operation a caller may still ask about.

Every ``put`` is one transaction, written synchronously on the event loop: with WAL
and ``synchronous=NORMAL`` a commit is a few tens of microseconds and no fsync, far
less than a hop to a thread and back; writes reach the database in exactly the order
the agent made its decisions; and a caller can store and act without an ``await`` in
between, so that a cancellation never separates the two (see ``tslice.agent.runner``).
A commit survives a crash of the process; only a power loss can drop the last ones,
and a GPU's memory does not survive that either. WAL checkpoints (which do fsync) run
in a thread of their own (:class:`tslice.common.sqlite_wal.WalCheckpointer`); opening
and loading use a thread too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from tslice.agent import jobs
from tslice.common import sqlite_wal

_T = TypeVar("_T")

DB_FILE = "agent.sqlite3"
#: 2: one job row per (job, group); operations record their group.
_SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT NOT NULL,
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
    previous_state TEXT,
    PRIMARY KEY (job_id, grp)
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
    error TEXT,
    grp TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS grants (
    grp TEXT PRIMARY KEY,
    epoch INTEGER NOT NULL,
    job_id TEXT NOT NULL
);
"""


#: Version 1 keyed jobs by job id alone; its rows become the (job, group) rows they name.
_MIGRATE_FROM_1 = """
ALTER TABLE jobs RENAME TO jobs_v1;
{schema}
INSERT INTO jobs SELECT * FROM jobs_v1;
DROP TABLE jobs_v1;
ALTER TABLE operations ADD COLUMN grp TEXT NOT NULL DEFAULT '';
"""


def _upsert(
    table: str, columns: tuple[str, ...], *, fixed: tuple[str, ...] = (), key: int = 1
) -> str:
    """Insert, or update the row in place: half the work of INSERT OR REPLACE, which
    deletes the row (and its index entry) and inserts it again. ``fixed`` columns never
    change once written."""
    keys, rest = columns[:key], columns[key:]
    updates = ", ".join(f"{c}=excluded.{c}" for c in rest if c not in fixed)
    marks = ",".join("?" * len(columns))
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({marks}) "
        f"ON CONFLICT({', '.join(keys)}) DO UPDATE SET {updates}"
    )


# Column order of the rows built by _job_row / _operation_row (the tables' order).
_UPSERT_JOB = _upsert(
    "jobs",
    (
        "job_id",
        "grp",
        "state",
        "backend",
        "choice",
        "config",
        "footprint_bytes",
        "backend_state",
        "error",
        "operation_id",
        "device_bytes",
        "host_bytes",
        "previous_state",
    ),
    key=2,
)
_UPSERT_OPERATION = _upsert(
    "operations",
    (
        "op_id",
        "job_id",
        "kind",
        "backend",
        "status",
        "started_at",
        "finished_at",
        "storage_bytes",
        "device_bytes",
        "error",
        "grp",
    ),
    fixed=("job_id", "kind", "backend", "started_at", "grp"),  # an operation's identity
)
_UPSERT_MARK = _upsert("grants", ("grp", "epoch", "job_id"))


@dataclasses.dataclass(frozen=True)
class Loaded:
    job_map: dict[jobs.Key, jobs.Job]
    operation_map: dict[str, jobs.Operation]
    grant_map: dict[str, jobs.GrantMark]


class Store:
    """Open with :meth:`open`; every ``put`` is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tslice-agent-db"
        )
        self._conn: sqlite3.Connection | None = None
        self._checkpoints = sqlite_wal.WalCheckpointer(path)

    @classmethod
    async def open(cls, state_dir: Path) -> Store:
        store = cls(state_dir / DB_FILE)
        try:
            await store._run(store._open_sync)
        except BaseException:
            store._executor.shutdown(wait=False)
            raise
        return store

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            await self._checkpoints.close()
        self._executor.shutdown(wait=True)

    async def load(self) -> Loaded:
        return await self._run(self._load_sync)

    def put(
        self,
        *,
        job_records: Sequence[jobs.Job] = (),
        operation_records: Sequence[jobs.Operation] = (),
        grant_marks: Sequence[jobs.GrantMark] = (),
        deleted_jobs: Sequence[jobs.Key] = (),
    ) -> None:
        """Store the records in one transaction, synchronously (see the module docstring)."""
        job_rows = [_job_row(j) for j in job_records]
        op_rows = [_operation_row(o) for o in operation_records]
        mark_rows = [(g.group, g.epoch, g.job_id) for g in grant_marks]
        if job_rows or op_rows or mark_rows or deleted_jobs:
            self._put_sync(job_rows, op_rows, mark_rows, list(deleted_jobs))

    def delete_operations(self, op_ids: Iterable[str]) -> None:
        ids = [(op_id,) for op_id in op_ids]
        if ids:
            self._delete_sync(ids)

    # ---- SQLite side -----------------------------------------------------------------------

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable against a process crash in WAL mode (see the module docstring).
            conn.execute("PRAGMA synchronous=NORMAL")
            # Checkpoints (the only fsyncs) run in the checkpointer's thread, not here.
            conn.execute("PRAGMA wal_autocheckpoint=0")
            # A checkpoint never blocks a writer; anything else holding the file (an
            # operator's sqlite3 shell) is waited for briefly rather than failing at once.
            conn.execute("PRAGMA busy_timeout=1000")
            row = conn.execute("PRAGMA user_version").fetchone()
            version = int(row[0]) if row else 0
            if version > _SCHEMA_VERSION:
                raise RuntimeError(
                    f"{self.path} was written by a newer tslice (schema {version}); upgrade "
                    "tslice or use another --state-dir"
                )
            if version == 1:
                conn.executescript(f"BEGIN;{_MIGRATE_FROM_1.format(schema=_SCHEMA)}COMMIT;")
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _load_sync(self) -> Loaded:
        conn = self._conn
        assert conn is not None
        loaded = Loaded(job_map={}, operation_map={}, grant_map={})
        for row in conn.execute("SELECT * FROM jobs"):
            job = _job_from_row(tuple(row))
            loaded.job_map[job.key] = job
        for row in conn.execute("SELECT * FROM operations"):
            op = _operation_from_row(tuple(row))
            loaded.operation_map[op.op_id] = op
        for grp, epoch, job_id in conn.execute("SELECT grp, epoch, job_id FROM grants"):
            loaded.grant_map[str(grp)] = jobs.GrantMark(
                group=str(grp), epoch=int(epoch), job_id=str(job_id)
            )
        return loaded

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError(f"the agent state database {self.path} is closed")
        return self._conn

    def _put_sync(
        self,
        job_rows: list[tuple[object, ...]],
        op_rows: list[tuple[object, ...]],
        mark_rows: list[tuple[str, int, str]],
        deleted_jobs: list[jobs.Key],
    ) -> None:
        with self._checkpoints.transaction(self._connection()) as conn:
            if deleted_jobs:
                conn.executemany("DELETE FROM jobs WHERE job_id = ? AND grp = ?", deleted_jobs)
            if job_rows:
                conn.executemany(_UPSERT_JOB, job_rows)
            if op_rows:
                conn.executemany(_UPSERT_OPERATION, op_rows)
            if mark_rows:
                conn.executemany(_UPSERT_MARK, mark_rows)

    def _delete_sync(self, ids: list[tuple[str]]) -> None:
        with self._checkpoints.transaction(self._connection()) as conn:
            conn.executemany("DELETE FROM operations WHERE op_id = ?", ids)


def _job_row(job: jobs.Job) -> tuple[object, ...]:
    return (
        job.job_id,
        job.group,
        job.state.value,
        job.backend,
        job.choice,
        job.config,
        job.footprint_bytes,
        json.dumps(dict(job.backend_state)) if job.backend_state else "{}",
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
        op.group,
    )


def _optional_int(value: object) -> int | None:
    return None if value is None else int(str(value))


def _operation_from_row(row: tuple[object, ...]) -> jobs.Operation:
    (op_id, job_id, kind, backend, status, started, finished, storage, device, error, grp) = row
    return jobs.Operation(
        op_id=str(op_id),
        job_id=str(job_id),
        group=str(grp),
        kind=jobs.Kind(kind),
        backend=str(backend),
        status=jobs.OpStatus(status),
        started_at=float(str(started)),
        finished_at=None if finished is None else float(str(finished)),
        storage_bytes=_optional_int(storage),
        device_bytes=_optional_int(device),
        error=None if error is None else str(error),
    )
