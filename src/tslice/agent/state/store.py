"""The node's records in memory (jobs, operations, grant marks), mirrored to the store.

The runner reads records here without an ``await`` and changes them through
:meth:`Ledger.commit`: memory and disk in one synchronous step, the memory side
undone if the disk refuses, so a reply never gets ahead of the store and a refused
write changes nothing. Only the outcome of a finished backend call is kept in memory
even when the disk refuses (:meth:`Ledger.record_outcome`): the state really moved,
and a restart asks the backend again.

Outcomes are written at the end of the loop turn they finished in (:meth:`Ledger.flush`,
scheduled with ``call_soon``), all of that turn in one transaction: the two moves of a
hand-over (the holder's snapshot, the next job's restore) usually finish together, so a
grant costs three commits instead of four (≈ 0.25 ms of agent CPU each under load). The
flush runs before anything woken by the outcome (callbacks run in the order they were
scheduled: the operation's waiters, and so the Grant reply, come after it), and before
any :meth:`commit` or :meth:`prune` (in the same transaction as the commit, ahead of its
records: a newer record of the same job is never overwritten by an older outcome).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from tslice.agent import store
from tslice.agent.jobs import model
from tslice.rpc import refusals

log = logging.getLogger(__name__)
_STATE_NAMES = tuple(s.value for s in model.State)


class Ledger:
    """One node's records, keyed as ``model.Key`` (job, group), and their store."""

    def __init__(
        self, *, node: str, state: store.Store, retention_s: float, max_operations: int
    ) -> None:
        self.node = node
        self.retention_s = retention_s
        self.max_operations = max_operations
        self._store = state
        self.jobs: dict[model.Key, model.Job] = {}
        self.operations: dict[str, model.Operation] = {}
        self.marks: dict[str, model.GrantMark] = {}
        #: Outcomes in memory whose write waits for the end of the loop turn (see above).
        self._unsaved: list[tuple[model.Job, model.Operation]] = []

    async def load(self) -> None:
        loaded = await self._store.load()
        self.jobs, self.operations, self.marks = (
            loaded.job_map,
            loaded.operation_map,
            loaded.grant_map,
        )

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
        return self.jobs.get(self.key(job_id, group))

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
        found = self.jobs.get(job.key)
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
        jobs_: Iterable[model.Job] = (),
        ops: Iterable[model.Operation] = (),
        marks: Iterable[model.GrantMark] = (),
        previous: model.Job | None,
    ) -> None:
        """Apply records in memory and on disk; undo the memory side if the disk refuses."""
        job_list, op_list, mark_list = list(jobs_), list(ops), list(marks)
        before_marks = {m.group: self.marks.get(m.group) for m in mark_list}
        # A record made without a group takes the group of the first request naming one.
        moved = (
            [previous.key]
            if previous is not None
            and previous.key not in {j.key for j in job_list}
            and any(j.job_id == previous.job_id for j in job_list)
            else []
        )
        for key in moved:
            self.jobs.pop(key, None)
        self._apply(job_list, op_list)
        for mark in mark_list:
            self.marks[mark.group] = mark
        # Outcomes not yet on disk go first, in the same transaction (older records).
        unsaved, self._unsaved = self._unsaved, []
        try:
            self._store.put(
                job_records=[j for j, _ in unsaved] + job_list,
                operation_records=[o for _, o in unsaved] + op_list,
                grant_marks=mark_list,
                deleted_jobs=moved,
            )
        except Exception as err:
            self._unsaved = unsaved + self._unsaved  # the scheduled flush tries them again
            for job in job_list:
                self.jobs.pop(job.key, None)
            if previous is not None:
                self.jobs[previous.key] = previous
            for op in op_list:
                self.operations.pop(op.op_id, None)
            for group, old in before_marks.items():
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

    def record_outcome(self, job: model.Job, op: model.Operation) -> None:
        """Keep a finished operation and its job; on disk at the end of this loop turn
        (see the module docstring), in memory even if the disk refuses."""
        self._apply([job], [op])
        first = not self._unsaved
        self._unsaved.append((job, op))
        if not first:
            return  # the flush of this turn is scheduled already
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): at once
            self.flush()
        else:
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the outcomes kept since the last write, in one transaction."""
        unsaved, self._unsaved = self._unsaved, []
        if not unsaved:
            return
        try:
            self._store.put(
                job_records=[j for j, _ in unsaved], operation_records=[o for _, o in unsaved]
            )
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
            kept = [op.op_id for op in finished if op.op_id not in set(drop)]
            drop.extend(kept[:excess])
        for op_id in drop:
            self.operations.pop(op_id, None)
        self._store.delete_operations(drop)
        return len(drop)

    def _apply(self, job_list: Iterable[model.Job], op_list: Iterable[model.Operation]) -> None:
        for job in job_list:
            self.jobs[job.key] = job
        for op in op_list:
            self.operations[op.op_id] = op
