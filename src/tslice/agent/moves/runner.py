"""The one executor of the node agent, between the gRPC face and the backends.

Every request that changes a record (a Grant, llm-d's Snapshot and Restore, a prefetch,
ResetJob, and what the workload channel reports, through ``tslice.agent.channel.presence``)
runs here in the same three steps, under the job's lock:

1. gather the facts a rule needs: the record (``tslice.agent.state.store``), the backend
   that serves the request (``tslice.agent.jobs.routing``), and, only where a rule
   depends on it, a backend's answer (validate, recover, fits, host bytes), asked
   through the guard (``tslice.agent.backends.guarded``);
2. plan with the pure rules (``tslice.agent.jobs.rules``; a Grant's moves with
   ``tslice.agent.moves.grant_plan``), which return data: ``Start`` (a job
   TRANSITIONING and its PENDING operation), ``Done`` (an operation with nothing to
   move), ``Unchanged``;
3. apply the plan in :meth:`AgentCore._apply`, the one place that writes a plan and
   starts a backend call: the store's transaction and the spawn of the operation's
   task happen in one step.

Between planning and applying there is no ``await``, so two requests can never both see
a job (or a group) free: the second one is refused. A caller that goes away (a cancelled
RPC, an orchestrator killed mid-call) is cancelled at an ``await``: before anything
changed, or after the operation was started, never in between (no job stored
TRANSITIONING whose operation never runs). Keep it so: ``Store.commit`` and ``_apply``
are plain functions on purpose.

An operation's task (:meth:`AgentCore._execute`) calls the backend through the guard,
applies its outcome (``rules.finish``), keeps it in the store and wakes the operation's
waiters. Whatever the runner answers a caller with (a Grant's outcome, an operation,
the jobs of Status) is flushed to disk first (``Store.flush``).
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

from tslice.agent import metrics
from tslice.agent.backends import base, guarded
from tslice.agent.channel import presence
from tslice.agent.jobs import model, routing, rules
from tslice.agent.moves import grant_plan, parking
from tslice.agent.state import store
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks

log = logging.getLogger(__name__)

#: Upper bound of one WaitOperation long-poll (and of a request's ``wait_ms``).
MAX_WAIT_S = 60.0
#: How long a Grant without ``wait_ms`` waits before it replies with its operations so
#: far (the orchestrator's default ``wait_chunk_s``).
DEFAULT_GRANT_WAIT_S = 30.0

_S = model.State


class AgentCore:
    """Jobs, operations and grant epochs of one node, and the backends that move state."""

    def __init__(
        self,
        *,
        node: str,
        backends: Mapping[str, base.Backend],
        default_backend: str,
        store: store.Store,
        agent_metrics: metrics.AgentMetrics,
        operation_timeout_s: float = 600.0,
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
        self.guarded = guarded.GuardedBackends(
            backends, operation_timeout_s=operation_timeout_s, on_unavailable=on_backend_error
        )
        #: The node's records, one per (job, group) (``model.Key``), in memory and on disk.
        self.store = store
        #: The record a request about a job (and group) means: the store's rule.
        self.key = store.key
        self._metrics = agent_metrics
        self.host_budget = host_budget or parking.HostBudget()  # DESIGN.md invariant 8
        agent_metrics.count_jobs(store.job_counts)
        #: Whether a job's workload may serve it over the workload channel.
        self._channel = "app-channel" in self.backends
        self._channel_registered = channel_registered or (lambda _job_id, _group: False)
        self._clock = clock
        #: Resolved once an operation's outcome is kept (in memory; see ``Store.keep_outcome``).
        self._done: dict[str, asyncio.Future[None]] = {}
        #: One lock per job id: a job's records of several groups change one at a time.
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._running: set[asyncio.Task[Any]] = set()
        self._workloads = presence.WorkloadPresence(
            records=store,
            locks=self._locks,
            done=self._done,
            registered=self._safe_channel_registered,
            spawn=lambda coro, name: self._spawn(coro, name=name),
        )

    # ---- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Settle the jobs a dead agent left TRANSITIONING (the store has loaded them)."""
        now = self._clock()
        for job in list(self.store.jobs.values()):
            if job.state is not _S.TRANSITIONING:
                continue
            enabled = job.backend in self.guarded
            recovered = await self.guarded.recover(job.backend, job) if enabled else None
            new_job, op = rules.after_restart(
                job,
                self.store.operations.get(job.operation_id),
                recovered=recovered,
                now=now,
                backend_enabled=enabled,
            )
            self.store.commit(jobs=[new_job], ops=[op] if op else [], previous=job)
            log.warning(
                "job %s was TRANSITIONING when the agent stopped; now %s",
                job.job_id,
                new_job.state.value,
                extra={"job_id": job.job_id, "operation_id": job.operation_id},
            )
        # Operations whose job record was lost or moved on are settled the same way.
        orphans = [op for op in self.store.operations.values() if not op.finished]
        for op in orphans:
            self.store.commit(ops=[rules.interrupted(op, now=now)], previous=None)
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
        self.store.flush()

    # ---- queries (each answers from records that are on disk) ---------------------------

    def list_jobs(self) -> list[model.Job]:
        self.store.flush()
        return self.store.sorted_jobs()

    def job(self, job_id: str, group: str = "") -> model.Job | None:
        self.store.flush()
        return self.store.find(job_id, group)

    def now(self) -> float:
        return self._clock()

    def get_operation(self, op_id: str) -> model.Operation:
        self.store.flush()
        return self.store.operation(op_id)

    async def wait_operation(self, op_id: str, *, timeout_s: float) -> model.Operation:
        """The operation once finished, or as it is (PENDING) after ``timeout_s``."""
        (op,) = await self.settle([self.get_operation(op_id)], timeout_s=timeout_s)
        self.store.flush()
        return op

    async def settle(
        self, ops: Sequence[model.Operation], *, timeout_s: float | None
    ) -> list[model.Operation]:
        """``ops`` once all finished, or as they are after ``timeout_s`` (None: no limit);
        their outcomes may not be on disk yet (``Store.flush`` before answering)."""
        waits = []
        for op in ops:
            done = self._done.get(op.op_id)
            if done is not None:
                waits.append(done)
        if waits and (timeout_s is None or timeout_s > 0):
            limit = None if timeout_s is None else min(timeout_s, MAX_WAIT_S)
            # asyncio.wait never cancels the shared futures, whoever stops waiting.
            await asyncio.wait(waits, timeout=limit)
        settled = []
        for op in ops:
            settled.append(self.store.operations.get(op.op_id, op))
        return settled

    async def accelerators(self) -> list[base.Accelerator]:
        return await self.guarded.accelerators()

    def host_memory(self) -> tuple[int | None, int]:  # (limit, parked bytes), for Status
        return parking.usage(self.guarded, self.host_budget, self.store.jobs.values())

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
        async with self._locks[job_id]:
            job = self.store.find(job_id, group)
            route = self._route(job_id, job, config, deprecated_backend)
            if kind is model.Kind.SNAPSHOT:
                op = await self._snapshot(job, route, job_id=job_id, group=group)
            else:
                op = await self._restore(job, route, job_id=job_id, group=group)
        (op,) = await self.settle([op], timeout_s=wait_s)
        self.store.flush()
        return op

    async def grant(
        self,
        order: grant_plan.Order,
        *,
        wait_s: float = DEFAULT_GRANT_WAIT_S,
        devices: Sequence[int] = (),
    ) -> grant_plan.GrantOutcome:
        """Make the ordered job's state for its group resident here and record the grant.

        The moves (evict, make room, bring in) are planned by ``grant_plan`` one at a time,
        each an ordinary operation. After at most ``wait_s`` the outcome says
        ``granted=False`` with the operations so far if the node is not done or one FAILED;
        the same Grant again continues from where the node stands."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_s, MAX_WAIT_S)
        # A stale grant must not evict anything.
        last = self.store.marks.get(order.group)
        rules.check_epoch(
            job_id=order.job_id, group=order.group, epoch=order.epoch, last=last, node=self.node
        )
        # The backend that serves the job: one not enabled is refused before any eviction.
        route = self._route(order.job_id, self.store.find(order.job_id, order.group), order.config)
        self.guarded.use_devices(order.group, devices)
        seen: dict[str, model.Operation] = {}
        for _ in range(order.max_steps):
            moves = await self._next_moves(order, route)
            if moves is None:  # resident, and the grant recorded
                return self._grant_outcome(order, seen, granted=True)
            moves = await self.settle(moves, timeout_s=max(0.0, deadline - loop.time()))
            for op in moves:
                seen[op.op_id] = op
            verdict = grant_plan.after_round(
                order,
                moves,
                job=self.store.jobs.get((order.job_id, order.group)),
                mark=self.store.marks.get(order.group),
            )
            if verdict is not grant_plan.Verdict.GO_ON:
                granted = verdict is grant_plan.Verdict.GRANTED
                return self._grant_outcome(order, seen, granted=granted)
        raise grant_plan.kept_changing(order, node=self.node)

    def _grant_outcome(
        self, order: grant_plan.Order, seen: Mapping[str, model.Operation], *, granted: bool
    ) -> grant_plan.GrantOutcome:
        self.store.flush()  # the reply shows only what is on disk
        job = self.store.find(order.job_id, order.group)
        return grant_plan.outcome(order, seen.values(), job=job, granted=granted)

    async def _next_moves(
        self, order: grant_plan.Order, route: model.Route
    ) -> list[model.Operation] | None:
        """Start the Grant's next move; its operations, or ``None`` once the job is in
        (an eviction whose states left meanwhile starts none: the next round looks
        again). ``route``: the backend that serves the granted job."""
        target = self.store.key(order.job_id, order.group)
        overlap = route.backend in self.guarded.overlapping
        move = grant_plan.next_move(order, self.store.jobs, target=target, overlap=overlap)
        if isinstance(move, grant_plan.AskFit):
            job = self.store.jobs.get(target)
            fits = await self.guarded.fits(route, grant_plan.as_asked(order, job))
            move = grant_plan.next_move(order, self.store.jobs, target=target, fits=fits)
        if isinstance(move, grant_plan.Evict):
            return await self._evict(order, move)
        brought_in = await self._bring_in(order)
        return None if brought_in is None else [brought_in]

    async def _evict(
        self, order: grant_plan.Order, move: grant_plan.Evict
    ) -> list[model.Operation]:
        """Snapshot the states ``move`` names (and bring the job in beside them if it says
        so); the operations started or found running."""
        if move.giving_way:
            log.info(
                "job %s (group %s) gives way on node %s to job %s of group %s",
                *move.keys[0],
                self.node,
                order.job_id,
                order.group,
                extra={"job_id": move.keys[0][0]},
            )
        for key in move.keys if len(move.keys) > 1 else ():  # all must fit before any freezes
            if (job := self.store.jobs.get(key)) is not None:
                await self._parkable(job, self._route(key[0], job, None))
        moves = []
        for key in move.keys:
            op = await self._start_eviction(key)
            if op is not None:
                moves.append(op)
        if move.bring_in:
            # Overlap: the restore starts while the snapshots free the memory it lands in.
            leaving = {(op.job_id, op.group) for op in moves if op.kind is model.Kind.SNAPSHOT}
            brought_in = await self._bring_in(order, leaving=leaving)
            if brought_in is not None:
                moves.append(brought_in)
        return moves

    async def prefetch(
        self, *, job_id: str, group: str, config: pb.BackendConfig | None
    ) -> model.Job:
        """Start bringing a SAVED job's state into free memory ahead of its grant (issue 9
        §2; the record stays SAVED). Refused unless the job is SAVED here and its backend
        ``prefetches``; the copy runs in the background, under the operation deadline."""
        async with self._locks[job_id]:
            job = self.store.find(job_id, group)
            if job is None:
                raise rules.unknown_job(job_id, group, node=self.node)
            route = self._route(job_id, job, config)
            rules.check_prefetch(
                job,
                backend=route.backend,
                declared=route.backend in self.guarded.prefetching,
                node=self.node,
            )
            self._spawn(
                self.guarded.prefetch(route.backend, job), name=f"prefetch-{job_id}-{job.group}"
            )
            return job

    async def reset(self, *, job_id: str, group: str = "") -> model.State:
        async with self._locks[job_id]:
            job = rules.check_reset(
                self.store.find(job_id, group), job_id=job_id, group=group, node=self.node
            )
            enabled = job.backend in self.guarded
            recovered = await self.guarded.recover(job.backend, job) if enabled else None
            new_job = rules.after_reset(job, recovered=recovered)
            self.store.commit(jobs=[new_job], previous=job)
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
        if self._channel:
            self._workloads.on_event(event)

    async def prune_operations(self) -> int:
        """Forget finished operations past retention (and beyond the count limit)."""
        return self.store.prune(now=self._clock())

    # ---- the moves, each under its job's lock -------------------------------------------

    async def _snapshot(
        self, job: model.Job | None, route: model.Route, *, job_id: str, group: str
    ) -> model.Operation:
        probe = job if job is not None else model.Job(job_id=job_id, group=group)
        await self.guarded.validate(route, probe)
        # Asked only where a rule depends on it: a FAULTED job, or one this node has no
        # record of (a typo creates nothing: it is adopted only if its backend holds it).
        recovered = None
        if job is None or job.state is _S.FAULTED:
            recovered = await self.guarded.recover(route.backend, probe)
        if route.backend in self.guarded.parking:
            # Refused (RESOURCE_EXHAUSTED) before anything is frozen if it cannot be parked.
            held = job or dataclasses.replace(probe, state=recovered or _S.RUNNING)
            await self._parkable(held, route)
        plan = rules.plan_snapshot(job, self._request(job_id, group, route), recovered=recovered)
        op = self._apply(plan, previous=job, config=route.config)
        assert op is not None  # a snapshot plan always has an operation
        return op

    async def _restore(
        self, job: model.Job | None, route: model.Route, *, job_id: str, group: str
    ) -> model.Operation:
        await self.guarded.validate(route, job or model.Job(job_id=job_id, group=group))
        recovered = None
        if job is not None and job.state is _S.FAULTED:
            recovered = await self.guarded.recover(route.backend, job)
        partial = job is not None and await self.guarded.missing_tags(route, job)
        plan = rules.plan_restore(
            job,
            self._request(job_id, group, route),
            others=self.store.in_group(group or (job.group if job else "")),
            recovered=recovered,
            partial=partial,
        )
        # An explicit restore config applies to this operation only; the recorded one stays.
        op = self._apply(plan, previous=job, config=route.config)
        assert op is not None  # a restore plan always has an operation
        return op

    async def _start_eviction(self, key: model.Key) -> model.Operation | None:
        """Snapshot a resident job for a Grant; the operation running on it if there is one."""
        job_id, group = key
        async with self._locks[job_id]:
            job = self.store.find(job_id, group)
            if job is None or job.state is _S.IDLE or job.state is _S.SAVED:
                return None
            if job.state is _S.TRANSITIONING:
                return self.store.running(job)
            # A FAULTED job is snapshotted only if its backend says it still runs.
            route = self._route(job_id, job, None)
            return await self._snapshot(job, route, job_id=job_id, group=group)

    async def _bring_in(
        self, order: grant_plan.Order, *, leaving: Collection[model.Key] = ()
    ) -> model.Operation | None:
        """Record the grant; ``None`` if the job is resident, else the operation bringing
        it in. ``leaving``: records of the group whose snapshot runs (an overlapping
        restore)."""
        job_id, group = order.job_id, order.group
        async with self._locks[job_id]:
            job = self.store.find(job_id, group)
            if job is not None and job.state is _S.TRANSITIONING:
                running = self.store.operations.get(job.operation_id)
                if running is not None:
                    return running
            route = self._route(job_id, job, order.config)
            await self.guarded.validate(route, grant_plan.as_asked(order, job))
            last = self.store.marks.get(group)
            mark = rules.new_mark(job_id=job_id, group=group, epoch=order.epoch, last=last)
            request = self._request(job_id, group, route)
            others = self.store.in_group(group or (job.group if job else ""))
            plan: model.Start | model.Unchanged
            if order.restore and job is not None and job.state is _S.SAVED:
                rules.check_epoch(
                    job_id=job_id, group=group, epoch=order.epoch, last=last, node=self.node
                )
                restore = rules.plan_restore(job, request, others=others, leaving=leaving)
                assert isinstance(restore, model.Start)  # a SAVED job has something to move
                plan = restore
            else:
                plan = rules.plan_grant(
                    job,
                    request,
                    epoch=order.epoch,
                    last=last,
                    footprint_bytes=order.footprint_bytes,
                    others=others,
                )
            return self._apply(plan, previous=job, config=route.config, mark=mark)

    # ---- the executor -----------------------------------------------------------------------

    def _apply(
        self,
        plan: model.Start | model.Done | model.Unchanged,
        *,
        previous: model.Job | None,
        config: pb.BackendConfig | None,
        mark: model.GrantMark | None = None,
    ) -> model.Operation | None:
        """Store a plan (with the grant ``mark`` it records) over the record it was made
        from (``previous``), and start its backend call; its operation (``None``: nothing
        changes on the devices). No ``await``: see the module docstring."""
        marks = [mark] if mark is not None else []
        if isinstance(plan, model.Unchanged):
            if plan.job != previous or marks:
                self.store.commit(jobs=[plan.job], marks=marks, previous=previous)
            return None
        op = plan.operation
        if isinstance(plan, model.Done):
            self.store.commit(jobs=[plan.job], ops=[op], marks=marks, previous=previous)
            return op
        self._done[op.op_id] = asyncio.get_running_loop().create_future()
        try:
            self.store.commit(jobs=[plan.job], ops=[op], marks=marks, previous=previous)
        except BaseException:
            del self._done[op.op_id]
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

    async def _execute(
        self, job: model.Job, op: model.Operation, config: pb.BackendConfig | None
    ) -> None:
        """An operation's task: the backend call, then its outcome kept and its waiters woken."""
        started = time.monotonic()
        outcome = await self.guarded.run(op, job, config)
        # The lock keeps a concurrent record change (a channel registration) from being lost.
        async with self._locks[job.job_id]:
            current = self.store.jobs.get((job.job_id, job.group), job)
            new_job, new_op = rules.finish(current, op, outcome=outcome, now=self._clock())
            if new_op.status is model.OpStatus.COMPLETE:
                outcome_label = "complete"
            else:
                outcome_label = "faulted" if new_job.state is _S.FAULTED else "failed"
            self._metrics.observe(
                backend=op.backend,
                kind=op.kind.value,
                outcome=outcome_label,
                seconds=time.monotonic() - started,
                device_bytes=new_op.device_bytes or 0,
            )
            try:
                self.store.keep_outcome(new_job, new_op)
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

    def _spawn(self, coro: Any, *, name: str) -> None:
        task = tasks.spawn(coro, name=name)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    # ---- facts ------------------------------------------------------------------------------

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
        deprecated_backend: int = 0,
    ) -> model.Route:
        """The backend that serves a request on ``job`` (refused if it is not enabled)."""
        registered = self._channel and self._safe_channel_registered(
            job_id, job.group if job else ""
        )
        route = routing.route(
            request_config=config,
            deprecated_backend=deprecated_backend,
            job=job,
            channel_registered=registered,
            default_backend=self.default_backend,
        )
        if route.backend not in self.backends:
            raise routing.not_enabled(route.backend, enabled=self.backends, node=self.node)
        return route

    def _safe_channel_registered(self, job_id: str, group: str) -> bool:
        if not self._channel:
            return False
        try:
            return bool(self._channel_registered(job_id, group))
        except Exception:
            log.exception("workload channel registration lookup failed for job %s", job_id)
            return False

    async def _parkable(self, job: model.Job, route: model.Route) -> None:
        """Refused where the node's host memory cannot park the state (``parking``)."""
        await parking.check(self.guarded, self.host_budget, self.store.jobs.values(), route, job)
