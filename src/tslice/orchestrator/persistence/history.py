"""The orchestrator's event history: a SQLite file beside its state, bounded by age and size.

``<state_dir>/events.db`` holds every event the orchestrator published (the
``OrchestratorEvent`` of WatchEvents, serialized) with its time, kind, group and jobs as
columns to filter on. It is a file of its own, not a table of ``orchestrator.db``: a
history write then never holds the lock state's write lock, so a hand-over never waits
for it, and the two files are bounded and deleted independently.

Writes come in batches from :mod:`tslice.orchestrator.events.tap` (every
``flush_interval_s``, default 1 s) and run in one thread of their own, which also runs
every read, so a read sees every batch handed over before it. Journal mode WAL with
``synchronous=NORMAL``: a committed batch survives a SIGKILL of the orchestrator (the
WAL is in the OS page cache); what a SIGKILL loses is the batch not yet handed over,
at most the last ``flush_interval_s`` of events. A graceful stop writes everything.

Retention, after every write: rows older than ``max_age_s`` go, then the oldest rows
until the live pages fit ``max_bytes`` (SQLite reuses the freed pages, so the file stops
growing there). An event takes about 130 bytes (row and index; measured with 100,000
events of 64 groups and two-node switches). A busy cluster, 64 two-node groups each
handing over every 30 s (9 events a hand-over), writes about 215 MB a day: the default
1 GiB keeps about 5 days of it, and the default age (7 days) bounds anything quieter.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import pathlib
import sqlite3
import time
from collections.abc import Sequence
from typing import TypeVar

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import errors

log = logging.getLogger(__name__)

_T = TypeVar("_T")

FILE_NAME = "events.db"
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    seq      INTEGER PRIMARY KEY,   -- publication order, across restarts
    time_ns  INTEGER NOT NULL,      -- the event's own time (wall clock)
    kind     INTEGER NOT NULL,
    group_id TEXT NOT NULL,
    job_id   TEXT NOT NULL,
    from_job TEXT NOT NULL,
    event    BLOB NOT NULL          -- the OrchestratorEvent, serialized
);
CREATE INDEX IF NOT EXISTS events_by_time ON events (time_ns);
"""

#: Rows of one read (a WatchEvents replay reads page by page).
PAGE_ROWS = 2000


@dataclasses.dataclass(frozen=True)
class HistorySettings:
    """How much history the orchestrator keeps (``history:`` in its config file)."""

    #: Keep events at all (off: WatchEvents with ``since`` is refused).
    enabled: bool = True
    #: Events older than this go, seconds (default 7 days).
    max_age_s: float = 7 * 86400.0
    #: The file's live pages stay within this, bytes (default 1 GiB); the oldest go first.
    max_bytes: int = 1 << 30
    #: Events are written in batches this often, seconds: what a SIGKILL may lose.
    flush_interval_s: float = 1.0


@dataclasses.dataclass(frozen=True)
class Query:
    """Which stored events a reader wants (every field optional)."""

    since_ns: int = 0
    #: 0 = no end.
    until_ns: int = 0
    group_id: str = ""
    #: Events naming this job (as job_id or from_job).
    job_id: str = ""
    kinds: frozenset[int] = frozenset()

    def matches(self, event: opb.OrchestratorEvent) -> bool:
        """The same test as the SQL of :meth:`History.read_page`, for events in memory."""
        t = event.time.seconds * 1_000_000_000 + event.time.nanos
        return (
            t >= self.since_ns
            and (not self.until_ns or t <= self.until_ns)
            and (not self.group_id or event.group_id == self.group_id)
            and (not self.job_id or self.job_id in (event.job_id, event.from_job))
            and (not self.kinds or event.kind in self.kinds)
        )


class HistoryError(errors.TsliceError):
    """The history file cannot be opened (the message names it and the fix)."""


class History:
    """The history file; every call of it runs in its one thread."""

    def __init__(self, path: pathlib.Path, settings: HistorySettings) -> None:
        self.path = path
        self.settings = settings
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="history")
        self._db: sqlite3.Connection | None = None
        #: The seq the next event gets (one more than the newest stored).
        self.next_seq = 1

    @classmethod
    async def open(cls, state_dir: pathlib.Path, settings: HistorySettings) -> History:
        history = cls(state_dir / FILE_NAME, settings)
        try:
            history.next_seq = await history._run(history._open)
        except (sqlite3.Error, OSError) as err:
            history._thread.shutdown(wait=False)
            raise HistoryError(
                f"cannot open the event history {history.path}: {err} (move the file "
                "away, or turn the history off with `history: {enabled: false}`)"
            ) from err
        return history

    def _open(self) -> int:
        db = sqlite3.connect(self.path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        db.execute(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
            (str(SCHEMA_VERSION),),
        )
        self._db = db
        (newest,) = db.execute("SELECT COALESCE(MAX(seq), 0) FROM events").fetchone()
        return int(newest) + 1

    async def _run(self, fn: object, *args: object) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, fn, *args)  # type: ignore[arg-type]

    def append(
        self, first_seq: int, batch: Sequence[opb.OrchestratorEvent]
    ) -> concurrent.futures.Future[int]:
        """Write ``batch`` (seq ``first_seq`` on) in the history's thread; returns at once.
        The future's result is the number of rows written (0: the write failed, logged)."""
        return self._thread.submit(self._write, first_seq, list(batch))

    def _write(self, first_seq: int, batch: list[opb.OrchestratorEvent]) -> int:
        db = self._db
        if db is None:
            return 0
        rows = [
            (
                first_seq + i,
                e.time.seconds * 1_000_000_000 + e.time.nanos,
                e.kind,
                e.group_id,
                e.job_id,
                e.from_job,
                e.SerializeToString(),
            )
            for i, e in enumerate(batch)
        ]
        try:
            with db:
                db.execute("BEGIN")
                db.executemany("INSERT OR REPLACE INTO events VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            self._retain(db)
        except sqlite3.Error as err:
            log.error("event history: %d events not written to %s: %s", len(rows), self.path, err)
            return 0
        return len(rows)

    def _retain(self, db: sqlite3.Connection) -> None:
        """Drop what is past the age, then the oldest rows until the size fits."""
        cutoff = time.time_ns() - int(self.settings.max_age_s * 1e9)
        db.execute("DELETE FROM events WHERE time_ns < ?", (cutoff,))
        for _ in range(8):  # each round removes about what is too much
            used = _live_bytes(db)
            if used <= self.settings.max_bytes:
                return
            (count,) = db.execute("SELECT COUNT(*) FROM events").fetchone()
            if not count:
                return
            excess = used - int(self.settings.max_bytes * 0.9)
            drop = max(1, min(count, int(count * excess / used) + 1))
            db.execute(
                "DELETE FROM events WHERE seq IN (SELECT seq FROM events ORDER BY seq LIMIT ?)",
                (drop,),
            )

    async def read_page(
        self, query: Query, *, after_seq: int, before_seq: int, limit: int = PAGE_ROWS
    ) -> list[tuple[int, opb.OrchestratorEvent]]:
        """Stored events matching ``query`` with ``after_seq < seq < before_seq``, oldest
        first, at most ``limit``."""
        return await self._run(self._read, query, after_seq, before_seq, limit)

    def _read(
        self, query: Query, after_seq: int, before_seq: int, limit: int
    ) -> list[tuple[int, opb.OrchestratorEvent]]:
        db = self._db
        if db is None:
            return []
        where = ["seq > ?", "seq < ?", "time_ns >= ?"]
        args: list[object] = [after_seq, before_seq, query.since_ns]
        if query.until_ns:
            where.append("time_ns <= ?")
            args.append(query.until_ns)
        if query.group_id:
            where.append("group_id = ?")
            args.append(query.group_id)
        if query.job_id:
            where.append("(job_id = ? OR from_job = ?)")
            args += [query.job_id, query.job_id]
        if query.kinds:
            where.append(f"kind IN ({', '.join('?' * len(query.kinds))})")
            args += sorted(query.kinds)
        sql = f"SELECT seq, event FROM events WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"
        out = []
        for seq, blob in db.execute(sql, [*args, limit]):
            out.append((int(seq), opb.OrchestratorEvent.FromString(blob)))
        return out

    async def stats(self) -> tuple[int, int]:
        """(events stored, live bytes of the file)."""
        return await self._run(self._stats)

    def _stats(self) -> tuple[int, int]:
        db = self._db
        if db is None:
            return (0, 0)
        (count,) = db.execute("SELECT COUNT(*) FROM events").fetchone()
        return int(count), _live_bytes(db)

    async def close(self) -> None:
        """Wait for the writes handed over, then close the file."""
        try:
            await self._run(self._close)
        finally:
            self._thread.shutdown(wait=True)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _live_bytes(db: sqlite3.Connection) -> int:
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    (free,) = db.execute("PRAGMA freelist_count").fetchone()
    (size,) = db.execute("PRAGMA page_size").fetchone()
    return int((pages - free) * size)
