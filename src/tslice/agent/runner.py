"""The async driver of the node agent: applies ``jobs`` plans, runs backends, persists.

Each mutating request takes the job's lock, gathers what the pure planner needs (the
route, and what the backend reports for a FAULTED job), plans synchronously, stores
the result *before* replying, and spawns the backend call as a named task. Because
planning and the in-memory update happen without an await in between, two requests
can never both see a job (or a group) free: the second one is refused.

Between planning and starting the backend call there is no ``await`` at all: the
memory update, the store's transaction (synchronous, see ``tslice.agent.store``) and
the spawn of the operation's task happen in one step. A caller that goes away (a
cancelled RPC, an orchestrator killed mid-call) is cancelled at an ``await``, so
either before anything changed or after the operation was started, never in
between (no job stored TRANSITIONING whose operation never runs). Keep it so:
``_commit`` and ``_launch`` are plain functions on purpose.

Backend calls go through :meth:`AgentCore._call`, the private wrapper that enforces
the operation deadline, retries :class:`~tslice.agent.backends.base.TransientBackendError`
with backoff inside it, turns every other exception into a readable error, and
records metrics. Waiters are woken through one future per operation, resolved once
the outcome is on disk.

A Grant is one node step of a switch: it snapshots the jobs it is asked to evict,
restores (or activates) the granted job, and records the grant, each move being an
ordinary, pollable, persisted operation; see :meth:`AgentCore.grant`.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from tslice.agent import guarded, jobs, metrics, store
from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import refusals, tasks

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Upper bound of one WaitOperation long-poll (and of a request's ``wait_ms``).
MAX_WAIT_S = 60.0
#: Moves one Grant may make (evict, bring in) before it reports that states keep changing.
_MAX_GRANT_STEPS = 8
_STATE_NAMES = tuple(s.value for s in jobs.State)


@dataclasses.dataclass(frozen=True)
class GrantOutcome:
    """What one Grant did on this node."""

    #: State of the granted job at the reply.
    state: jobs.State
    #: The grant is recorded and the job is resident.
    granted: bool
    #: Operations the Grant started or found running, as of the reply, in order.
    operations: tuple[jobs.Operation, ...] = ()
    #: A restore of the granted job finished during this Grant.
    restored: bool = False


class AgentCore:
    """Jobs, operations and grant epochs of one node, and the backends that move state."""

    def __init__(
        self,
        *,
        node: str,
        backends: Mapping[str, base.Backend],
        default_backend: str,
        state: store.Store,
        agent_metrics: metrics.AgentMetrics,
        operation_timeout_s: float = 600.0,
        operation_retention_s: float = 24 * 3600.0,
        max_operations: int = 10_000,
        channel_registered: Callable[[str], bool] | None = None,
        on_backend_error: Callable[[str, base.BackendError], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if default_backend not in backends:
            raise ValueError(f"default backend {default_backend!r} is not among the backends")
        self.node = node
        self.backends = dict(backends)
        self.default_backend = default_backend
        self.operation_timeout_s = operation_timeout_s
        self._guarded = guarded.GuardedBackends(
            backends, operation_timeout_s=operation_timeout_s, on_unavailable=on_backend_error
        )
        self.operation_retention_s = operation_retention_s
        self.max_operations = max_operations
        self._store = state
        self._metrics = agent_metrics
        agent_metrics.count_jobs(self.job_counts)
        self._channel_registered = channel_registered or (lambda _job_id: False)
        self._clock = clock
        #: One record per (job, group): see ``jobs.Key``.
        self._jobs: dict[jobs.Key, jobs.Job] = {}
        self._ops: dict[str, jobs.Operation] = {}
        self._grants: dict[str, jobs.GrantMark] = {}
        #: Resolved once an operation's outcome is stored (and applied in memory).
        self._done: dict[str, asyncio.Future[None]] = {}
        #: One lock per job id: a job's records of several groups change one at a time.
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._running: set[asyncio.Task[Any]] = set()

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Load the persisted state; settle jobs a dead agent left TRANSITIONING."""
        loaded = await self._store.load()
        self._jobs, self._ops, self._grants = loaded.job_map, loaded.operation_map, loaded.grant_map
        now = self._clock()
        for job in list(self._jobs.values()):
            if job.state is not jobs.State.TRANSITIONING:
                continue
            recovered: jobs.State | None = None
            if job.backend in self.backends:
                recovered = await self._recover(job.backend, job)
            new_job, op = jobs.after_restart(
                job, self._ops.get(job.operation_id), recovered=recovered, now=now
            )
            if job.backend not in self.backends:
                new_job = dataclasses.replace(
                    new_job,
                    error=f"{new_job.error} (backend {job.backend} is not enabled on this node)",
                )
            self._jobs[job.key] = new_job
            records = [op] if op is not None else []
            if op is not None:
                self._ops[op.op_id] = op
            self._store.put(job_records=[new_job], operation_records=records)
            log.warning(
                "job %s was TRANSITIONING when the agent stopped; now %s",
                job.job_id,
                new_job.state.value,
                extra={"job_id": job.job_id, "operation_id": job.operation_id},
            )
        # Operations whose job record was lost or moved on are settled the same way.
        orphans = [op for op in self._ops.values() if not op.finished]
        for op in orphans:
            failed = dataclasses.replace(
                op,
                status=jobs.OpStatus.FAILED,
                finished_at=now,
                error=f"agent restarted during operation {op.op_id}",
            )
            self._ops[op.op_id] = failed
            self._store.put(operation_records=[failed])
        await self.prune_operations()

    async def close(self, *, grace_s: float) -> None:
        """Give in-flight operations ``grace_s`` to finish, then cancel them.

        A cancelled operation is not recorded as failed: its job stays TRANSITIONING on
        disk, and the next start asks the backend what really happened.
        """
        running = list(self._running)
        if running:
            await asyncio.wait(running, timeout=grace_s)
        await tasks.cancel_all([t for t in running if not t.done()])

    # ---- queries -------------------------------------------------------------------------

    def list_jobs(self) -> list[jobs.Job]:
        return sorted(self._jobs.values(), key=lambda j: j.key)

    def job(self, job_id: str, group: str = "") -> jobs.Job | None:
        return self._jobs.get(self._key(job_id, group))

    def _key(self, job_id: str, group: str) -> jobs.Key:
        """The record a request means: its (job, group), or the job's only record.

        A request that names no group (llm-d's clients may not) means the job's one
        record on this node; a record made without a group serves the first request
        that names one (and takes that group, see ``_commit``).
        """
        if group:
            key = (job_id, group)
            if key not in self._jobs and (job_id, "") in self._jobs:
                return (job_id, "")
            return key
        found = [k for k in self._jobs if k[0] == job_id]
        if len(found) > 1:
            groups = ", ".join(sorted(k[1] or '""' for k in found))
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job_id} has state for groups {groups} on node {self.node}; "
                "name the group in the request",
            )
        return found[0] if found else (job_id, "")

    def now(self) -> float:
        return self._clock()

    def get_operation(self, op_id: str) -> jobs.Operation:
        op = self._ops.get(op_id)
        if op is None:
            hours = self.operation_retention_s / 3600
            raise refusals.Refused(
                refusals.Code.NOT_FOUND,
                f"operation {op_id} is not known on node {self.node}; finished operations are "
                f"kept for {hours:g} hours (at most {self.max_operations})",
            )
        return op

    async def wait_operation(self, op_id: str, *, timeout_s: float) -> jobs.Operation:
        """The operation once finished, or as it is (PENDING) after ``timeout_s``."""
        (op,) = await self.settle([self.get_operation(op_id)], timeout_s=timeout_s)
        return op

    async def settle(
        self, ops: Sequence[jobs.Operation], *, timeout_s: float | None
    ) -> list[jobs.Operation]:
        """``ops`` once all finished, or as they are after ``timeout_s`` (None: no limit)."""
        waits = [f for op in ops if not op.finished and (f := self._done.get(op.op_id)) is not None]
        if waits and (timeout_s is None or timeout_s > 0):
            limit = None if timeout_s is None else min(timeout_s, MAX_WAIT_S)
            # asyncio.wait never cancels the shared futures, whoever stops waiting.
            await asyncio.wait(waits, timeout=limit)
        return [self._ops.get(op.op_id, op) for op in ops]

    async def accelerators(self) -> list[base.Accelerator]:
        return await self._guarded.accelerators()

    # ---- requests -------------------------------------------------------------------------

    async def snapshot(
        self,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int = 0,
        wait_s: float = 0.0,
    ) -> jobs.Operation:
        """Start a snapshot; return its operation once finished or after ``wait_s``."""
        op = await self._start_snapshot(
            job_id=job_id, group=group, config=config, deprecated_backend=deprecated_backend
        )
        (op,) = await self.settle([op], timeout_s=wait_s)
        return op

    async def restore(
        self,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int = 0,
        wait_s: float = 0.0,
    ) -> jobs.Operation:
        """Start a restore; return its operation once finished or after ``wait_s``."""
        op = await self._start_restore(
            job_id=job_id, group=group, config=config, deprecated_backend=deprecated_backend
        )
        (op,) = await self.settle([op], timeout_s=wait_s)
        return op

    async def grant(
        self,
        *,
        job_id: str,
        group: str,
        epoch: int,
        footprint_bytes: int,
        config: pb.BackendConfig | None,
        evict: Sequence[str] = (),
        give_way: Sequence[jobs.Key] = (),
        restore: bool = False,
        wait_s: float | None = None,
    ) -> GrantOutcome:
        """Make ``job_id``'s state for ``group`` resident on this node and record the grant.

        First the jobs in ``evict`` whose state for the group is resident here are
        snapshotted (an operation already running on one is waited for); then, while the
        job would not fit on the devices, the residents in ``give_way`` (other groups'
        deferred residents, in order); then the job is restored if it is SAVED and
        ``restore`` is set, or activated if it has nothing resident; the grant mark is
        stored with that step. Each move is an ordinary operation with its own id.

        ``wait_s=None`` is the original Grant: wait for the activation however long it
        takes and raise :class:`refusals.Refused` if it fails. Otherwise the outcome comes
        back after at most ``wait_s`` with ``granted=False`` and the operations so far
        when the node is not done or an operation FAILED; re-issuing the same Grant
        continues from where the node stands.
        """
        legacy = wait_s is None
        loop = asyncio.get_running_loop()
        deadline = None if wait_s is None else loop.time() + min(wait_s, MAX_WAIT_S)
        # A stale grant must not evict anything.
        jobs.check_epoch(
            job_id=job_id, group=group, epoch=epoch, last=self._grants.get(group), node=self.node
        )
        key = self._key(job_id, group)
        evictees = [self._key(other, group) for other in dict.fromkeys(evict) if other != job_id]
        yielding = [k for k in dict.fromkeys(give_way) if k[1] != group]
        seen: dict[str, jobs.Operation] = {}
        restored = False
        for _ in range(_MAX_GRANT_STEPS + len(yielding)):
            moves: list[jobs.Operation] = []
            for other in evictees:
                if self._resident_or_faulted(other):
                    op = await self._start_eviction(job_id=other[0], group=other[1])
                    if op is not None:
                        moves.append(op)
            if not moves and yielding:
                op = await self._make_room(key, yielding, footprint_bytes, config)
                if op is not None:
                    moves.append(op)
            if not moves:
                target = await self._start_grant(
                    job_id=job_id,
                    group=group,
                    epoch=epoch,
                    footprint_bytes=footprint_bytes,
                    config=config,
                    restore=restore,
                    follow=not legacy,
                )
                key = self._key(job_id, group)
                if target is None:
                    return self._grant_outcome(key, seen, granted=True, restored=restored)
                moves.append(target)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            moves = await self.settle(moves, timeout_s=left)
            seen.update((op.op_id, op) for op in moves)
            failed = [op for op in moves if op.status is jobs.OpStatus.FAILED]
            if failed and legacy:
                raise self._grant_failure(key, failed[0])
            if failed or any(not op.finished for op in moves):
                return self._grant_outcome(key, seen, granted=False, restored=restored)
            for op in moves:
                if op.job_id == job_id and op.group == group and op.kind is jobs.Kind.RESTORE:
                    restored = True
            brought_in = any(
                op.job_id == job_id and op.group == group and op.kind is not jobs.Kind.SNAPSHOT
                for op in moves
            )
            # The mark was stored when the operation bringing the job in started.
            if brought_in and self._granted_here(job_id=job_id, group=group, epoch=epoch):
                return self._grant_outcome(key, seen, granted=True, restored=restored)
        raise refusals.Refused(
            refusals.Code.ABORTED,
            f"job states on node {self.node} kept changing during the grant of job {job_id}; "
            "read Status and retry",
        )

    async def _make_room(
        self,
        key: jobs.Key,
        yielding: Sequence[jobs.Key],
        footprint_bytes: int,
        config: pb.BackendConfig | None,
    ) -> jobs.Operation | None:
        """Snapshot the first resident of ``yielding`` while the granted job would not fit.

        ``None`` when nothing needs to (or can) give way: the job is resident already,
        it fits, or no listed resident is left.
        """
        job = self._jobs.get(key)
        if job is not None and job.state is jobs.State.RUNNING:
            return None
        residents = [k for k in yielding if self._resident_or_faulted(k)]
        if not residents:
            return None
        probe = job if job is not None else jobs.Job(job_id=key[0], group=key[1])
        route = self._route(key[0], job, config, 0)
        fits = await self._guarded.fits(
            route.backend,
            guarded.context(
                dataclasses.replace(
                    probe, footprint_bytes=footprint_bytes or probe.footprint_bytes
                ),
                route.config,
            ),
        )
        if fits:
            return None
        other = residents[0]
        log.info(
            "job %s (group %s) gives way on node %s to job %s of group %s",
            other[0],
            other[1],
            self.node,
            key[0],
            key[1],
            extra={"job_id": other[0]},
        )
        return await self._start_eviction(job_id=other[0], group=other[1])

    async def reset(self, *, job_id: str, group: str = "") -> jobs.State:
        async with self._locks[job_id]:
            job = jobs.check_reset(
                self._jobs.get(self._key(job_id, group)), job_id=job_id, group=group, node=self.node
            )
            recovered: jobs.State | None = None
            if job.backend in self._guarded:
                recovered = await self._recover(job.backend, job)
            new_job = jobs.after_reset(job, recovered=recovered)
            self._commit(jobs_=[new_job], previous=job)
            log.info(
                "job %s (group %s) reset from FAULTED to %s",
                job_id,
                job.group,
                new_job.state.value,
                extra={"job_id": job_id},
            )
            return new_job.state

    def on_workload_event(self, event: Any) -> None:
        """Listener for the workload-channel hub: a registration makes the job resident."""
        if getattr(event, "kind", None) != "registered" or "app-channel" not in self.backends:
            return
        job_id = str(event.job_id)
        state = getattr(event, "state", None)
        group = str(getattr(state, "group", "") or "")
        # What a workload says it holds counts only if it declared that it reports it.
        reported = bool(getattr(state, "state_reported", False))
        suspended: bool | None = bool(getattr(state, "suspended", False)) if reported else None
        task = tasks.spawn(
            self.note_channel_registration(job_id=job_id, group=group, suspended=suspended),
            name=f"channel-registration-{job_id}",
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def note_channel_registration(
        self, *, job_id: str, group: str, suspended: bool | None = None
    ) -> None:
        async with self._locks[job_id]:
            job = self._jobs.get(self._key(job_id, group))
            updated = jobs.after_channel_registration(
                job, job_id=job_id, group=group, suspended=suspended
            )
            if updated != job:
                self._commit(jobs_=[updated], previous=job)
                log.info(
                    "job %s (group %s) registered on the workload channel: %s on app-channel",
                    job_id,
                    group,
                    updated.state.value,
                    extra={"job_id": job_id},
                )

    async def prune_operations(self) -> int:
        """Forget finished operations past retention (and beyond the count limit)."""
        now = self._clock()
        referenced = {j.operation_id for j in self._jobs.values()}
        finished = sorted(
            (op for op in self._ops.values() if op.finished and op.op_id not in referenced),
            key=lambda op: op.finished_at or op.started_at,
        )
        cutoff = now - self.operation_retention_s
        drop = [op.op_id for op in finished if (op.finished_at or op.started_at) < cutoff]
        excess = len(self._ops) - len(drop) - self.max_operations
        if excess > 0:
            kept = [op.op_id for op in finished if op.op_id not in set(drop)]
            drop.extend(kept[:excess])
        for op_id in drop:
            self._ops.pop(op_id, None)
        self._store.delete_operations(drop)
        return len(drop)

    # ---- state changes, each under its job's lock ---------------------------------------

    async def _start_snapshot(
        self,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int,
    ) -> jobs.Operation:
        async with self._locks[job_id]:
            job = self._jobs.get(self._key(job_id, group))
            route = self._route(job_id, job, config, deprecated_backend)
            await self._validate(route, job, job_id=job_id, group=group)
            if job is None:
                # Adopted only if the backend holds it: a typo creates nothing.
                recovered = await self._recover(route.backend, jobs.Job(job_id=job_id, group=group))
            else:
                recovered = await self._recovered_if_faulted(route, job)
            plan = jobs.plan_snapshot(
                job,
                job_id=job_id,
                group=group,
                route_=route,
                node=self.node,
                op_id=self._new_op_id(),
                now=self._clock(),
                recovered=recovered,
            )
            return self._launch(plan, config=route.config)

    async def _start_restore(
        self,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int,
    ) -> jobs.Operation:
        async with self._locks[job_id]:
            job = self._jobs.get(self._key(job_id, group))
            route = self._route(job_id, job, config, deprecated_backend)
            await self._validate(route, job, job_id=job_id, group=group)
            recovered = await self._recovered_if_faulted(route, job)
            partial = await self._needs_partial_restore(route, job)
            plan = jobs.plan_restore(
                job,
                job_id=job_id,
                group=group,
                route_=route,
                node=self.node,
                op_id=self._new_op_id(),
                now=self._clock(),
                others=self._jobs.values(),
                recovered=recovered,
                partial=partial,
            )
            if isinstance(plan, jobs.Done):
                self._commit(jobs_=[plan.job], ops=[plan.operation], previous=job)
                return plan.operation
            # An explicit restore config applies to this operation only; the recorded one stays.
            return self._launch(plan, config=route.config)

    def _resident_or_faulted(self, key: jobs.Key) -> bool:
        job = self._jobs.get(key)
        return job is not None and job.state in (
            jobs.State.RUNNING,
            jobs.State.TRANSITIONING,
            jobs.State.FAULTED,
        )

    async def _start_eviction(self, *, job_id: str, group: str) -> jobs.Operation | None:
        """Snapshot a resident job for a Grant; the operation running on it if there is one."""
        async with self._locks[job_id]:
            job = self._jobs.get(self._key(job_id, group))
            if job is None or job.state in (jobs.State.IDLE, jobs.State.SAVED):
                return None
            if job.state is jobs.State.TRANSITIONING:
                running = self._ops.get(job.operation_id)
                if running is None:
                    raise refusals.Refused(
                        refusals.Code.INTERNAL,
                        f"job {job_id} is TRANSITIONING on node {self.node} with no known "
                        "operation; restart the agent to settle it",
                    )
                return running
            route = self._route(job_id, job, None, 0)
            await self._validate(route, job, job_id=job_id, group=group)
            # A FAULTED job is snapshotted only if its backend says it still runs.
            recovered = await self._recovered_if_faulted(route, job)
            plan = jobs.plan_snapshot(
                job,
                job_id=job_id,
                group=group,
                route_=route,
                node=self.node,
                op_id=self._new_op_id(),
                now=self._clock(),
                recovered=recovered,
            )
            return self._launch(plan, config=route.config)

    async def _start_grant(
        self,
        *,
        job_id: str,
        group: str,
        epoch: int,
        footprint_bytes: int,
        config: pb.BackendConfig | None,
        restore: bool,
        follow: bool,
    ) -> jobs.Operation | None:
        """Record the grant; ``None`` if the job is resident, else the operation bringing it in.

        ``follow``: an operation already running on the job is returned to wait on
        (instead of ABORTED).
        """
        async with self._locks[job_id]:
            job = self._jobs.get(self._key(job_id, group))
            if follow and job is not None and job.state is jobs.State.TRANSITIONING:
                running = self._ops.get(job.operation_id)
                if running is not None:
                    return running
            route = self._route(job_id, job, config, 0)
            await self._validate(
                route, job, job_id=job_id, group=group, footprint_bytes=footprint_bytes
            )
            last = self._grants.get(group)
            mark = jobs.new_mark(job_id=job_id, group=group, epoch=epoch, last=last)
            marks = [mark] if mark is not None else []
            if restore and job is not None and job.state is jobs.State.SAVED:
                jobs.check_epoch(job_id=job_id, group=group, epoch=epoch, last=last, node=self.node)
                bring_back = jobs.plan_restore(
                    job,
                    job_id=job_id,
                    group=group,
                    route_=route,
                    node=self.node,
                    op_id=self._new_op_id(),
                    now=self._clock(),
                    others=self._jobs.values(),
                )
                assert isinstance(bring_back, jobs.Start)  # a SAVED job has something to move
                return self._launch(bring_back, config=route.config, mark=mark)
            plan = jobs.plan_grant(
                job,
                job_id=job_id,
                group=group,
                epoch=epoch,
                last=last,
                footprint_bytes=footprint_bytes,
                route_=route,
                node=self.node,
                op_id=self._new_op_id(),
                now=self._clock(),
                others=self._jobs.values(),
            )
            if isinstance(plan, jobs.Unchanged):
                if plan.job != job or marks:
                    self._commit(jobs_=[plan.job], marks=marks, previous=job)
                return None
            return self._launch(plan, config=route.config, mark=mark)

    def _granted_here(self, *, job_id: str, group: str, epoch: int) -> bool:
        job = self._jobs.get((job_id, group))
        if job is None or job.state is not jobs.State.RUNNING:
            return False
        mark = self._grants.get(group)
        return not group or epoch <= 0 or (mark is not None and mark.epoch >= epoch)

    def _grant_outcome(
        self,
        key: jobs.Key,
        seen: Mapping[str, jobs.Operation],
        *,
        granted: bool,
        restored: bool,
    ) -> GrantOutcome:
        job = self._jobs.get(key)
        return GrantOutcome(
            state=job.state if job is not None else jobs.State.IDLE,
            granted=granted,
            operations=tuple(seen.values()),
            restored=restored,
        )

    def _grant_failure(self, key: jobs.Key, failed: jobs.Operation) -> refusals.Refused:
        """How the original Grant reports a failed activation (an RPC error)."""
        job_id = key[0]
        job = self._jobs.get(key)
        if job is not None and job.state is jobs.State.FAULTED:
            return refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"grant of job {job_id} on node {self.node} failed: {failed.error}; the job "
                "is FAULTED, clear it with ResetJob",
            )
        return refusals.Refused(
            refusals.Code.UNAVAILABLE,
            f"grant of job {job_id} on node {self.node} failed and changed nothing: "
            f"{failed.error}; retry",
        )

    # ---- internals --------------------------------------------------------------------------

    def _new_op_id(self) -> str:
        return str(uuid.uuid4())

    def _route(
        self,
        job_id: str,
        job: jobs.Job | None,
        config: pb.BackendConfig | None,
        deprecated_backend: int,
    ) -> jobs.Route:
        route = jobs.route(
            request_config=config,
            deprecated_backend=deprecated_backend,
            job=job,
            channel_registered=self._safe_channel_registered(job_id),
            default_backend=self.default_backend,
        )
        jobs.ensure_enabled(route.backend, enabled=self.backends, node=self.node)
        return route

    def _safe_channel_registered(self, job_id: str) -> bool:
        if "app-channel" not in self.backends:
            return False
        try:
            return bool(self._channel_registered(job_id))
        except Exception:
            log.exception("workload channel registration lookup failed for job %s", job_id)
            return False

    async def _validate(
        self,
        route: jobs.Route,
        job: jobs.Job | None,
        *,
        job_id: str,
        group: str,
        footprint_bytes: int = 0,
    ) -> None:
        known = job if job is not None else jobs.Job(job_id=job_id, group=group)
        if footprint_bytes:
            known = dataclasses.replace(known, footprint_bytes=footprint_bytes)
        await self._guarded.validate(route.backend, guarded.context(known, route.config))

    async def _recover(self, backend: str, job: jobs.Job) -> jobs.State | None:
        return await self._guarded.recover(backend, guarded.context(job, job.backend_config()))

    async def _recovered_if_faulted(
        self, route: jobs.Route, job: jobs.Job | None
    ) -> jobs.State | None:
        if job is None or job.state is not jobs.State.FAULTED:
            return None
        return await self._recover(route.backend, job)

    async def _needs_partial_restore(self, route: jobs.Route, job: jobs.Job | None) -> bool:
        tags = guarded.tags_of(route.config)
        if job is None or job.state is not jobs.State.RUNNING or not tags:
            return False
        ctx = guarded.context(job, route.config)
        return await self._guarded.missing_tags(route.backend, ctx, tags)

    def _previous(self, job: jobs.Job) -> jobs.Job | None:
        """The record ``job`` replaces (its own key, or the job's record made without group)."""
        found = self._jobs.get(job.key)
        if found is None and job.group:
            found = self._jobs.get((job.job_id, ""))
        return found

    def _commit(
        self,
        *,
        jobs_: Iterable[jobs.Job] = (),
        ops: Iterable[jobs.Operation] = (),
        marks: Iterable[jobs.GrantMark] = (),
        previous: jobs.Job | None,
    ) -> None:
        """Apply records in memory and on disk; undo the memory side if the disk refuses."""
        job_list, op_list, mark_list = list(jobs_), list(ops), list(marks)
        before_marks = {m.group: self._grants.get(m.group) for m in mark_list}
        # A record made without a group takes the group of the first request naming one.
        moved = (
            [previous.key]
            if previous is not None
            and previous.key not in {j.key for j in job_list}
            and any(j.job_id == previous.job_id for j in job_list)
            else []
        )
        for key in moved:
            self._jobs.pop(key, None)
        for job in job_list:
            self._jobs[job.key] = job
        for op in op_list:
            self._ops[op.op_id] = op
        for mark in mark_list:
            self._grants[mark.group] = mark
        try:
            self._store.put(
                job_records=job_list,
                operation_records=op_list,
                grant_marks=mark_list,
                deleted_jobs=moved,
            )
        except Exception as err:
            for job in job_list:
                self._jobs.pop(job.key, None)
            if previous is not None:
                self._jobs[previous.key] = previous
            for op in op_list:
                self._ops.pop(op.op_id, None)
            for group, old in before_marks.items():
                if old is None:
                    self._grants.pop(group, None)
                else:
                    self._grants[group] = old
            log.exception("could not persist agent state")
            raise refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"node {self.node} cannot persist its state ({type(err).__name__}: {err}); "
                "nothing was changed, fix the state directory and retry",
            ) from err

    def _launch(
        self,
        plan: jobs.Start,
        *,
        config: pb.BackendConfig | None,
        mark: jobs.GrantMark | None = None,
    ) -> jobs.Operation:
        previous = self._previous(plan.job)
        self._done[plan.operation.op_id] = asyncio.get_running_loop().create_future()
        try:
            self._commit(
                jobs_=[plan.job],
                ops=[plan.operation],
                marks=[mark] if mark else [],
                previous=previous,
            )
        except refusals.Refused:
            self._done.pop(plan.operation.op_id, None)
            raise
        task = tasks.spawn(
            self._execute(plan.job, plan.operation, config),
            name=f"{plan.operation.kind.value}-{plan.job.job_id}-{plan.operation.op_id[:8]}",
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        log.info(
            "%s of job %s started on backend %s",
            plan.operation.kind.value,
            plan.job.job_id,
            plan.operation.backend,
            extra={"job_id": plan.job.job_id, "operation_id": plan.operation.op_id},
        )
        return plan.operation

    async def _execute(
        self, job: jobs.Job, op: jobs.Operation, config: pb.BackendConfig | None
    ) -> None:
        started = time.monotonic()
        outcome = await self._guarded.run(op, guarded.context(job, config), guarded.mode_of(config))
        # The lock keeps a concurrent record change (a channel registration) from being lost.
        async with self._locks[job.job_id]:
            current = self._jobs.get(job.key, job)
            new_job, new_op = jobs.finish(current, op, outcome=outcome, now=self._clock())
            if new_op.status is jobs.OpStatus.COMPLETE:
                outcome_label = "complete"
            else:
                outcome_label = "faulted" if new_job.state is jobs.State.FAULTED else "failed"
            self._metrics.observe(
                backend=op.backend,
                kind=op.kind.value,
                outcome=outcome_label,
                seconds=time.monotonic() - started,
                device_bytes=new_op.device_bytes or 0,
            )
            try:
                # On disk before anybody can see it: a reply never gets ahead of the store.
                self._store.put(job_records=[new_job], operation_records=[new_op])
            except Exception:
                # The outcome stays served from memory; a restart re-asks the backend.
                log.exception("could not persist the outcome of operation %s", op.op_id)
            finally:
                self._jobs[new_job.key] = new_job
                self._ops[new_op.op_id] = new_op
                done = self._done.pop(op.op_id, None)
                if done is not None and not done.done():
                    done.set_result(None)
        log_fn = log.info if new_op.status is jobs.OpStatus.COMPLETE else log.warning
        log_fn(
            "%s of job %s %s: job %s%s",
            op.kind.value,
            job.job_id,
            outcome_label,
            new_job.state.value,
            f" ({new_op.error})" if new_op.error else "",
            extra={"job_id": job.job_id, "operation_id": op.op_id},
        )

    def job_counts(self) -> dict[str, int]:
        """Jobs by state (every state listed); safe to call from another thread."""
        counts = dict.fromkeys(_STATE_NAMES, 0)
        for job in list(self._jobs.values()):  # one C-level copy: the loop may be mutating
            counts[job.state.value] += 1
        return counts
