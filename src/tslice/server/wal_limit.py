"""A WAL checkpointer that keeps the ``-wal`` file of a SQLite database bounded.

:class:`tslice.server.sqlite_wal.WalCheckpointer` runs PASSIVE checkpoints beside the
writer (they never block it). Under steady writes a PASSIVE checkpoint never catches
up with the last commit, so SQLite never starts the WAL over and the file grows
without bound (hundreds of MB for the orchestrator and the agent under load). Here a
PASSIVE checkpoint that leaves the WAL over ``limit_bytes`` is followed by a TRUNCATE
one: it waits for the writer's current transaction, holds the next one back while it
copies what the PASSIVE pass left and syncs, and empties the file. A writer waits for
it once per ``limit_bytes`` of writes (tens of milliseconds, more on a slow disk):
the price of a bounded disk. The stores also set ``PRAGMA journal_size_limit`` so
that a WAL that SQLite starts over by itself (when the writer pauses) is cut back.

That alone is no bound: on a slow disk the checkpoint thread falls behind the
writer, and a TRUNCATE that waits for a writer committing back to back can starve
(its busy handler sleeps, the writer takes the lock again first) and give up. So the
writer checks the file too, every ``every_commits`` commits: past twice the limit it
waits, on its own thread, for the checkpoint running and then for a TRUNCATE. The
writer's stall is rare and bounded by one checkpoint; the WAL stays under about
``2 * limit_bytes`` plus one round of commits, however slow the disk.
"""

from __future__ import annotations

import os
from pathlib import Path

from tslice.server import sqlite_wal

#: Past this size of the ``-wal`` file the next checkpoint empties it.
LIMIT_BYTES = 16 * 1024 * 1024


class BoundedWalCheckpointer(sqlite_wal.WalCheckpointer):
    """``WalCheckpointer`` whose checkpoints empty a WAL grown past ``limit_bytes``."""

    def __init__(
        self, path: Path, *, every_commits: int = 256, limit_bytes: int = LIMIT_BYTES
    ) -> None:
        super().__init__(path, every_commits=every_commits)
        if limit_bytes < 1:
            raise ValueError(f"limit_bytes must be >= 1 (got {limit_bytes})")
        self.limit_bytes = limit_bytes
        self._wal = Path(f"{path}-wal")
        self._since_size_check = 0

    def committed(self, count: int = 1) -> None:
        super().committed(count)
        self._since_size_check += count
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

    def _checkpoint(self, mode: str) -> None:
        # In the checkpointer's thread, like the checkpoint itself.
        super()._checkpoint(mode)
        if mode == "PASSIVE" and self._wal_bytes() > self.limit_bytes:
            # What is left since the PASSIVE pass is little: the writer waits briefly.
            super()._checkpoint("TRUNCATE")

    def _wal_bytes(self) -> int:
        try:
            return os.stat(self._wal).st_size
        except OSError:
            return 0


def pragma(limit_bytes: int = LIMIT_BYTES) -> str:
    """The ``journal_size_limit`` pragma for the writing connection."""
    return f"PRAGMA journal_size_limit={int(limit_bytes)}"
