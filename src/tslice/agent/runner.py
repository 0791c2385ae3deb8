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
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from tslice.agent import jobs, metrics, store
from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Upper bound of one WaitOperation long-poll (and of a request's ``wait_ms``).
MAX_WAIT_S = 60.0
#: Moves one Grant may make (evict, bring in) before it reports that states keep changing.
_MAX_GRANT_STEPS = 8
#: How long ``recover()`` may take when a request or ResetJob needs it.
RECOVER_TIMEOUT_S = 30.0
_STATE_NAMES = tuple(s.value for s in jobs.State)
_BACKOFF_MIN_S = 0.05
_BACKOFF_MAX_S = 5.0


async def _within(call: Coroutine[Any, Any, _T], *, timeout_s: float) -> _T:
    """``call`` under a deadline, run in the calling task where the loop allows it.

    ``asyncio.timeout`` (3.11+) needs no extra task: a backend call that finishes
    without suspending (noop, a refusal) costs no trip through the event loop.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout_s):
            return await call
    return await asyncio.wait_for(call, timeout=timeout_s)


def _mode_of(config: pb.BackendConfig | None) -> pb.SuspendMode:
    if config is not None:
        arm = config.WhichOneof("backend")
        if arm == "app_endpoint":
            return config.app_endpoint.mode
        if arm == "app_channel":
            return config.app_channel.mode
    return pb.SUSPEND_MODE_UNSPECIFIED


def _tags_of(config: pb.BackendConfig | None) -> list[str]:
    if config is not None:
        arm = config.WhichOneof("backend")
        if arm == "app_endpoint":
            return list(config.app_endpoint.tags)
        if arm == "app_channel":
            return list(config.app_channel.tags)
    return []


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
        self.operation_retention_s = operation_retention_s
        self.max_operations = max_operations
        self._store = state
        self._metrics = agent_metrics
        agent_metrics.count_jobs(self.job_counts)
        self._channel_registered = channel_registered or (lambda _job_id: False)
        self._on_backend_error = on_backend_error or (lambda _name, _err: None)
        self._clock = clock
        self._jobs: dict[str, jobs.Job] = {}
        self._ops: dict[str, jobs.Operation] = {}
        self._grants: dict[str, jobs.GrantMark] = {}
        #: Resolved once an operation's outcome is stored (and applied in memory).
        self._done: dict[str, asyncio.Future[None]] = {}
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
                recovered = await self._recover(self.backends[job.backend], job)
            new_job, op = jobs.after_restart(
                job, self._ops.get(job.operation_id), recovered=recovered, now=now
            )
            if job.backend not in self.backends:
                new_job = dataclasses.replace(
                    new_job,
                    error=f"{new_job.error} (backend {job.backend} is not enabled on this node)",
                )
            self._jobs[job.job_id] = new_job
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
        return sorted(self._jobs.values(), key=lambda j: j.job_id)

    def job(self, job_id: str) -> jobs.Job | None:
        return self._jobs.get(job_id)

    def now(self) -> float:
        return self._clock()

    def get_operation(self, op_id: str) -> jobs.Operation:
        op = self._ops.get(op_id)
        if op is None:
            hours = self.operation_retention_s / 3600
            raise jobs.Refused(
                jobs.Code.NOT_FOUND,
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
        found: list[base.Accelerator] = []
        for name, backend in self.backends.items():
            try:
                found.extend(await asyncio.wait_for(backend.accelerators(), timeout=5.0))
            except Exception as err:
                log.warning("backend %s could not list accelerators: %s", name, err)
        return found

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
        restore: bool = False,
        wait_s: float | None = None,
    ) -> GrantOutcome:
        """Make ``job_id`` resident on this node and record the grant.

        First the jobs in ``evict`` that are resident here are snapshotted (an operation
        already running on one is waited for), then the job is restored if it is SAVED
        and ``restore`` is set, or activated if it has nothing resident; the grant mark
        is stored with that step. Each move is an ordinary operation with its own id.

        ``wait_s=None`` is the original Grant: wait for the activation however long it
        takes and raise :class:`jobs.Refused` if it fails. Otherwise the outcome comes
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
        evictees = [other for other in dict.fromkeys(evict) if other != job_id]
        seen: dict[str, jobs.Operation] = {}
        restored = False
        for _ in range(_MAX_GRANT_STEPS):
            moves: list[jobs.Operation] = []
            for other in evictees:
                if self._resident_or_faulted(other):
                    op = await self._start_eviction(job_id=other, group=group)
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
                if target is None:
                    return self._grant_outcome(job_id, seen, granted=True, restored=restored)
                moves.append(target)
            left = None if deadline is None else max(0.0, deadline - loop.time())
            moves = await self.settle(moves, timeout_s=left)
            seen.update((op.op_id, op) for op in moves)
            failed = [op for op in moves if op.status is jobs.OpStatus.FAILED]
            if failed and legacy:
                raise self._grant_failure(job_id, failed[0])
            if failed or any(not op.finished for op in moves):
                return self._grant_outcome(job_id, seen, granted=False, restored=restored)
            for op in moves:
                if op.job_id == job_id and op.kind is jobs.Kind.RESTORE:
                    restored = True
            brought_in = any(
                op.job_id == job_id and op.kind is not jobs.Kind.SNAPSHOT for op in moves
            )
            # The mark was stored when the operation bringing the job in started.
            if brought_in and self._granted_here(job_id=job_id, group=group, epoch=epoch):
                return self._grant_outcome(job_id, seen, granted=True, restored=restored)
        raise jobs.Refused(
            jobs.Code.ABORTED,
            f"job states on node {self.node} kept changing during the grant of job {job_id}; "
            "read Status and retry",
        )

    async def reset(self, *, job_id: str) -> jobs.State:
        async with self._locks[job_id]:
            job = jobs.check_reset(self._jobs.get(job_id), job_id=job_id, node=self.node)
            recovered: jobs.State | None = None
            backend = self.backends.get(job.backend) if job.backend else None
            if backend is not None:
                recovered = await self._recover(backend, job)
            new_job = jobs.after_reset(job, recovered=recovered)
            self._commit(jobs_=[new_job], previous=job)
            log.info(
                "job %s reset from FAULTED to %s",
                job_id,
                new_job.state.value,
                extra={"job_id": job_id},
            )
            return new_job.state

    def on_workload_event(self, event: Any) -> None:
        """Listener for the workload-channel hub: a registration records the choice."""
        if getattr(event, "kind", None) != "registered" or "app-channel" not in self.backends:
            return
        job_id = str(event.job_id)
        group = str(getattr(getattr(event, "state", None), "group", "") or "")
        task = tasks.spawn(
            self.note_channel_registration(job_id=job_id, group=group),
            name=f"channel-registration-{job_id}",
        )
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def note_channel_registration(self, *, job_id: str, group: str) -> None:
        async with self._locks[job_id]:
            job = self._jobs.get(job_id)
            updated = jobs.after_channel_registration(job, job_id=job_id, group=group)
            if updated != job:
                self._commit(jobs_=[updated], previous=job)
                log.info(
                    "job %s registered on the workload channel; its backend is app-channel",
                    job_id,
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
            job = self._jobs.get(job_id)
            route = self._route(job_id, job, config, deprecated_backend)
            await self._validate(route, job, job_id=job_id, group=group)
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
            job = self._jobs.get(job_id)
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

    def _resident_or_faulted(self, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.state in (
            jobs.State.RUNNING,
            jobs.State.TRANSITIONING,
            jobs.State.FAULTED,
        )

    async def _start_eviction(self, *, job_id: str, group: str) -> jobs.Operation | None:
        """Snapshot a resident job for a Grant; the operation running on it if there is one."""
        async with self._locks[job_id]:
            job = self._jobs.get(job_id)
            if job is None or job.state in (jobs.State.IDLE, jobs.State.SAVED):
                return None
            if job.state is jobs.State.TRANSITIONING:
                running = self._ops.get(job.operation_id)
                if running is None:
                    raise jobs.Refused(
                        jobs.Code.INTERNAL,
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
            job = self._jobs.get(job_id)
            if follow and job is not None and job.state is jobs.State.TRANSITIONING:
                running = self._ops.get(job.operation_id)
                if running is not None:
                    return running
            route = self._route(job_id, job, config, 0)
            await self._validate(route, job, job_id=job_id, group=group)
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
        job = self._jobs.get(job_id)
        if job is None or job.state is not jobs.State.RUNNING:
            return False
        mark = self._grants.get(group)
        return not group or epoch <= 0 or (mark is not None and mark.epoch >= epoch)

    def _grant_outcome(
        self, job_id: str, seen: Mapping[str, jobs.Operation], *, granted: bool, restored: bool
    ) -> GrantOutcome:
        job = self._jobs.get(job_id)
        return GrantOutcome(
            state=job.state if job is not None else jobs.State.IDLE,
            granted=granted,
            operations=tuple(seen.values()),
            restored=restored,
        )

    def _grant_failure(self, job_id: str, failed: jobs.Operation) -> jobs.Refused:
        """How the original Grant reports a failed activation (an RPC error)."""
        job = self._jobs.get(job_id)
        if job is not None and job.state is jobs.State.FAULTED:
            return jobs.Refused(
                jobs.Code.FAILED_PRECONDITION,
                f"grant of job {job_id} on node {self.node} failed: {failed.error}; the job "
                "is FAULTED, clear it with ResetJob",
            )
        return jobs.Refused(
            jobs.Code.UNAVAILABLE,
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

    def _context(self, job: jobs.Job, config: pb.BackendConfig | None) -> base.JobContext:
        return base.JobContext(
            job_id=job.job_id,
            group=job.group,
            config=config,
            footprint_bytes=job.footprint_bytes,
            state=dict(job.backend_state),
        )

    async def _validate(
        self, route: jobs.Route, job: jobs.Job | None, *, job_id: str, group: str
    ) -> None:
        """Let the backend refuse the config before anything is created or changed."""
        backend = self.backends[route.backend]
        if type(backend).validate is base.Backend.validate:
            return  # the backend checks nothing: spare the hand-over a task and a timer
        known = job if job is not None else jobs.Job(job_id=job_id, group=group)
        try:
            await asyncio.wait_for(
                backend.validate(self._context(known, route.config)), timeout=RECOVER_TIMEOUT_S
            )
        except base.BackendConfigRefusedError as err:
            raise jobs.Refused(jobs.Code.FAILED_PRECONDITION, str(err)) from err
        except base.InvalidBackendConfigError as err:
            raise jobs.Refused(jobs.Code.INVALID_ARGUMENT, str(err)) from err
        except Exception as err:
            log.exception("backend %s failed to validate a request", route.backend)
            raise jobs.Refused(
                jobs.Code.INTERNAL,
                f"backend {route.backend} could not check the request for job {job_id} "
                f"({type(err).__name__}: {err}); nothing was changed",
            ) from err

    async def _recover(self, backend: base.Backend, job: jobs.Job) -> jobs.State | None:
        """What the backend reports for the job; ``None`` if it cannot tell or fails."""
        try:
            reported = await asyncio.wait_for(
                backend.recover(self._context(job, job.backend_config())),
                timeout=min(RECOVER_TIMEOUT_S, self.operation_timeout_s),
            )
        except Exception as err:
            log.warning("backend %s could not recover job %s: %s", backend.name, job.job_id, err)
            return None
        return jobs.from_pb(reported)

    async def _recovered_if_faulted(
        self, route: jobs.Route, job: jobs.Job | None
    ) -> jobs.State | None:
        if job is None or job.state is not jobs.State.FAULTED:
            return None
        return await self._recover(self.backends[route.backend], job)

    async def _needs_partial_restore(self, route: jobs.Route, job: jobs.Job | None) -> bool:
        """Staged wake hook: a RUNNING job whose backend says requested tags are missing.

        See ``Backend.missing_tags``.
        """
        tags = _tags_of(route.config)
        if job is None or job.state is not jobs.State.RUNNING or not tags:
            return False
        backend = self.backends[route.backend]
        try:
            missing = await asyncio.wait_for(
                backend.missing_tags(self._context(job, route.config), tags),
                timeout=RECOVER_TIMEOUT_S,
            )
        except Exception as err:
            log.warning("backend %s could not report missing tags: %s", route.backend, err)
            return False
        return bool(missing)

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
        for job in job_list:
            self._jobs[job.job_id] = job
        for op in op_list:
            self._ops[op.op_id] = op
        for mark in mark_list:
            self._grants[mark.group] = mark
        try:
            self._store.put(job_records=job_list, operation_records=op_list, grant_marks=mark_list)
        except Exception as err:
            for job in job_list:
                if previous is not None and previous.job_id == job.job_id:
                    self._jobs[job.job_id] = previous
                else:
                    self._jobs.pop(job.job_id, None)
            for op in op_list:
                self._ops.pop(op.op_id, None)
            for group, old in before_marks.items():
                if old is None:
                    self._grants.pop(group, None)
                else:
                    self._grants[group] = old
            log.exception("could not persist agent state")
            raise jobs.Refused(
                jobs.Code.UNAVAILABLE,
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
        previous = self._jobs.get(plan.job.job_id)
        self._done[plan.operation.op_id] = asyncio.get_running_loop().create_future()
        try:
            self._commit(
                jobs_=[plan.job],
                ops=[plan.operation],
                marks=[mark] if mark else [],
                previous=previous,
            )
        except jobs.Refused:
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
        backend = self.backends[op.backend]
        started = time.monotonic()
        outcome = await self._call(backend, op, self._context(job, config), _mode_of(config))
        # The lock keeps a concurrent record change (a channel registration) from being lost.
        async with self._locks[job.job_id]:
            current = self._jobs.get(job.job_id, job)
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
                self._jobs[new_job.job_id] = new_job
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

    async def _call(
        self,
        backend: base.Backend,
        op: jobs.Operation,
        ctx: base.JobContext,
        mode: pb.SuspendMode,
    ) -> jobs.Outcome:
        """Run the backend call under the deadline, retrying transient failures."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.operation_timeout_s
        what = f"{op.kind.value} of job {ctx.job_id} by backend {backend.name}"
        delay = _BACKOFF_MIN_S
        while True:
            remaining = deadline - loop.time()
            try:
                result = await _within(
                    self._invoke(backend, op.kind, ctx, mode), timeout_s=max(remaining, 0.0)
                )
                return jobs.Outcome(result=result)
            except base.TransientBackendError as err:
                delay = min(max(err.retry_after, delay), _BACKOFF_MAX_S)
                if loop.time() + delay >= deadline:
                    return jobs.Outcome(
                        error=f"{what} kept failing until its {self.operation_timeout_s:g} s "
                        f"deadline; nothing was changed: {err}",
                        state_changed=False,
                    )
                log.info("%s: transient failure, retrying in %.2fs: %s", what, delay, err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
            except asyncio.TimeoutError:
                if loop.time() < deadline:
                    return jobs.Outcome(error=f"{what} failed: the backend timed out internally")
                return jobs.Outcome(
                    error=f"{what} did not finish within {self.operation_timeout_s:g} s "
                    "(operation_timeout_s); check the backend, then ResetJob"
                )
            except base.RefusedBackendError as err:
                return jobs.Outcome(
                    error=f"{what} was refused; nothing was changed: {err}", state_changed=False
                )
            except base.BackendError as err:
                if isinstance(err, base.BackendUnavailableError):
                    self._on_backend_error(backend.name, err)
                return jobs.Outcome(error=f"{what} failed: {err}")
            except Exception as err:
                log.exception("%s crashed", what)
                return jobs.Outcome(error=f"{what} crashed: {type(err).__name__}: {err}")

    @staticmethod
    async def _invoke(
        backend: base.Backend, kind: jobs.Kind, ctx: base.JobContext, mode: pb.SuspendMode
    ) -> base.OpResult:
        if kind is jobs.Kind.SNAPSHOT:
            return await backend.snapshot(ctx, mode)
        if kind is jobs.Kind.RESTORE:
            return await backend.restore(ctx)
        return await backend.activate(ctx)

    def job_counts(self) -> dict[str, int]:
        """Jobs by state (every state listed); safe to call from another thread."""
        counts = dict.fromkeys(_STATE_NAMES, 0)
        for job in list(self._jobs.values()):  # one C-level copy: the loop may be mutating
            counts[job.state.value] += 1
        return counts
