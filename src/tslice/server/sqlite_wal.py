"""WAL checkpoints of a SQLite database, run in a thread of their own, with the WAL bounded.

The agent and the orchestrator write their state on the event loop (a WAL commit
with ``synchronous=NORMAL`` is a few tens of microseconds and no fsync), which keeps
a hand-over free of thread hops. What must stay off the loop is the checkpoint, which
copies the WAL into the database and fsyncs both: the writing connection runs with
``wal_autocheckpoint=0`` and reports its commits here; every ``every_commits`` a
PASSIVE checkpoint (it never blocks writers) runs on a second connection in this
helper's thread.

The bound. Under steady writes a PASSIVE checkpoint never catches up with the last
commit, so SQLite never starts the WAL over and the file grows without bound
(hundreds of MB for the orchestrator and the agent under load). So a PASSIVE
checkpoint that leaves the WAL over ``limit_bytes`` is followed by a TRUNCATE one: it
waits for the writer's current transaction, holds the next one back while it copies
what the PASSIVE pass left and syncs, and empties the file. A writer waits for it
once per ``limit_bytes`` of writes (tens of milliseconds, more on a slow disk): the
price of a bounded disk. The stores also set :func:`pragma` (``journal_size_limit``)
so that a WAL that SQLite starts over by itself (when the writer pauses) is cut back.

That alone is no bound: on a slow disk the checkpoint thread falls behind the
writer, and a TRUNCATE that waits for a writer committing back to back can starve
(its busy handler sleeps, the writer takes the lock again first) and give up. So the
writer checks the file too, every ``every_commits`` commits: past twice the limit it
waits, on its own thread, for the checkpoint running and then for a TRUNCATE. The
writer's stall is rare and bounded by one checkpoint; the WAL stays under about
``2 * limit_bytes`` plus one round of commits, however slow the disk.

A hand-over commits a few times on each server, so the stores count their commits
themselves and report them in bunches of :data:`TELL_EVERY` (the checkpointer acts
every few hundred): a commit costs the hand-over no call here.

Both stores also say here, in the same words, why their database did not open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger(__name__)

#: Past this size of the ``-wal`` file the next checkpoint empties it.
LIMIT_BYTES = 16 * 1024 * 1024
#: Commits a store reports to :meth:`WalCheckpointer.committed` at once.
TELL_EVERY = 16


def pragma(limit_bytes: int = LIMIT_BYTES) -> str:
    """The ``journal_size_limit`` pragma for the writing connection."""
    return f"PRAGMA journal_size_limit={int(limit_bytes)}"


def open_failure(err: OSError | sqlite3.Error, *, database: str, then: str) -> str:
    """Why ``database`` (its name in a sentence: ``"state database /x/orchestrator.db"``)
    did not open with ``err``, and the fix. A damaged file, or one that is not SQLite,
    is never guessed at nor overwritten: the operator moves it aside, and ``then`` says
    what starting without it means. Anything else is the directory's fault."""
    if isinstance(err, sqlite3.DatabaseError) and not isinstance(err, sqlite3.OperationalError):
        return (
            f"{database} is corrupt or not a tslice database ({err}); nothing was changed. "
            f"Move it aside (keep it for a post-mortem) and start again: {then}"
        )
    return f"cannot open {database}: {err} (check --state-dir exists and is writable)"


class WalCheckpointer:
    """Checkpoints ``path`` every ``every_commits`` commits reported by :meth:`committed`,
    and empties a WAL grown past ``limit_bytes`` (see the module doc)."""

    def __init__(
        self, path: Path, *, every_commits: int = 256, limit_bytes: int = LIMIT_BYTES
    ) -> None:
        if every_commits < 1:
            raise ValueError(f"every_commits must be >= 1 (got {every_commits})")
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be >= 1 (got {limit_bytes})")
        self.path = path
        self.every_commits = every_commits
        self.limit_bytes = limit_bytes
        self._wal = Path(f"{path}-wal")
        self._commits = 0
        self._since_size_check = 0
        self._pending: concurrent.futures.Future[None] | None = None
        self._conn: sqlite3.Connection | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tslice-wal-checkpoint"
        )

    def committed(self, count: int = 1) -> None:
        """Count ``count`` commits; start a checkpoint when due and none is running. Every
        ``every_commits`` commits the writer also looks at the WAL: past twice the limit it
        waits for a checkpoint that empties it."""
        self._commits += count
        self._since_size_check += count
        if self._commits >= self.every_commits and (self._pending is None or self._pending.done()):
            self._commits = 0
            self._pending = self._executor.submit(self._checkpoint, "PASSIVE")
        if self._since_size_check < self.every_commits:
            return
        self._since_size_check = 0
        if self._wal_bytes() > 2 * self.limit_bytes:
            self._catch_up()

    def _catch_up(self) -> None:
        # On the writer's thread: it waits, so the TRUNCATE cannot be starved by it.
        if self._pending is not None:
            self._pending.result()
        self._pending = self._executor.submit(self._checkpoint, "TRUNCATE")
        self._pending.result()

    def transaction(self, conn: sqlite3.Connection) -> _Transaction:
        """One write transaction on ``conn`` (opened with ``isolation_level=None``), as a
        ``with`` block: ``BEGIN IMMEDIATE``, committed when the block ends, rolled back if
        anything in it (or the commit) fails; a commit counts towards the next checkpoint."""
        return _Transaction(conn, self)

    async def close(self) -> None:
        """A last checkpoint that empties the WAL, then release the thread."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._executor, self._checkpoint, "TRUNCATE"
            )
        finally:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._close)
            self._executor.shutdown(wait=True)

    # ---- thread side ---------------------------------------------------------------------

    def _checkpoint(self, mode: str) -> None:
        self._run_checkpoint(mode)
        if mode == "PASSIVE" and self._wal_bytes() > self.limit_bytes:
            # What is left since the PASSIVE pass is little: the writer waits briefly.
            self._run_checkpoint("TRUNCATE")

    def _run_checkpoint(self, mode: str) -> None:
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(self.path, isolation_level=None)
                self._conn.execute("PRAGMA busy_timeout=5000")
            self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchall()
        except sqlite3.Error as err:
            # Not fatal: the WAL keeps every commit; the next checkpoint catches up.
            log.warning("checkpoint of %s failed: %s", self.path, err)

    def _wal_bytes(self) -> int:
        try:
            return os.stat(self._wal).st_size
        except OSError:
            return 0

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _Transaction:
    # A plain class, not contextlib: the agent opens one per state change, on the loop.
    __slots__ = ("_checkpoints", "_conn")

    def __init__(self, conn: sqlite3.Connection, checkpoints: WalCheckpointer) -> None:
        self._conn = conn
        self._checkpoints = checkpoints

    def __enter__(self) -> sqlite3.Connection:
        self._conn.execute("BEGIN IMMEDIATE")
        return self._conn

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self._conn.rollback()  # and the exception goes on
            return
        try:
            self._conn.commit()
        except BaseException:
            self._conn.rollback()
            raise
        self._checkpoints.committed()
