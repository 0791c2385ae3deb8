"""The node's records (jobs, operations, grant marks), in memory and on disk: the agent's
persistence, in one place.

The runner reads records here without an ``await`` and changes them through
:meth:`Store.commit`: memory and disk in one synchronous step (one SQLite transaction on
the event loop; the file itself is :mod:`tslice.agent.state.schema`), the memory side
undone if the disk refuses, so a refused write changes nothing, and a caller cancelled
at an ``await`` is cancelled either before anything changed or after its operation
started (``tslice.agent.moves.runner``). A record is on disk before the backend call it
announces starts ("write before act"): an agent SIGKILLed at any moment restarts knowing
every job, every saved state and every operation a caller may still ask about, and asks
the backend what became of the moves it left TRANSITIONING.

The outcome of a finished backend call (:meth:`Store.keep_outcome`) is in memory at once
(the state really moved, even if the disk refuses) and on disk before anything shows it:

- it goes with the next write, in the same transaction and ahead of that write's records
  (an older outcome never overwrites a newer record);
- whoever answers a caller from the records flushes first (:meth:`Store.flush`);
- otherwise it is written :data:`OUTCOME_WRITE_S` later.

So the two moves of a hand-over cost three transactions, not four: the holder's snapshot
starts; its outcome goes with the start of the next job's restore (the Grant that waited
for it starts the restore before the delay runs out); the restore's outcome is written
before the Grant's reply. The delay only decides which transaction carries an outcome:
an agent killed before it was written asks the backend on restart, as it does for a
move it was killed in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import sqlite3
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tslice.agent.jobs import model
from tslice.agent.state import schema
from tslice.rpc import refusals
from tslice.server import sqlite_wal

log = logging.getLogger(__name__)
_T = TypeVar("_T")
_STATE_NAMES = tuple(s.value for s in model.State)

#: How long a kept outcome waits for a write to go with (see the module docstring), s.
OUTCOME_WRITE_S = 0.005


class Store:
    """One node's records, keyed as ``model.Key`` (job, group), in memory and on disk.

    Open with :meth:`open` (the records are loaded then); ``retention_s`` and
    ``max_operations`` bound the finished operations kept (:meth:`prune`).
    """

    def __init__(
        self,
        path: Path,
        *,
        node: str = "",
        retention_s: float = 24 * 3600.0,
        max_operations: int = 10_000,
    ) -> None:
        self.path = path
        self.node = node
        self.retention_s = retention_s
        self.max_operations = max_operations
        self.jobs: dict[model.Key, model.Job] = {}
        #: The same records by group: a rule that looks at a group's jobs reads only them.
        self._groups: dict[str, dict[model.Key, model.Job]] = {}
        self.operations: dict[str, model.Operation] = {}
        self.marks: dict[str, model.GrantMark] = {}
        #: Outcomes in memory not yet on disk, and the timer that writes them.
        self._unsaved: list[tuple[model.Job, model.Operation]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._conn: sqlite3.Connection | None = None
        self._checkpoints = sqlite_wal.WalCheckpointer(path)
        #: Commits the checkpointer was not told of yet.
        self._untold = 0
        # Opening, loading and reading the leader term block: they run in this thread.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tslice-agent-db"
        )

    @classmethod
    async def open(
        cls,
        state_dir: Path,
        *,
        node: str = "",
        retention_s: float = 24 * 3600.0,
        max_operations: int = 10_000,
    ) -> Store:
        """The store of ``state_dir``, its records loaded."""
        store = cls(
            state_dir / schema.DB_FILE,
            node=node,
            retention_s=retention_s,
            max_operations=max_operations,
        )
        try:
            store._conn = await store._run(schema.connect, store.path)
            await store._run(store._load)
        except sqlite3.DatabaseError as err:
            await store._close_connection()
            raise schema.StateDatabaseError(
                sqlite_wal.open_failure(
                    err,
                    database=f"the agent state database {store.path}",
                    then="the jobs' saved states on this node are then unknown to the agent",
                )
            ) from err
        except BaseException:
            await store._close_connection()
            raise
        return store

    async def close(self) -> None:
        """Write the outcomes kept, then close the file (a last checkpoint empties the WAL)."""
        self.flush()
        await self._close_connection()

    # ---- reading -------------------------------------------------------------------------

    def key(self, job_id: str, group: str) -> model.Key:
        """The record a request means: its (job, group), or the job's only record.

        A request that names no group (llm-d's clients may not) means the job's one
        record on this node; a record made without a group serves the first request
        that names one (and takes that group, see :meth:`commit`).
        """
        if group:
            key = (job_id, group)
            if key not in self.jobs and (job_id, "") in self.jobs:
                return (job_id, "")
            return key
        found = [k for k in self.jobs if k[0] == job_id]
        if len(found) > 1:
            groups = ", ".join(sorted(k[1] or '""' for k in found))
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job_id} has state for groups {groups} on node {self.node}; "
                "name the group in the request",
            )
        return found[0] if found else (job_id, "")

    def find(self, job_id: str, group: str) -> model.Job | None:
        """The record a request on ``job_id`` (and ``group``) means, if there is one."""
        found = self.jobs.get((job_id, group)) if group else None  # the usual case: its own
        return found if found is not None else self.jobs.get(self.key(job_id, group))

    def in_group(self, group: str) -> Collection[model.Job]:
        """The records of ``group`` (a rule about a group's residents reads only them)."""
        return self._groups.get(group, {}).values()

    def sorted_jobs(self) -> list[model.Job]:
        return sorted(self.jobs.values(), key=lambda j: j.key)

    def operation(self, op_id: str) -> model.Operation:
        op = self.operations.get(op_id)
        if op is None:
            hours = self.retention_s / 3600
            raise refusals.Refused(
                refusals.Code.NOT_FOUND,
                f"operation {op_id} is not known on node {self.node}; finished operations are "
                f"kept for {hours:g} hours (at most {self.max_operations})",
            )
        return op

    def running(self, job: model.Job) -> model.Operation:
        """The operation a TRANSITIONING job is in."""
        op = self.operations.get(job.operation_id)
        if op is None:
            raise refusals.Refused(
                refusals.Code.INTERNAL,
                f"job {job.job_id} is TRANSITIONING on node {self.node} with no known "
                "operation; restart the agent to settle it",
            )
        return op

    def previous(self, job: model.Job) -> model.Job | None:
        """The record ``job`` replaces (its own key, or the job's record made without group)."""
        found = self.jobs.get((job.job_id, job.group))
        if found is None and job.group:
            found = self.jobs.get((job.job_id, ""))
        return found

    def job_counts(self) -> dict[str, int]:
        """Jobs by state (every state listed); safe to call from another thread."""
        counts = dict.fromkeys(_STATE_NAMES, 0)
        for job in list(self.jobs.values()):  # one C-level copy: the loop may be mutating
            counts[job.state.value] += 1
        return counts

    # ---- changing -----------------------------------------------------------------------

    def commit(
        self,
        *,
        jobs: Sequence[model.Job] = (),
        ops: Sequence[model.Operation] = (),
        marks: Sequence[model.GrantMark] = (),
        previous: model.Job | None,
    ) -> None:
        """Apply records in memory and on disk, with the outcomes kept so far; undo the
        memory side (and keep the outcomes for later) if the disk refuses."""
        before_marks = [(m.group, self.marks.get(m.group)) for m in marks] if marks else []
        # Only a record made without a group can be replaced under another key.
        moved = _moved(previous, jobs) if previous is not None and not previous.group else []
        for key in moved:
            del self.jobs[key], self._groups[key[1]][key]
        for job in jobs:
            key = (job.job_id, job.group)
            self.jobs[key] = self._groups.setdefault(job.group, {})[key] = job
        for op in ops:
            self.operations[op.op_id] = op
        for mark in marks:
            self.marks[mark.group] = mark
        unsaved, self._unsaved = self._unsaved, []
        try:
            self._write(unsaved, jobs, ops, marks, moved)
        except Exception as err:
            self._unsaved = unsaved + self._unsaved  # written with the next write after all
            for job in jobs:
                self.jobs.pop((job.job_id, job.group), None)
                self._groups[job.group].pop((job.job_id, job.group), None)
            if previous is not None:
                key = (previous.job_id, previous.group)
                self.jobs[key] = self._groups.setdefault(previous.group, {})[key] = previous
            for op in ops:
                self.operations.pop(op.op_id, None)
            for group, old in before_marks:
                if old is None:
                    self.marks.pop(group, None)
                else:
                    self.marks[group] = old
            log.exception("could not persist agent state")
            raise refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"node {self.node} cannot persist its state ({type(err).__name__}: {err}); "
                "nothing was changed, fix the state directory and retry",
            ) from err

    def keep_outcome(self, job: model.Job, op: model.Operation) -> None:
        """A finished operation and its job: in memory now, on disk before anything shows
        them (see the module docstring), in memory even if the disk refuses."""
        key = (job.job_id, job.group)
        self.jobs[key] = self._groups.setdefault(job.group, {})[key] = job
        self.operations[op.op_id] = op
        self._unsaved.append((job, op))
        if self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a synchronous caller): at once
                self.flush()
            else:
                self._timer = loop.call_later(OUTCOME_WRITE_S, self.flush)

    def flush(self) -> None:
        """Write the outcomes kept since the last write, in one transaction."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        unsaved, self._unsaved = self._unsaved, []
        if not unsaved:
            return
        try:
            self._write(unsaved)
        except Exception:
            # The outcomes stay served from memory; a restart re-asks the backend.
            ids = ", ".join(o.op_id for _, o in unsaved)
            log.exception("could not persist the outcome of operation(s) %s", ids)

    def prune(self, *, now: float) -> int:
        """Forget finished operations past retention (and beyond the count limit)."""
        self.flush()  # an outcome written after the delete would bring its row back
        referenced = {j.operation_id for j in self.jobs.values()}
        finished = sorted(
            (op for op in self.operations.values() if op.finished and op.op_id not in referenced),
            key=lambda op: op.finished_at or op.started_at,
        )
        cutoff = now - self.retention_s
        drop = [op.op_id for op in finished if (op.finished_at or op.started_at) < cutoff]
        excess = len(self.operations) - len(drop) - self.max_operations
        if excess > 0:
            dropped = set(drop)
            drop.extend([op.op_id for op in finished if op.op_id not in dropped][:excess])
        for op_id in drop:
            self.operations.pop(op_id, None)
        if drop:
            with self._checkpoints.transaction(self._connection()) as conn:
                conn.executemany(schema.DELETE_OPERATION, [(op_id,) for op_id in drop])
        return len(drop)

    # ---- the leader term (tslice.security.fencing.TermStore) ---------------------------

    def put_leader_term(self, term: int, leader: str = "") -> None:
        """Store the highest leader term seen and who sent it, synchronously (before the
        directive runs)."""
        with self._checkpoints.transaction(self._connection()) as conn:
            conn.execute(schema.UPSERT_TERM, (0, term, leader))

    async def leader_term(self) -> tuple[int, str]:
        """The leader term stored and its leader (0 and "": none seen)."""
        row = await self._run(lambda: self._connection().execute(schema.SELECT_TERM).fetchone())
        return (int(row[0]), str(row[1])) if row else (0, "")

    # ---- SQLite side -----------------------------------------------------------------------

    def _write(
        self,
        outcomes: Sequence[tuple[model.Job, model.Operation]],
        jobs: Sequence[model.Job] = (),
        ops: Sequence[model.Operation] = (),
        marks: Sequence[model.GrantMark] = (),
        deleted_jobs: Sequence[model.Key] = (),
    ) -> None:
        """One transaction, synchronously on the loop (see the module docstring): the
        kept ``outcomes`` first (they are older), then the records."""
        if self._conn is None:
            raise self._closed()
        job_rows, op_rows = [], []
        for job, op in outcomes:
            job_rows.append(_job_row(job))
            op_rows.append(_operation_row(op))
        for job in jobs:
            job_rows.append(_job_row(job))
        for op in ops:
            op_rows.append(_operation_row(op))
        mark_rows = []
        for mark in marks:
            mark_rows.append((mark.group, mark.epoch, mark.job_id))
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")
        try:
            for sql, rows in (
                (schema.DELETE_JOB, deleted_jobs),
                (schema.UPSERT_JOB, job_rows),
                (schema.UPSERT_OPERATION, op_rows),
                (schema.UPSERT_MARK, mark_rows),
            ):
                if rows:
                    conn.executemany(sql, rows)
            conn.commit()
        except BaseException:
            conn.rollback()  # and the error goes on: nothing of the change is kept
            raise
        # The checkpointer hears of commits in bunches (it acts every few hundred).
        self._untold += 1
        if self._untold >= sqlite_wal.TELL_EVERY:
            self._checkpoints.committed(self._untold)
            self._untold = 0

    def _load(self) -> None:
        conn = self._connection()
        jobs = (_job_from_row(row) for row in conn.execute(schema.SELECT_JOBS))
        self.jobs = {(j.job_id, j.group): j for j in jobs}
        self._groups = {}
        for key, job in self.jobs.items():
            self._groups.setdefault(job.group, {})[key] = job
        ops = (_operation_from_row(row) for row in conn.execute(schema.SELECT_OPERATIONS))
        self.operations = {op.op_id: op for op in ops}
        self.marks = {
            str(grp): model.GrantMark(group=str(grp), epoch=int(epoch), job_id=str(job_id))
            for grp, epoch, job_id in conn.execute(schema.SELECT_MARKS)
        }

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise self._closed()
        return self._conn

    def _closed(self) -> sqlite3.ProgrammingError:
        return sqlite3.ProgrammingError(f"the agent state database {self.path} is closed")

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            await self._checkpoints.close()
        self._executor.shutdown(wait=True)


def _moved(previous: model.Job, jobs: Sequence[model.Job]) -> list[model.Key]:
    """``previous``'s key if ``jobs`` replace it under another key (a record made without
    a group that took the group of a request naming one), else nothing."""
    old = (previous.job_id, previous.group)
    same_job = False
    for job in jobs:
        if (job.job_id, job.group) == old:
            return []
        same_job = same_job or job.job_id == previous.job_id
    return [old] if same_job else []


def _job_row(job: model.Job) -> tuple[object, ...]:
    """A job record's row, in the order of ``schema.JOB_COLUMNS``."""
    previous = job.previous_state
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
        None if previous is None else previous.value,
    )


def _operation_row(op: model.Operation) -> tuple[object, ...]:
    """An operation's row, in the order of ``schema.OPERATION_COLUMNS``."""
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


def _job_from_row(row: Sequence[Any]) -> model.Job:
    (job_id, group, state, backend, choice, config, footprint, backend_state) = row[:8]
    (error, operation_id, device_bytes, host_bytes, previous) = row[8:]
    return model.Job(
        job_id=str(job_id),
        group=str(group),
        state=model.State(state),
        backend=str(backend),
        choice=str(choice),
        config=bytes(config) if isinstance(config, (bytes, bytearray, memoryview)) else b"",
        footprint_bytes=int(footprint),
        backend_state=json.loads(str(backend_state)),
        error=str(error),
        operation_id=str(operation_id),
        device_bytes=int(device_bytes),
        host_bytes=int(host_bytes),
        previous_state=None if previous is None else model.State(previous),
    )


def _operation_from_row(row: Sequence[Any]) -> model.Operation:
    (op_id, job_id, kind, backend, status, started_at) = row[:6]
    (finished_at, storage_bytes, device_bytes, error, group) = row[6:]
    return model.Operation(
        op_id=str(op_id),
        job_id=str(job_id),
        kind=model.Kind(kind),
        backend=str(backend),
        status=model.OpStatus(status),
        started_at=float(started_at),
        finished_at=None if finished_at is None else float(finished_at),
        storage_bytes=None if storage_bytes is None else int(storage_bytes),
        device_bytes=None if device_bytes is None else int(device_bytes),
        error=None if error is None else str(error),
        group=str(group),
    )
