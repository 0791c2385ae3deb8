"""The async driver of the node agent: gathers facts, applies the pure rules' plans.

The rules live in pure modules: the per-record state machine in
``tslice.agent.jobs.rules``, the choice of backend in ``tslice.agent.jobs.routing``, the
moves of a Grant in ``tslice.agent.moves.grant_plan``. Every backend call goes through
``tslice.agent.backends.guarded``, and the records live in ``tslice.agent.ledger``;
what the workload channel reports (registrations, departures) is applied by
``tslice.agent.channel.presence``. This
module only strings them together: each mutating request takes the job's lock, asks
the backend what a rule depends on (through the guard), plans synchronously, commits
the plan *before* replying, and spawns the backend call as a named task. Because
planning and the in-memory update happen without an await in between, two requests
can never both see a job (or a group) free: the second one is refused.

Between planning and starting the backend call there is no ``await`` at all: the
memory update, the store's transaction (synchronous, see ``tslice.agent.store``) and
the spawn of the operation's task happen in one step. A caller that goes away (a
cancelled RPC, an orchestrator killed mid-call) is cancelled at an ``await``, so
either before anything changed or after the operation was started, never in
between (no job stored TRANSITIONING whose operation never runs). Keep it so:
``Ledger.commit`` and ``_launch`` are plain functions on purpose.

Waiters are woken through one future per operation, resolved once the outcome is on
disk.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from tslice.agent import ledger, metrics, store
from tslice.agent.backends import base, guarded
from tslice.agent.channel import presence
from tslice.agent.jobs import model, routing, rules
from tslice.agent.moves import grant_plan, parking
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks

log = logging.getLogger(__name__)

#: Upper bound of one WaitOperation long-poll (and of a request's ``wait_ms``).
MAX_WAIT_S = 60.0
#: How long a Grant without ``wait_ms`` waits before it replies with its operations so
#: far (the orchestrator's default ``wait_chunk_s``).
DEFAULT_GRANT_WAIT_S = 30.0


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
        channel_registered: Callable[[str, str], bool] | None = None,
        on_backend_error: Callable[[str, base.BackendError], None] | None = None,
        clock: Callable[[], float] = time.time,
        host_budget: parking.HostBudget | None = None,
    ) -> None:
        if default_backend not in backends:
            raise ValueError(f"default backend {default_backend!r} is not among the backends")
        self.node = node
        self.backends = dict(backends)
        self.default_backend = default_backend
        self.operation_timeout_s = operation_timeout_s
        self.operation_retention_s = operation_retention_s
        self.max_operations = max_operations
        self.guarded = guarded.GuardedBackends(
            backends, operation_timeout_s=operation_timeout_s, on_unavailable=on_backend_error
        )
        #: One record per (job, group): see ``model.Key``.
        self._book = ledger.Ledger(
            node=node,
            state=state,
            retention_s=operation_retention_s,
            max_operations=max_operations,
        )
        self._metrics = agent_metrics
        self.host_budget = host_budget or parking.HostBudget()  # DESIGN.md invariant 8
        agent_metrics.count_jobs(self._book.job_counts)
        self._channel_registered = channel_registered or (lambda _job_id, _group: False)
        self._clock = clock
        #: Resolved once an operation's outcome is stored (and applied in memory).
        self._done: dict[str, asyncio.Future[None]] = {}
        #: One lock per job id: a job's records of several groups change one at a time.
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._running: set[asyncio.Task[Any]] = set()
        self._workloads = presence.WorkloadPresence(
            book=self._book,
            locks=self._locks,
            done=self._done,
            registered=self._safe_channel_registered,
            spawn=lambda coro, name: self._spawn(coro, name=name),
        )

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Load the persisted state; settle jobs a dead agent left TRANSITIONING."""
        await self._book.load()
        now = self._clock()
        for job in list(self._book.jobs.values()):
            if job.state is not model.State.TRANSITIONING:
                continue
            enabled = job.backend in self.guarded
            recovered = await self.guarded.recover(job.backend, job) if enabled else None
            new_job, op = rules.after_restart(
                job,
                self._book.operations.get(job.operation_id),
                recovered=recovered,
                now=now,
                backend_enabled=enabled,
            )
            self._book.commit(jobs_=[new_job], ops=[op] if op else [], previous=job)
            log.warning(
                "job %s was TRANSITIONING when the agent stopped; now %s",
                job.job_id,
                new_job.state.value,
                extra={"job_id": job.job_id, "operation_id": job.operation_id},
            )
        # Operations whose job record was lost or moved on are settled the same way.
        orphans = [op for op in self._book.operations.values() if not op.finished]
        for op in orphans:
            self._book.commit(ops=[rules.interrupted(op, now=now)], previous=None)
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

    def list_jobs(self) -> list[model.Job]:
        return self._book.sorted_jobs()

    def job(self, job_id: str, group: str = "") -> model.Job | None:
        return self._book.find(job_id, group)

    def now(self) -> float:
        return self._clock()

    def get_operation(self, op_id: str) -> model.Operation:
        return self._book.operation(op_id)

    async def wait_operation(self, op_id: str, *, timeout_s: float) -> model.Operation:
        """The operation once finished, or as it is (PENDING) after ``timeout_s``."""
        (op,) = await self.settle([self.get_operation(op_id)], timeout_s=timeout_s)
        return op

    async def settle(
        self, ops: Sequence[model.Operation], *, timeout_s: float | None
    ) -> list[model.Operation]:
        """``ops`` once all finished, or as they are after ``timeout_s`` (None: no limit)."""
        waits = [f for op in ops if not op.finished and (f := self._done.get(op.op_id)) is not None]
        if waits and (timeout_s is None or timeout_s > 0):
            limit = None if timeout_s is None else min(timeout_s, MAX_WAIT_S)
            # asyncio.wait never cancels the shared futures, whoever stops waiting.
            await asyncio.wait(waits, timeout=limit)
        return [self._book.operations.get(op.op_id, op) for op in ops]

    async def accelerators(self) -> list[base.Accelerator]:
        return await self.guarded.accelerators()

    # ---- requests -------------------------------------------------------------------------

    async def directive(
        self,
        kind: model.Kind,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int = 0,
        wait_s: float = 0.0,
    ) -> model.Operation:
        """Start a Snapshot or Restore (``kind``) under the job's lock; return its
        operation once finished or after ``wait_s``."""
        start = self._start_snapshot if kind is model.Kind.SNAPSHOT else self._start_restore
        async with self._locks[job_id]:
            op = await start(
                self._book.find(job_id, group),
                job_id=job_id,
                group=group,
                config=config,
                deprecated_backend=deprecated_backend,
            )
        (op,) = await self.settle([op], timeout_s=wait_s)
        return op

    def key(self, job_id: str, group: str) -> model.Key:
        """The record a request about ``job_id`` for ``group`` means (see ``Ledger.key``)."""
        return self._book.key(job_id, group)

    async def grant(
        self,
        order: grant_plan.Order,
        *,
        wait_s: float = DEFAULT_GRANT_WAIT_S,
        devices: Sequence[int] = (),
    ) -> grant_plan.GrantOutcome:
        """Make the ordered job's state for its group resident here and record the grant.

        The moves (evict, make room, bring in) are planned by ``tslice.agent.moves.grant_plan``,
        one at a time; each is an ordinary operation with its own id. The outcome
        comes back after at most ``wait_s`` with ``granted=False`` and the operations
        so far when the node is not done or an operation FAILED; re-issuing the same
        Grant continues from where the node stands.
        """
        job_id, group = order.job_id, order.group
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, MAX_WAIT_S)
        # A stale grant must not evict anything.
        last = self._book.marks.get(group)
        rules.check_epoch(job_id=job_id, group=group, epoch=order.epoch, last=last, node=self.node)
        # Which of this node's devices the group uses (the cuda backend acts on them only).
        if devices:
            self.guarded.devices[group] = tuple(devices)
        else:
            self.guarded.devices.pop(group, None)
        seen: dict[str, model.Operation] = {}
        for _ in range(order.max_steps):
            moves = await self._next_moves(order)
            if moves is None:  # resident, and the grant recorded
                return grant_plan.outcome(
                    order, seen.values(), job=self.job(job_id, group), granted=True
                )
            moves = await self.settle(moves, timeout_s=max(0.0, deadline - loop.time()))
            seen.update((op.op_id, op) for op in moves)
            verdict = grant_plan.after_round(
                order,
                moves,
                job=self._book.jobs.get((job_id, group)),
                mark=self._book.marks.get(group),
            )
            if verdict is not grant_plan.Verdict.GO_ON:
                granted = verdict is grant_plan.Verdict.GRANTED
                target = self.job(job_id, group)
                return grant_plan.outcome(order, seen.values(), job=target, granted=granted)
        raise grant_plan.kept_changing(order, node=self.node)

    async def _next_moves(self, order: grant_plan.Order) -> list[model.Operation] | None:
        """Start the Grant's next move; its operations, or ``None`` once the job is in."""
        target = self._book.key(order.job_id, order.group)
        job = self._book.jobs.get(target)
        route = self._route(order.job_id, job, order.config, 0)
        overlap = self.guarded.overlaps_moves(route.backend)
        move = grant_plan.next_move(order, self._book.jobs, target=target, overlap=overlap)
        if isinstance(move, grant_plan.AskFit):
            fits = await self.guarded.fits(route, grant_plan.as_asked(order, job))
            move = grant_plan.next_move(order, self._book.jobs, target=target, fits=fits)
        if isinstance(move, grant_plan.Evict):
            if move.giving_way:
                log.info(
                    "job %s (group %s) gives way on node %s to job %s of group %s",
                    *move.keys[0],
                    self.node,
                    order.job_id,
                    order.group,
                    extra={"job_id": move.keys[0][0]},
                )
            for key in move.keys:  # every evicted state must fit before any is frozen
                await self._parkable(self._book.jobs.get(key), None)
            started = [await self._start_eviction(key) for key in move.keys]
            moves = [op for op in started if op is not None]
            if move.bring_in:
                # Overlap: the restore starts while the snapshots free the memory it lands in.
                leaving = {(op.job_id, op.group) for op in moves if op.kind is model.Kind.SNAPSHOT}
                brought_in = await self._start_grant(order, leaving=leaving)
                moves += [brought_in] if brought_in is not None else []
            return moves
        brought_in = await self._start_grant(order)
        return None if brought_in is None else [brought_in]

    async def prefetch(
        self, *, job_id: str, group: str, config: pb.BackendConfig | None
    ) -> model.Job:
        """Start bringing a SAVED job's state in ahead of its grant (issue 9 §2), into free
        memory only; the record stays SAVED and a later Grant's restore finds the bytes
        there. Refused (FAILED_PRECONDITION) unless the job is SAVED here and its backend
        declares ``prefetches``; the copy runs in the background, bounded by the
        operation deadline."""
        async with self._locks[job_id]:
            job = self._book.find(job_id, group)
            if job is None:
                raise rules.unknown_job(job_id, group, node=self.node)
            route = self._route(job_id, job, config, 0)
            rules.check_prefetch(
                job,
                backend=route.backend,
                declared=self.guarded.prefetches(route.backend),
                node=self.node,
            )
            self._spawn(
                self.guarded.prefetch(route.backend, job), name=f"prefetch-{job_id}-{job.group}"
            )
            return job

    async def reset(self, *, job_id: str, group: str = "") -> model.State:
        async with self._locks[job_id]:
            job = rules.check_reset(
                self._book.find(job_id, group), job_id=job_id, group=group, node=self.node
            )
            recovered: model.State | None = None
            if job.backend in self.guarded:
                recovered = await self.guarded.recover(job.backend, job)
            new_job = rules.after_reset(job, recovered=recovered)
            self._book.commit(jobs_=[new_job], previous=job)
            log.info(
                "job %s (group %s) reset from FAULTED to %s",
                job_id,
                job.group,
                new_job.state.value,
                extra={"job_id": job_id},
            )
            return new_job.state

    def on_workload_event(self, event: Any) -> None:
        """Listener for the workload-channel hub (see ``tslice.agent.channel.presence``)."""
        if "app-channel" in self.backends:
            self._workloads.on_event(event)

    async def prune_operations(self) -> int:
        """Forget finished operations past retention (and beyond the count limit)."""
        return self._book.prune(now=self._clock())

    # ---- state changes, each under its job's lock ---------------------------------------

    async def _start_snapshot(
        self,
        job: model.Job | None,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None = None,
        deprecated_backend: int = 0,
    ) -> model.Operation:
        route = self._route(job_id, job, config, deprecated_backend)
        await self._validate(route, job, job_id=job_id, group=group)
        # A typo creates nothing: an unknown job is adopted only if its backend holds it.
        probe = job if job is not None else model.Job(job_id=job_id, group=group)
        recovered = await self._recovered(route, probe, unknown=job is None)
        # Refused (RESOURCE_EXHAUSTED) before anything is frozen if it cannot be parked:
        adopted = dataclasses.replace(probe, state=recovered or model.State.RUNNING)
        await self._parkable(job or adopted, route)
        plan = rules.plan_snapshot(job, self._request(job_id, group, route), recovered=recovered)
        if isinstance(plan, model.Done):  # nothing resident: the job's workload left
            self._book.commit(jobs_=[plan.job], ops=[plan.operation], previous=job)
            return plan.operation
        return self._launch(plan, config=route.config)

    async def _start_restore(
        self,
        job: model.Job | None,
        *,
        job_id: str,
        group: str,
        config: pb.BackendConfig | None,
        deprecated_backend: int,
    ) -> model.Operation:
        route = self._route(job_id, job, config, deprecated_backend)
        await self._validate(route, job, job_id=job_id, group=group)
        recovered = await self._recovered(route, job)
        partial = job is not None and await self.guarded.missing_tags(route, job)
        plan = rules.plan_restore(
            job,
            self._request(job_id, group, route),
            others=self._book.jobs.values(),
            recovered=recovered,
            partial=partial,
        )
        if isinstance(plan, model.Done):
            self._book.commit(jobs_=[plan.job], ops=[plan.operation], previous=job)
            return plan.operation
        # An explicit restore config applies to this operation only; the recorded one stays.
        return self._launch(plan, config=route.config)

    async def _start_eviction(self, key: model.Key) -> model.Operation | None:
        """Snapshot a resident job for a Grant; the operation running on it if there is one."""
        job_id, group = key
        async with self._locks[job_id]:
            job = self._book.find(job_id, group)
            if job is None or job.state in (model.State.IDLE, model.State.SAVED):
                return None
            if job.state is model.State.TRANSITIONING:
                return self._book.running(job)
            # A FAULTED job is snapshotted only if its backend says it still runs.
            return await self._start_snapshot(job, job_id=job_id, group=group)

    async def _start_grant(
        self, order: grant_plan.Order, *, leaving: Collection[model.Key] = ()
    ) -> model.Operation | None:
        """Record the grant; ``None`` if the job is resident, else the operation bringing it in.

        ``leaving``: records of the group whose snapshot runs (an overlapping restore).
        """
        job_id, group = order.job_id, order.group
        async with self._locks[job_id]:
            job = self._book.find(job_id, group)
            transitioning = job is not None and job.state is model.State.TRANSITIONING
            if transitioning:
                assert job is not None
                running = self._book.operations.get(job.operation_id)
                if running is not None:
                    return running
            route = self._route(job_id, job, order.config, 0)
            await self.guarded.validate(route, grant_plan.as_asked(order, job))
            last = self._book.marks.get(group)
            mark = rules.new_mark(job_id=job_id, group=group, epoch=order.epoch, last=last)
            request = self._request(job_id, group, route)
            if order.restore and job is not None and job.state is model.State.SAVED:
                rules.check_epoch(
                    job_id=job_id, group=group, epoch=order.epoch, last=last, node=self.node
                )
                bring_back = rules.plan_restore(
                    job, request, others=self._book.jobs.values(), leaving=leaving
                )
                # A SAVED job has something to move.
                assert isinstance(bring_back, model.Start)
                return self._launch(bring_back, config=route.config, mark=mark)
            plan = rules.plan_grant(
                job,
                request,
                epoch=order.epoch,
                last=last,
                footprint_bytes=order.footprint_bytes,
                others=self._book.jobs.values(),
            )
            if isinstance(plan, model.Unchanged):
                marks = [mark] if mark is not None else []
                if plan.job != job or marks:
                    self._book.commit(jobs_=[plan.job], marks=marks, previous=job)
                return None
            return self._launch(plan, config=route.config, mark=mark)

    # ---- internals --------------------------------------------------------------------------

    def _request(self, job_id: str, group: str, route: model.Route) -> model.Request:
        return model.Request(
            job_id=job_id,
            group=group,
            route=route,
            node=self.node,
            op_id=str(uuid.uuid4()),
            now=self._clock(),
        )

    def _route(
        self,
        job_id: str,
        job: model.Job | None,
        config: pb.BackendConfig | None,
        deprecated_backend: int,
    ) -> model.Route:
        route = routing.route(
            request_config=config,
            deprecated_backend=deprecated_backend,
            job=job,
            channel_registered=self._safe_channel_registered(job_id, job.group if job else ""),
            default_backend=self.default_backend,
        )
        routing.ensure_enabled(route.backend, enabled=self.backends, node=self.node)
        return route

    def _safe_channel_registered(self, job_id: str, group: str) -> bool:
        if "app-channel" not in self.backends:
            return False
        try:
            return bool(self._channel_registered(job_id, group))
        except Exception:
            log.exception("workload channel registration lookup failed for job %s", job_id)
            return False

    async def _validate(
        self, route: model.Route, job: model.Job | None, *, job_id: str, group: str
    ) -> None:
        await self.guarded.validate(route, job or model.Job(job_id=job_id, group=group))

    async def _parkable(self, job: model.Job | None, route: model.Route | None) -> None:
        """Refused where the node's host memory cannot park the state (``parking``)."""
        if job is not None:
            route = route or self._route(job.job_id, job, None, 0)
            await parking.check(
                self.guarded, self.host_budget, self._book.jobs.values(), route, job
            )

    def host_memory(self) -> tuple[int | None, int]:  # (limit, parked bytes), for Status
        return parking.usage(self.guarded, self.host_budget, self._book.jobs.values())

    async def _recovered(
        self, route: model.Route, job: model.Job | None, *, unknown: bool = False
    ) -> model.State | None:
        """What the backend reports, asked only where a rule depends on it: for a FAULTED
        job, and (``unknown``) for a job this node has no record of."""
        if job is None or not (unknown or job.state is model.State.FAULTED):
            return None
        return await self.guarded.recover(route.backend, job)

    def _launch(
        self,
        plan: model.Start,
        *,
        config: pb.BackendConfig | None,
        mark: model.GrantMark | None = None,
    ) -> model.Operation:
        op = plan.operation
        previous = self._book.previous(plan.job)
        self._done[op.op_id] = asyncio.get_running_loop().create_future()
        try:
            self._book.commit(
                jobs_=[plan.job], ops=[op], marks=[mark] if mark else [], previous=previous
            )
        except BaseException:
            self._done.pop(op.op_id, None)
            raise
        self._spawn(
            self._execute(plan.job, op, config),
            name=f"{op.kind.value}-{plan.job.job_id}-{op.op_id[:8]}",
        )
        log.info(
            "%s of job %s started on backend %s",
            op.kind.value,
            plan.job.job_id,
            op.backend,
            extra={"job_id": plan.job.job_id, "operation_id": op.op_id},
        )
        return op

    def _spawn(self, coro: Any, *, name: str) -> None:
        task = tasks.spawn(coro, name=name)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _execute(
        self, job: model.Job, op: model.Operation, config: pb.BackendConfig | None
    ) -> None:
        started = time.monotonic()
        outcome = await self.guarded.run(op, job, config)
        # The lock keeps a concurrent record change (a channel registration) from being lost.
        async with self._locks[job.job_id]:
            current = self._book.jobs.get(job.key, job)
            new_job, new_op = rules.finish(current, op, outcome=outcome, now=self._clock())
            if new_op.status is model.OpStatus.COMPLETE:
                outcome_label = "complete"
            else:
                outcome_label = "faulted" if new_job.state is model.State.FAULTED else "failed"
            self._metrics.observe(
                backend=op.backend,
                kind=op.kind.value,
                outcome=outcome_label,
                seconds=time.monotonic() - started,
                device_bytes=new_op.device_bytes or 0,
            )
            try:
                self._book.record_outcome(new_job, new_op)
            finally:
                done = self._done.pop(op.op_id, None)
                if done is not None and not done.done():
                    done.set_result(None)
        log_fn = log.info if new_op.status is model.OpStatus.COMPLETE else log.warning
        log_fn(
            "%s of job %s %s: job %s%s",
            op.kind.value,
            job.job_id,
            outcome_label,
            new_job.state.value,
            f" ({new_op.error})" if new_op.error else "",
            extra={"job_id": job.job_id, "operation_id": op.op_id},
        )
