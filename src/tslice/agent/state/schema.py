"""The agent's SQLite file: its tables, the upgrade of an older file, the connection's settings.

One row per job record (job, group), per operation, per group's grant mark, and one for
the highest orchestrator leader term seen (``tslice.security.fencing``). The store
(:mod:`tslice.agent.state.store`) writes and reads them with the statements here; the
columns are listed once, in the order of the rows it builds.

WAL with ``synchronous=NORMAL``: a commit is a few tens of microseconds and no fsync,
and it survives a crash of the process (only a power loss can drop the last ones, and a
GPU's memory does not survive that either). Checkpoints (which do fsync) run in a
thread of their own and keep the WAL bounded (``tslice.server.sqlite_wal``), so the
connection never checkpoints by itself.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from tslice.common import errors
from tslice.server import sqlite_wal

DB_FILE = "agent.sqlite3"
#: 2: one job row per (job, group); operations record their group.
SCHEMA_VERSION = 2

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
# leader_term needs no new schema version: an older agent on this database ignores the
# table, and its ``leader`` column is added where it is missing.

#: Version 1 keyed jobs by job id alone; its rows become the (job, group) rows they name.
_MIGRATE_FROM_1 = """
ALTER TABLE jobs RENAME TO jobs_v1;
{schema}
INSERT INTO jobs SELECT * FROM jobs_v1;
DROP TABLE jobs_v1;
ALTER TABLE operations ADD COLUMN grp TEXT NOT NULL DEFAULT '';
"""

#: The columns of a job record's row, in the order of ``tslice.agent.jobs.model.Job``'s
#: fields (the store builds rows in this order).
JOB_COLUMNS = (
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
)
#: ... and of an operation's (``model.Operation``'s fields).
OPERATION_COLUMNS = (
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
)


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


UPSERT_JOB = _upsert("jobs", JOB_COLUMNS, key=2)
UPSERT_OPERATION = _upsert(
    "operations",
    OPERATION_COLUMNS,
    fixed=("job_id", "kind", "backend", "started_at", "grp"),  # an operation's identity
)
UPSERT_MARK = _upsert("grants", ("grp", "epoch", "job_id"))
UPSERT_TERM = _upsert("leader_term", ("id", "term", "leader"))
DELETE_JOB = "DELETE FROM jobs WHERE job_id = ? AND grp = ?"
DELETE_OPERATION = "DELETE FROM operations WHERE op_id = ?"
SELECT_JOBS = f"SELECT {', '.join(JOB_COLUMNS)} FROM jobs"
SELECT_OPERATIONS = f"SELECT {', '.join(OPERATION_COLUMNS)} FROM operations"
SELECT_MARKS = "SELECT grp, epoch, job_id FROM grants"
SELECT_TERM = "SELECT term, leader FROM leader_term"


class StateDatabaseError(errors.ConfigError):
    """The agent's state database cannot be opened; the message names the file."""


def connect(path: Path) -> sqlite3.Connection:
    """A connection to the agent's database at ``path``, made and upgraded as needed
    (blocking: call it from a thread). Raises ``sqlite3.DatabaseError`` for a damaged
    file and RuntimeError for one a newer tslice wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL is durable against a process crash in WAL mode (see the module docstring).
        conn.execute("PRAGMA synchronous=NORMAL")
        # Checkpoints (the only fsyncs) run in the checkpointer's thread, not here.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        # Past its limit the WAL is emptied by the checkpointer and cut back to it.
        conn.execute(sqlite_wal.pragma())
        # The checkpoint that empties a WAL past its limit holds writers back for tens of
        # milliseconds (hundreds on a slow disk); it, or an operator's sqlite3 shell, is
        # waited for rather than failing a write at once.
        conn.execute("PRAGMA busy_timeout=5000")
        problems = [str(r[0]) for r in conn.execute("PRAGMA quick_check(3)")]
        if problems != ["ok"]:
            raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(problems)}")
        row = conn.execute("PRAGMA user_version").fetchone()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{path} was written by a newer tslice (schema {version}); upgrade tslice "
                "or use another --state-dir"
            )
        if version == 1:
            conn.executescript(f"BEGIN;{_MIGRATE_FROM_1.format(schema=_SCHEMA)}COMMIT;")
        conn.executescript(_SCHEMA)
        columns = {str(r[1]) for r in conn.execute("PRAGMA table_info(leader_term)")}
        if "leader" not in columns:  # written by a release that kept no identity
            conn.execute("ALTER TABLE leader_term ADD COLUMN leader TEXT NOT NULL DEFAULT ''")
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        conn.close()
        raise
    return conn
