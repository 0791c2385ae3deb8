"""Persistence of every group's lock state: the interface (:class:`LockStore`) and its
default, SQLite (``<state_dir>/orchestrator.db``, :class:`Store`).

The interface is what a group's executor and the group manager use: :meth:`LockStore.load`
every group, :meth:`LockStore.save` what a batch of one group's commands changed (a future
that completes once it is durable), :meth:`LockStore.forget` a group,
:meth:`LockStore.close`. A save writes what changed (``records.Changes``): an arrival in
a queue of thousands is one row, not the queue. Kubernetes HA mode keeps the
state in the API server instead (``tslice.orchestrator.kube.state``); a store that finds a
newer leader's write in its way raises :class:`Deposed`.

Saves are applied in the order they were made, and a save completes only once its
transaction has committed (a group's executor acts on a batch only then, which keeps
"write before acting"). Saves made in one turn of the event loop, by
any groups, share one transaction (group commit): under load many groups hand over
at once, and one commit per loop turn costs far less than one per group (SQLite
writes each touched page to the WAL once per commit). Every save of the batch is
acknowledged only after that commit, so each is exactly as durable as on its own.
A batch that fails is written again one save per transaction: a save that cannot be
written fails alone (its group retries it, as before) and the others still commit.

Journal mode WAL with ``synchronous=NORMAL`` by default: a commit is durable
against a crash of the process (SIGKILL included) because the WAL lives in the
OS page cache, and it costs no fsync on the hand-over path. Such a commit is a
few tens of microseconds, less than a hop to a thread and back, so it runs on the
event loop; the WAL checkpoints, which do fsync, run in a thread of their own and
keep the WAL bounded (:class:`tslice.server.sqlite_wal.WalCheckpointer`). Only a
power loss or kernel crash can lose the last commits; recovery then re-reads the agents, which hold
the ground truth about residency. ``synchronous="full"`` is available for
deployments that want power-loss durability of queues and holders as well: every
commit then fsyncs, so saves run in the store's thread instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import pathlib
import sqlite3
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

from tslice.orchestrator.persistence import records
from tslice.server import sqlite_wal

_T = TypeVar("_T")

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id     TEXT PRIMARY KEY,
    nodes        TEXT NOT NULL,      -- JSON [[name, address], ...]
    holder       TEXT,
    resident     TEXT,
    grant_epoch  INTEGER NOT NULL,
    switch_count INTEGER NOT NULL,
    next_seq     INTEGER NOT NULL,
    updated      REAL NOT NULL,
    holder_lease_ms INTEGER NOT NULL DEFAULT 0,
    draining     INTEGER NOT NULL DEFAULT 0,
    holder_unclaimed_until REAL,      -- wall clock; NULL: the holder got its grant
    evictions    TEXT NOT NULL DEFAULT '[]'  -- JSON [[job, why], ...], oldest first
);
CREATE TABLE IF NOT EXISTS queue (
    group_id  TEXT NOT NULL,
    job_id    TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    footprint INTEGER NOT NULL,
    queued_at REAL,     -- wall clock the wait began (a policy's bound); NULL: unknown
    PRIMARY KEY (group_id, job_id)
);
CREATE TABLE IF NOT EXISTS footprints (
    group_id TEXT NOT NULL,
    job_id   TEXT NOT NULL,
    bytes    INTEGER NOT NULL,
    PRIMARY KEY (group_id, job_id)
);
CREATE TABLE IF NOT EXISTS intents (
    group_id TEXT PRIMARY KEY,
    from_job TEXT,
    to_job   TEXT NOT NULL,
    epoch    INTEGER NOT NULL,
    seq      INTEGER NOT NULL,
    started  REAL NOT NULL
);
"""


#: Columns of ``groups`` added after its first release -> their declaration (the
#: migration adds those an older database lacks).
_ADDED_COLUMNS = {
    "holder_lease_ms": "INTEGER NOT NULL DEFAULT 0",
    "draining": "INTEGER NOT NULL DEFAULT 0",
    "holder_unclaimed_until": "REAL",
    "evictions": "TEXT NOT NULL DEFAULT '[]'",
}


class StoreError(Exception):
    """The state database cannot be opened or written."""


class Deposed(StoreError):
    """A newer leader has written the state (HA mode): this process is no longer the
    leader and must not act on the group again (retrying cannot help)."""


#: Every persisted group: ``group_id -> (nodes as (name, address), record)``.
Persisted = dict[str, tuple[list[tuple[str, str]], records.LockRecord]]


class LockStore(Protocol):
    """Where the orchestrator keeps every group's lock state (see the module doc)."""

    async def load(self) -> Persisted:
        """Every persisted group."""
        ...

    def save(
        self, group_id: str, *, nodes: list[tuple[str, str]], changes: records.Changes
    ) -> asyncio.Future[None]:
        """Write ``changes`` (the first save of a group also writes its ``nodes``); the
        future completes once they are durable, or fails with :class:`StoreError`
        (retried by the caller) or :class:`Deposed` (never retried)."""
        ...

    def forget(self, group_id: str) -> None:
        """Delete a group that is gone, before any later save of the same id."""
        ...

    def unrecorded(self, group_id: str) -> records.LockRecord | None:
        """What a group without a persisted record starts from: None (fresh, nobody
        holds), or :meth:`records.LockRecord.lost` where a missing record may have been
        lost (its holder is then looked for on the agents)."""
        ...

    async def close(self) -> None: ...


def _check_integrity(conn: sqlite3.Connection) -> None:
    """Raise ``sqlite3.DatabaseError`` if the file is damaged (a truncated or empty file
    is a valid empty database; garbage fails here, or already at the first PRAGMA)."""
    problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check(3)")]
    if problems != ["ok"]:
        conn.close()
        raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(problems)}")


class Store:
    """Async facade over the SQLite database; use :meth:`open`."""

    def __init__(self, path: pathlib.Path, *, synchronous: str = "normal") -> None:
        self.path = path
        self._synchronous = synchronous
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tslice-orch-db"
        )
        self._conn: sqlite3.Connection | None = None
        # A commit that fsyncs ("full") must not stall the loop: it goes to the thread.
        self._inline = synchronous != "full"
        self._checkpoints = sqlite_wal.WalCheckpointer(self.path)
        self._nodes_cache: dict[str, tuple[tuple[tuple[str, str], ...], str]] = {}
        #: Each group's switch intent as last committed (the intents table follows its
        #: row), and those written by the transaction under way.
        self._intents: dict[str, records.IntentRecord | None] = {}
        self._unsaved_intents: dict[str, records.IntentRecord | None] = {}
        #: Saves waiting for the next group commit (see _commit_batch).
        self._batch: list[_Save] = []
        #: Commits the checkpointer was not told of yet.
        self._untold = 0

    @classmethod
    async def open(cls, state_dir: pathlib.Path, *, synchronous: str = "normal") -> Store:
        store = cls(state_dir / "orchestrator.db", synchronous=synchronous)
        try:
            await store._run(store._open_sync)
        except (OSError, sqlite3.Error) as err:
            store._executor.shutdown(wait=False)
            raise StoreError(
                sqlite_wal.open_failure(
                    err,
                    database=f"state database {store.path}",
                    then="the agents' reports restore grant epochs and residents, waiting "
                    "jobs re-queue when they retry",
                )
            ) from err
        return store

    async def close(self) -> None:
        self._commit_batch()  # a save made just before closing still commits
        if self._conn is not None:
            await self._run(self._close_sync)
            await self._checkpoints.close()
        self._executor.shutdown(wait=True)

    async def load(self) -> Persisted:
        """Every persisted group: ``group_id -> (nodes, record)``."""
        return await self._run(self._load_sync)

    def save(
        self, group_id: str, *, nodes: list[tuple[str, str]], changes: records.Changes
    ) -> asyncio.Future[None]:
        """Write ``changes``; the future completes once they are committed (it fails with
        :class:`StoreError` if the transaction it joined failed)."""
        loop = asyncio.get_running_loop()
        save = _Save(group_id, nodes, changes, loop.create_future())
        self._batch.append(save)
        if len(self._batch) == 1:
            # After what is ready now: the other groups' saves of this turn join in.
            loop.call_soon(self._commit_batch)
        return save.done

    def _commit_batch(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return  # committed early (close)
        if self._inline:
            _settle(batch, _failures(self._save_batch_sync, batch), self.path)
            return
        # "full": the commit fsyncs, in the store's thread (one at a time, in order).
        pending = asyncio.get_running_loop().run_in_executor(
            self._executor, _failures, self._save_batch_sync, batch
        )
        pending.add_done_callback(lambda f: _settle(batch, f.result(), self.path))

    def unrecorded(self, group_id: str) -> records.LockRecord | None:
        """A group without a row is new: the database is never partly lost (a corrupt
        one is refused at start)."""
        return None

    def forget(self, group_id: str) -> None:
        """Delete every row of a group that is gone (an idle local group collected).

        Called synchronously, so that no save of a new group of the same id can come
        first: inline it runs now, else it is queued in the store's thread before any
        later save.
        """
        self._nodes_cache.pop(group_id, None)
        self._intents.pop(group_id, None)
        try:
            if self._inline:
                self._forget_sync(group_id)
            else:
                self._executor.submit(self._forget_sync, group_id)
        except sqlite3.Error as err:
            raise StoreError(
                f"cannot delete state of group {group_id!r} from {self.path}: {err}"
            ) from err

    # ---- thread side -----------------------------------------------------------------------

    async def _run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={'FULL' if self._synchronous == 'full' else 'NORMAL'}")
        # Checkpoints (fsyncs) run in the checkpointer's thread, never in a save.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        # Past its limit the WAL is emptied by the checkpointer and cut back to it.
        conn.execute(sqlite_wal.pragma())
        conn.execute("PRAGMA busy_timeout=5000")
        _check_integrity(conn)
        conn.executescript(_SCHEMA)
        columns = {row[1] for row in conn.execute("PRAGMA table_info(groups)")}
        # Databases written before holder leases (no holder had one), before drains and
        # before unclaimed grants were kept (every holder on disk had got its grant).
        for column, declared in _ADDED_COLUMNS.items():
            if column not in columns:
                conn.execute(f"ALTER TABLE groups ADD COLUMN {column} {declared}")
        # ... and before waits were kept for the scheduling policies (they count from then).
        if "queued_at" not in {row[1] for row in conn.execute("PRAGMA table_info(queue)")}:
            conn.execute("ALTER TABLE queue ADD COLUMN queued_at REAL")
        row = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            conn.execute(
                "INSERT INTO meta(key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )
        elif int(row[0]) != SCHEMA_VERSION:
            conn.close()
            raise sqlite3.DatabaseError(
                f"schema version {row[0]} is not supported (expected {SCHEMA_VERSION})"
            )
        self._conn = conn

    def _forget_sync(self, gid: str) -> None:
        conn = self._conn
        assert conn is not None
        with self._checkpoints.transaction(conn):
            for table in ("groups", "queue", "footprints", "intents"):
                conn.execute(f"DELETE FROM {table} WHERE group_id=?", (gid,))

    def _close_sync(self) -> None:
        assert self._conn is not None
        self._conn.close()
        self._conn = None

    def _load_sync(self) -> Persisted:
        conn = self._conn
        assert conn is not None
        out: Persisted = {}
        groups = conn.execute(
            "SELECT group_id, nodes, holder, resident, grant_epoch, switch_count, next_seq, "
            "holder_lease_ms, draining, holder_unclaimed_until, evictions FROM groups"
            " ORDER BY group_id"
        ).fetchall()
        for row in groups:
            gid, nodes_json, holder, resident, epoch, switches, next_seq, *rest = row
            lease_ms, draining, unclaimed_until, evictions_json = rest
            queue = tuple(
                records.QueueRecord(job, seq, fp, since)
                for job, seq, fp, since in conn.execute(
                    "SELECT job_id, seq, footprint, queued_at FROM queue WHERE group_id=?"
                    " ORDER BY seq",
                    (gid,),
                )
            )
            footprints = tuple(
                (job, b)
                for job, b in conn.execute(
                    "SELECT job_id, bytes FROM footprints WHERE group_id=? ORDER BY job_id", (gid,)
                )
            )
            it = conn.execute(
                "SELECT from_job, to_job, epoch, seq FROM intents WHERE group_id=?", (gid,)
            ).fetchone()
            intent = records.IntentRecord(it[0], it[1], it[2], it[3]) if it else None
            record = records.LockRecord(
                holder,
                resident,
                epoch,
                switches,
                next_seq,
                queue,
                intent,
                footprints,
                lease_ms,
                bool(draining),
                unclaimed_until,
                evictions=tuple((str(j), str(w)) for j, w in json.loads(evictions_json)),
            )
            nodes = [(str(n), str(a)) for n, a in json.loads(nodes_json)]
            out[gid] = (nodes, record)
        return out

    def _nodes_json(self, gid: str, nodes: list[tuple[str, str]]) -> str:
        # A group's nodes hardly ever change: serialise them once.
        key = tuple(nodes)
        cached = self._nodes_cache.get(gid)
        if cached is None or cached[0] != key:
            cached = self._nodes_cache[gid] = (key, json.dumps(nodes))
        return cached[1]

    def _save_batch_sync(self, batch: list[_Save]) -> None:
        """Every save of ``batch`` in one transaction."""
        conn = self._conn
        if conn is None:
            raise sqlite3.ProgrammingError("the state database is closed")
        self._unsaved_intents = {}
        conn.execute("BEGIN IMMEDIATE")
        try:
            for save in batch:
                self._write_rows(conn, save)
            conn.commit()
        except BaseException:
            conn.rollback()  # and the error goes on: the saves fail (see _outcome)
            raise
        self._intents.update(self._unsaved_intents)  # (only once they are committed)
        # The checkpointer hears of commits in bunches (it acts every few hundred).
        self._untold += 1
        if self._untold >= sqlite_wal.TELL_EVERY:
            self._checkpoints.committed(self._untold)
            self._untold = 0

    def _write_rows(self, conn: sqlite3.Connection, save: _Save) -> None:
        gid, changes = save.group_id, save.changes
        row = changes.row
        if row is not None:
            self._write_group(conn, gid, save.nodes, row)
        if changes.left:
            conn.executemany(
                "DELETE FROM queue WHERE group_id=? AND job_id=?",
                [(gid, job) for job in changes.left],
            )
        if changes.queued:
            conn.executemany(
                "INSERT INTO queue(group_id, job_id, seq, footprint, queued_at)"
                " VALUES (?,?,?,?,?)"
                " ON CONFLICT(group_id, job_id) DO UPDATE SET"
                " seq=excluded.seq, footprint=excluded.footprint, queued_at=excluded.queued_at",
                [(gid, q.job, q.seq, q.footprint_bytes, q.queued_at) for q in changes.queued],
            )
        if changes.footprints:
            conn.executemany(
                "INSERT INTO footprints(group_id, job_id, bytes) VALUES (?,?,?)"
                " ON CONFLICT(group_id, job_id) DO UPDATE SET bytes=excluded.bytes",
                [(gid, job, b) for job, b in changes.footprints],
            )

    def _write_group(
        self,
        conn: sqlite3.Connection,
        gid: str,
        nodes: list[tuple[str, str]],
        row: records.GroupRow,
    ) -> None:
        conn.execute(
            "INSERT INTO groups(group_id, nodes, holder, resident, grant_epoch, switch_count,"
            " next_seq, updated, holder_lease_ms, draining, holder_unclaimed_until, evictions)"
            " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(group_id) DO UPDATE SET"
            " nodes=excluded.nodes, holder=excluded.holder, resident=excluded.resident,"
            " grant_epoch=excluded.grant_epoch, switch_count=excluded.switch_count,"
            " next_seq=excluded.next_seq, updated=excluded.updated,"
            " holder_lease_ms=excluded.holder_lease_ms, draining=excluded.draining,"
            " holder_unclaimed_until=excluded.holder_unclaimed_until,"
            " evictions=excluded.evictions",
            (
                gid,
                self._nodes_json(gid, nodes),
                row.holder,
                row.resident,
                row.grant_epoch,
                row.switch_count,
                row.next_seq,
                time.time(),
                row.holder_lease_ms,
                int(row.draining),
                row.holder_unclaimed_until,
                json.dumps(row.evictions) if row.evictions else "[]",
            ),
        )
        # The switch's intent: written with the row it belongs to, when it changed.
        intent = row.intent
        if self._intents.get(gid, _UNKNOWN) == intent:
            return
        self._unsaved_intents[gid] = intent
        if intent is None:
            conn.execute("DELETE FROM intents WHERE group_id=?", (gid,))
            return
        conn.execute(
            "INSERT INTO intents(group_id, from_job, to_job, epoch, seq, started)"
            " VALUES (?,?,?,?,?,?) ON CONFLICT(group_id) DO UPDATE SET"
            " from_job=excluded.from_job, to_job=excluded.to_job,"
            " epoch=excluded.epoch, seq=excluded.seq, started=excluded.started",
            (gid, intent.from_job, intent.to_job, intent.epoch, intent.seq, time.time()),
        )


@dataclasses.dataclass(frozen=True)
class _Save:
    group_id: str
    nodes: list[tuple[str, str]]
    changes: records.Changes
    done: asyncio.Future[None]


#: An intent not known to be on disk (the first write of a group's row writes it).
_UNKNOWN = records.IntentRecord(None, "", -1, -1)


def _failures(write: Callable[[list[_Save]], None], batch: list[_Save]) -> dict[int, Exception]:
    """The saves of ``batch`` that did not reach the disk (by index), with their errors
    (empty: all committed).

    A failed batch is written again one save per transaction, so that a save that cannot
    be written (whatever the reason) fails alone instead of holding every group back.
    """
    try:
        write(batch)
    except Exception as err:
        if len(batch) == 1:
            return {0: err}
        failed: dict[int, Exception] = {}
        for i, save in enumerate(batch):
            alone = _failures(write, [save])
            if alone:
                failed[i] = alone[0]
        return failed
    return {}


def _settle(batch: list[_Save], failed: dict[int, Exception], path: pathlib.Path) -> None:
    """Acknowledge each committed save; fail the others with their error."""
    for i, save in enumerate(batch):
        if save.done.done():
            continue  # the saving group went away meanwhile (cancelled)
        error = failed.get(i)
        if error is None:
            save.done.set_result(None)
        else:
            save.done.set_exception(StoreError(write_failure(error, save.group_id, path)))


def write_failure(error: Exception, group_id: str, path: pathlib.Path) -> str:
    """Why a save of ``group_id`` to ``path`` failed, and what to do (the worker retries).

    A damaged file is said to be corrupt (retrying cannot help: an operator moves it
    aside); anything else (a full disk, an I/O error, a read-only filesystem) is the
    filesystem's to fix, and the orchestrator resumes on its own once a write succeeds.
    """
    name = type(error).__name__
    # SQLITE_CORRUPT and SQLITE_NOTADB raise the base class itself (its subclasses are
    # other errors: OperationalError for a full disk, ProgrammingError, IntegrityError).
    if type(error) is sqlite3.DatabaseError:
        return (
            f"state database {path} is corrupt ({name}: {error}); stop the orchestrator, move "
            "the file aside (keep it for a post-mortem) and start it again: the agents' "
            "reports restore grant epochs and residents, waiting jobs re-queue when they retry"
        )
    return (
        f"cannot write state of group {group_id!r} to {path} ({name}: {error}); free space on "
        "its filesystem (or fix it) and the orchestrator resumes on its own"
    )
