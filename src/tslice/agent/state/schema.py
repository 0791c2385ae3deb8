"""Node-local persistence of jobs, operations, grant epochs and the leader term (SQLite, WAL).

The agent writes every change here *before* it replies, so an agent killed at any
moment (SIGKILL included) restarts knowing every job, every saved state and every
operation a caller may still ask about.

Every ``put`` is one transaction, written synchronously on the event loop: with WAL
and ``synchronous=NORMAL`` a commit is a few tens of microseconds and no fsync, far
less than a hop to a thread and back; writes reach the database in exactly the order
the agent made its decisions; and a caller can store and act without an ``await`` in
between, so that a cancellation never separates the two (see ``tslice.agent.moves.runner``).
A commit survives a crash of the process; only a power loss can drop the last ones,
and a GPU's memory does not survive that either. WAL checkpoints (which do fsync) run
in a thread of their own, and keep the WAL bounded
(:class:`tslice.server.wal_limit.BoundedWalCheckpointer`); opening and loading use a
thread too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import enum
import json
import operator
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tslice.agent.jobs import model
from tslice.common import errors
from tslice.server import sqlite_wal, wal_limit

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
CREATE TABLE IF NOT EXISTS leader_term (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    term INTEGER NOT NULL,
    leader TEXT NOT NULL DEFAULT ''
);
"""
# leader_term (one row, the highest orchestrator leader term seen and the identity that
# sent it: tslice.agent.fencing) needs no new schema version: an older agent on this
# database ignores the table, and its ``leader`` column is added where it is missing.


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


def _enum_value(value: enum.Enum) -> object:
    return value.value


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert``, with NULL (None) kept as it is."""
    return lambda value: None if value is None else convert(value)


def _number(kind: type[int] | type[float]) -> Callable[[object], Any]:
    return lambda value: kind(str(value))


def _blob(value: object) -> bytes:
    return bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b""


def _json(value: Mapping[str, Any]) -> str:
    return json.dumps(dict(value)) if value else "{}"


def _same(value: object) -> object:
    return value


@dataclasses.dataclass(frozen=True)
class _Column:
    """One column of a record's table: its name, the record's field, how a value is
    written (``dump``) and read back (``load``)."""

    name: str
    field: str
    dump: Callable[[Any], object] = _same
    load: Callable[[Any], Any] = str


class _RowOf:
    """A record's row for its table's columns, the lookups worked out once: every state
    change writes two to four records (a field read and a call per column cost ≈ 10 µs
    a record)."""

    def __init__(self, columns: tuple[_Column, ...]) -> None:
        self._values = operator.attrgetter(*(c.field for c in columns))
        self._dumps = tuple((i, c.dump) for i, c in enumerate(columns) if c.dump is not _same)

    def __call__(self, record: object) -> tuple[object, ...]:
        row = list(self._values(record))
        for i, dump in self._dumps:
            row[i] = dump(row[i])
        return tuple(row)


#: The tables' columns in their order, one per field of the record (``model.Job``).
_JOB_COLUMNS = (
    _Column("job_id", "job_id"),
    _Column("grp", "group"),
    _Column("state", "state", _enum_value, model.State),
    _Column("backend", "backend"),
    _Column("choice", "choice"),
    _Column("config", "config", load=_blob),
    _Column("footprint_bytes", "footprint_bytes", load=_number(int)),
    _Column("backend_state", "backend_state", _json, lambda value: json.loads(str(value))),
    _Column("error", "error"),
    _Column("operation_id", "operation_id"),
    _Column("device_bytes", "device_bytes", load=_number(int)),
    _Column("host_bytes", "host_bytes", load=_number(int)),
    _Column("previous_state", "previous_state", _optional(_enum_value), _optional(model.State)),
)
#: ... and of ``model.Operation``.
_OPERATION_COLUMNS = (
    _Column("op_id", "op_id"),
    _Column("job_id", "job_id"),
    _Column("kind", "kind", _enum_value, model.Kind),
    _Column("backend", "backend"),
    _Column("status", "status", _enum_value, model.OpStatus),
    _Column("started_at", "started_at", load=_number(float)),
    _Column("finished_at", "finished_at", load=_optional(_number(float))),
    _Column("storage_bytes", "storage_bytes", load=_optional(_number(int))),
    _Column("device_bytes", "device_bytes", load=_optional(_number(int))),
    _Column("error", "error", load=_optional(str)),
    _Column("grp", "group"),
)

_UPSERT_JOB = _upsert("jobs", tuple(c.name for c in _JOB_COLUMNS), key=2)
_UPSERT_OPERATION = _upsert(
    "operations",
    tuple(c.name for c in _OPERATION_COLUMNS),
    fixed=("job_id", "kind", "backend", "started_at", "grp"),  # an operation's identity
)
_SELECT_JOBS = f"SELECT {', '.join(c.name for c in _JOB_COLUMNS)} FROM jobs"
_SELECT_OPERATIONS = f"SELECT {', '.join(c.name for c in _OPERATION_COLUMNS)} FROM operations"
_UPSERT_MARK = _upsert("grants", ("grp", "epoch", "job_id"))
_UPSERT_TERM = _upsert("leader_term", ("id", "term", "leader"))


class StateDatabaseError(errors.ConfigError):
    """The agent's state database cannot be opened; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Loaded:
    job_map: dict[model.Key, model.Job]
    operation_map: dict[str, model.Operation]
    grant_map: dict[str, model.GrantMark]


class Store:
    """Open with :meth:`open`; every ``put`` is one transaction."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tslice-agent-db"
        )
        self._conn: sqlite3.Connection | None = None
        self._checkpoints = wal_limit.BoundedWalCheckpointer(path)

    @classmethod
    async def open(cls, state_dir: Path) -> Store:
        store = cls(state_dir / DB_FILE)
        try:
            await store._run(store._open_sync)
        except sqlite3.DatabaseError as err:
            store._executor.shutdown(wait=False)
            raise StateDatabaseError(
                sqlite_wal.open_failure(
                    err,
                    database=f"the agent state database {store.path}",
                    then="the jobs' saved states on this node are then unknown to the agent",
                )
            ) from err
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
        job_records: Sequence[model.Job] = (),
        operation_records: Sequence[model.Operation] = (),
        grant_marks: Sequence[model.GrantMark] = (),
        deleted_jobs: Sequence[model.Key] = (),
    ) -> None:
        """Store the records in one transaction, synchronously (see the module docstring)."""
        job_rows = [_job_row(j) for j in job_records]
        op_rows = [_operation_row(o) for o in operation_records]
        mark_rows = [(g.group, g.epoch, g.job_id) for g in grant_marks]
        if job_rows or op_rows or mark_rows or deleted_jobs:
            self._put_sync(job_rows, op_rows, mark_rows, list(deleted_jobs))

    def put_leader_term(self, term: int, leader: str = "") -> None:
        """Store the highest leader term seen and who sent it, synchronously (before the
        directive runs)."""
        with self._checkpoints.transaction(self._connection()) as conn:
            conn.execute(_UPSERT_TERM, (0, term, leader))

    async def leader_term(self) -> tuple[int, str]:
        """The leader term stored and its leader (0 and "": none seen)."""
        return await self._run(self._leader_term_sync)

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
            # Past its limit the WAL is emptied by the checkpointer and cut back to it.
            conn.execute(wal_limit.pragma())
            # The checkpoint that empties a WAL past its limit holds writers back for tens
            # of milliseconds (hundreds on a slow disk); it, or an operator's sqlite3
            # shell, is waited for rather than failing a write at once.
            conn.execute("PRAGMA busy_timeout=5000")
            problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(problems)}")
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
            columns = {str(r[1]) for r in conn.execute("PRAGMA table_info(leader_term)")}
            if "leader" not in columns:  # written by a release that kept no identity
                conn.execute("ALTER TABLE leader_term ADD COLUMN leader TEXT NOT NULL DEFAULT ''")
            conn.execute(f"PRAGMA user_version={_SCHEMA_VERSION}")
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _load_sync(self) -> Loaded:
        conn = self._conn
        assert conn is not None
        loaded = Loaded(job_map={}, operation_map={}, grant_map={})
        for row in conn.execute(_SELECT_JOBS):
            job = _job_from_row(tuple(row))
            loaded.job_map[job.key] = job
        for row in conn.execute(_SELECT_OPERATIONS):
            op = _operation_from_row(tuple(row))
            loaded.operation_map[op.op_id] = op
        for grp, epoch, job_id in conn.execute("SELECT grp, epoch, job_id FROM grants"):
            loaded.grant_map[str(grp)] = model.GrantMark(
                group=str(grp), epoch=int(epoch), job_id=str(job_id)
            )
        return loaded

    def _leader_term_sync(self) -> tuple[int, str]:
        row = self._connection().execute("SELECT term, leader FROM leader_term").fetchone()
        return (int(row[0]), str(row[1])) if row else (0, "")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.ProgrammingError(f"the agent state database {self.path} is closed")
        return self._conn

    def _put_sync(
        self,
        job_rows: list[tuple[object, ...]],
        op_rows: list[tuple[object, ...]],
        mark_rows: list[tuple[str, int, str]],
        deleted_jobs: list[model.Key],
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


def _fields(columns: tuple[_Column, ...], row: Sequence[object]) -> dict[str, Any]:
    return {c.field: c.load(value) for c, value in zip(columns, row, strict=True)}


_job_row = _RowOf(_JOB_COLUMNS)


def _job_from_row(row: tuple[object, ...]) -> model.Job:
    return model.Job(**_fields(_JOB_COLUMNS, row))


_operation_row = _RowOf(_OPERATION_COLUMNS)


def _operation_from_row(row: tuple[object, ...]) -> model.Operation:
    return model.Operation(**_fields(_OPERATION_COLUMNS, row))
