"""One group: its entry points, its lifecycle, and the commands its executor applies.

:class:`GroupDriver` owns the group's pure lock (``group.lock``) and its executor
(``group.executor``). Every change to the group is a command posted to the executor:
the RPCs, the switch's progress and outcome (``switch.step``), recovery's reads
(``group.recovery``), the lease and wake-up timers, the device claim (``group.overlap``)
and the sets (``sets.coordinator``). The commands are the driver's ``_on_*`` methods: each
calls the lock and returns what it decided, with effects of its own; the executor books
them, saves and acts. Those outside the group reach it only through the driver's methods
that post a command (``claim_granted``, ``set_ready``, ``switch_ended``...), so a group's
events are serialised while groups run in parallel (a stuck agent of one group never
blocks another). The administrators' calls and the status reads are in ``group.admin``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import tasks
from tslice.orchestrator import config, policy
from tslice.orchestrator.events import bus
from tslice.orchestrator.group import (
    admin,
    callers,
    coordination,
    executor,
    leases,
    lock,
    recovery,
    services,
    state,
    status,
)
from tslice.orchestrator.group import effects as fx
from tslice.orchestrator.persistence import records
from tslice.orchestrator.policy import prefetch
from tslice.orchestrator.switch import plan, step
from tslice.rpc import refusals

log = logging.getLogger(__name__)

Kind = opb.OrchestratorEvent


#: (named here too: callers build ``driver.Services``)
Services = services.Services


class GroupDriver(admin.Admin):
    """Runs one group: its lock, its executor, and what posts to it."""

    def __init__(
        self,
        *,
        group_id: str,
        nodes: tuple[config.NodeRef, ...],
        services: services.Services,
        record: records.LockRecord | None = None,
    ) -> None:
        self.group_id = group_id
        self.nodes = nodes
        #: What it shares with the other groups (an AcquireSet reaches their coordinator).
        self.services = services
        cfg = self._cfg = services.cfg
        self._cap = cfg.limits.max_waiters_per_group
        scheduling = policy.build(cfg.policy_for(group_id))
        if record is None:
            offset = time.time() - time.monotonic()
            self.lock = lock.GroupLock(
                reattach_grace_s=cfg.reattach_grace_s, wall_offset_s=offset, policy=scheduling
            )
        else:
            self.lock = lock.GroupLock.from_record(
                record,
                now=time.monotonic(),
                reattach_grace_s=cfg.reattach_grace_s,
                wall_now=time.time(),
                policy=scheduling,
            )
        # This driver wakes the lock at lock.wake_at (a policy keeping the group for
        # its resident): the lock may then keep an idle group.
        self.lock.use_policy(scheduling, woken=True)
        self._wake: tuple[float, asyncio.TimerHandle] | None = None
        #: Each node's jobs, cached by the running switch (dropped when no switch runs).
        self.views: dict[str, plan.NodeView] = {}
        self.health = status.Health()
        #: Where the group's events go (WatchEvents, the tap).
        self.bus = services.bus
        self._leases = leases.Leases(group_id, services.metrics, expired=self._lease_expired)
        #: When the reported state last changed (noted after every batch).
        self.since = status.Since()
        self._backoff = step.Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._switches = step.Switches(
            self, agents=services.pool, cfg=cfg, series=services.metrics, plan_for=self._plan
        )
        self.coordination = coordination.Coordination(group_id, self.lock, services, self.views)
        self.executor = executor.Executor(
            group_id=group_id,
            nodes=nodes,
            lk=self.lock,
            group=self,
            coordination=self.coordination,
            switches=self._switches,
            events=services.bus,
            db=services.db,
            store_health=services.store_health,
            backoff=self._backoff,
        )
        self.coordination.executor = self.executor
        self._tasks: set[asyncio.Task[Any]] = set()
        #: The last prefetch asked for (one per waiter and grant).
        self._prefetched: prefetch.Candidate | None = None
        self._stopping = False
        #: Collected as idle (local mode): its rows are deleted, a new driver takes its id.
        self.retired = False
        series = services.metrics
        self._deferred_snapshots = series.deferred_snapshots.labels(group_id=group_id)
        self._switch_outcomes: dict[str, Any] = {}
        self._switch_duration = series.switch_duration.labels(group_id=group_id)
        shared = services.arbiter.join(group_id, nodes, self.coordination)
        self.coordination.shared = shared
        services.sets.join(group_id, self.coordination)
        services.locks[group_id] = self.lock
        if shared and self.lock.holder is not None:
            services.arbiter.seize(group_id, self.lock.holder)
        else:  # (a claim kept through a restart, with nobody to hold it for now)
            services.arbiter.release(group_id)
        self.lock.start_claim(self.lock.holder, exclusive=not shared)

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        if self.lock.recovering:
            self._spawn(self._recover(), "recover")
            self._spawn(self._expire(), "expire")
        # A holder restored from disk has its lease (from now) to re-open its Hold stream.
        self._leases.sync(self.lock)

    async def _recover(self) -> None:
        views = await recovery.read_until_all_answer(
            group=self.group_id,
            nodes=self.nodes,
            pool=self.services.pool,
            backoff=self._backoff,
            note=self._reads,
        )
        self.executor.post(self._on_recovered, views)

    def _reads(self, reads: plan.Reads) -> None:
        self.executor.post(self._on_reads, reads)

    def _on_reads(self, now: float, reads: plan.Reads) -> list[Any]:
        self.health.note(reads)
        return []

    def _on_recovered(self, now: float, views: dict[str, plan.NodeView]) -> list[fx.Action]:
        lk = self.lock
        decision = recovery.decide_recovery(
            group=self.group_id,
            resident=lk.resident,
            intent=lk.switching,
            known_jobs=status.known_jobs(lk),
            views=list(views.values()),
        )
        log.info(
            "group %s recovered: %s",
            self.group_id,
            decision.reason,
            extra={"group_id": self.group_id, "resident": decision.resident},
        )
        self.views.update(views)
        return lk.on_recovered(
            resident=decision.resident,
            verified=decision.verified,
            rollback=decision.rollback,
            now=now,
        )

    def _spawn(self, work: Any, what: str) -> None:
        task = tasks.spawn(work, name=f"group:{self.group_id}:{what}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self, *, grace_s: float, restarting: bool = False) -> None:
        """Refuse new work, let a switch in flight finish within the grace, fail waiters.
        ``restarting``: a new driver takes the group over at once (it keeps its claim)."""
        self._stopping = True
        self._arm_wake(None)
        services = self.services
        services.arbiter.leave(self.group_id, restarting=restarting)
        services.sets.leave(self.group_id)
        if services.locks.get(self.group_id) is self.lock:
            del services.locks[self.group_id]
        await self._switches.finish(grace_s=grace_s)
        # Let the executor save and act on what the switch reported.
        await asyncio.wait({self.executor.flushed()}, timeout=max(grace_s, 0.5))
        self.executor.close()
        await tasks.cancel_all([*self._tasks, *self._switches.pending()])
        # What is left is failed here (queue entries stay persisted: after a restart the
        # jobs re-attach and keep their place).
        self._leases.stop(admin.shutting_down())
        for waiters in self.executor.waiting.values():
            callers.refuse(waiters, refusals.Code.UNAVAILABLE, admin.shutting_down().message)
        self.executor.waiting.clear()

    # ---- Acquire ---------------------------------------------------------------------------

    def acquire(
        self,
        job: str,
        *,
        footprint_bytes: int,
        lease_ms: int = 0,
        time_left: float | None = None,
        set_seq: int | None = None,
    ) -> callers.Waiter:
        """The Acquire, waiting for its grant (its future); ``time_left``: the caller's
        deadline (None: none); ``set_seq``: one group of that set (see sets), granted
        with the others. Raises ``refusals.Refused``."""
        if self._stopping:
            raise self.gone()
        lk = self.lock
        full = callers.no_room(lk.queue, lk.holder, job=job, cap=self._cap, group_id=self.group_id)
        if full is not None:
            raise full
        if footprint_bytes > 0:
            self._check_fits(job, footprint_bytes)
        waiter = callers.new_waiter(self, job, set_seq=set_seq, time_left=time_left)
        self.executor.post(self._on_arrival, waiter, footprint_bytes, lease_ms, time.monotonic())
        return waiter

    async def fits(self, job: str, footprint_bytes: int) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a footprint that can never be resident; nodes never
        read are read once first (a short deadline)."""
        clients = [self.services.pool.get(n.address) for n in self.nodes]
        unread = tuple(n for n, c in zip(self.nodes, clients, strict=True) if not c.status_seen)
        if unread:
            timeout_s = min(1.0, self._cfg.status_timeout_s)
            await plan.read_all(self.services.pool, unread, self.group_id, timeout_s=timeout_s)
            for n, c in zip(self.nodes, clients, strict=True):
                if n in unread:
                    c.status_seen = True  # asked once; later reads keep it up to date
        self._check_fits(job, footprint_bytes)

    def needs_read(self) -> bool:
        """Whether a fit check must read a node first (one never read)."""
        return any(not self.services.pool.get(n.address).status_seen for n in self.nodes)

    def _check_fits(self, job: str, footprint_bytes: int) -> None:
        agents = self.services.pool
        refused = callers.never_fits(
            [(n, agents.get(n.address).device_bytes) for n in self.nodes],
            group_id=self.group_id,
            job=job,
            footprint_bytes=footprint_bytes,
        )
        if refused is not None:
            raise refused

    def depart(self, waiter: callers.Waiter) -> None:
        """``waiter`` stopped waiting: withdrawn, or (granted) its reply undelivered."""
        if not self._stopping:
            self.executor.post(self._on_depart, waiter)

    def held_back_by(self) -> str:
        """What keeps the group from granting and what to do, when it is a fault, a
        drain or a snapshot the nodes cannot park ("" = none of them: it is busy)."""
        lk = self.lock
        if lk.draining:
            return callers.drained(self.group_id)
        state, detail = self.reported_state()
        if state == "UNKNOWN" or (state == "SWITCHING" and self.health.switch_detail):
            return callers.faulted(self.group_id, detail)
        if lk.unparkable:
            return callers.faulted(self.group_id, lk.unparkable)
        return ""

    def _on_arrival(
        self,
        now: float,
        waiter: callers.Waiter,
        footprint_bytes: int,
        lease_ms: int,
        since: float,
    ) -> Iterable[Any]:
        if waiter.future.done():
            return ()  # it went away before its turn came (depart was posted too)
        self.executor.waiting.setdefault(waiter.job, []).append(waiter)
        decided: list[Any] = self.lock.on_acquire(
            waiter.job,
            footprint_bytes=footprint_bytes,
            lease_ms=lease_ms,
            set_seq=waiter.set_seq,
            now=now,
        )
        if footprint_bytes > 0 and self.lock.attached_waiters == 1:
            decided.extend(self.prefetch_after(now))  # the only waiter: it is next
        return decided

    def _on_depart(self, now: float, waiter: callers.Waiter) -> list[fx.Action]:
        if waiter.granted_epoch is not None:
            return self.lock.on_undelivered(waiter.job, epoch=waiter.granted_epoch, now=now)
        pending = self.executor.waiting.get(waiter.job, [])
        if waiter not in pending:
            return []  # already answered (aborted) elsewhere
        pending.remove(waiter)
        if not pending:
            del self.executor.waiting[waiter.job]
        return self.lock.on_cancel(waiter.job, now=now)

    # ---- Yield -----------------------------------------------------------------------------

    def yield_(self, job: str) -> asyncio.Future[fx.YieldOutcome]:
        """The Yield's outcome, once persisted; applied even if the caller goes away."""
        if self._stopping:
            raise self.gone()
        reply: asyncio.Future[fx.YieldOutcome] = asyncio.get_running_loop().create_future()
        self.executor.post(self._on_yield, job, reply)
        return reply

    def _on_yield(self, now: float, job: str, reply: asyncio.Future[fx.YieldOutcome]) -> list[Any]:
        lk = self.lock
        was_holder = lk.holder == job
        out = lk.on_yield(job, now=now)
        effects: list[Any] = list(out.actions)
        if out.ok and was_holder:
            if out.snapshot_deferred:
                effects.append(fx.CountDeferredSnapshot())
            ending = self._leases.released(job)
            if ending:
                effects.append(fx.EndHolds(ending))
        effects.append(fx.Answer(reply, out))
        return effects

    # ---- a switch (switch.step.Group) ------------------------------------------------------

    def _plan(self, s: fx.StartSwitch) -> plan.SwitchPlan:
        """What every node of switch ``s`` is asked; the overlapping groups whose residents
        may give way on each node (while this group holds the claim none has a holder)."""
        arbiter = self.services.arbiter
        give_way: dict[str, frozenset[str]] = {}
        # (A group that shares no devices has nobody to make give way.)
        for other in arbiter.released(self.group_id) if self.coordination.shared else ():
            for node in arbiter.shared_nodes(self.group_id, other):
                give_way[node] = give_way.get(node, frozenset()) | {other}
        return plan.SwitchPlan(
            self.group_id,
            s.from_job,
            s.to_job,
            s.epoch,
            s.footprint_bytes,
            give_way,
            stray=arbiter.stray,
            homes=arbiter.homes,
        )

    def wants_switch(self) -> bool:
        return not self._stopping and self.lock.wants_switch(now=time.monotonic())

    def node_ok(self, node: str) -> None:
        if node in self.health.unreachable:  # (read here, changed by a command)
            self.executor.post(self._on_node_ok, node)

    def _on_node_ok(self, now: float, node: str) -> list[Any]:
        self.health.unreachable.pop(node, None)
        return []

    def node_failed(self, failure: step.NodeFailure) -> None:
        self.services.metrics.switch_step_failures.labels(
            group_id=self.group_id, node=failure.node, operation=failure.operation
        ).inc()
        why = (
            f"{failure.node}: {failure.operation} failed: {failure.detail}; retrying in "
            f"{failure.retry_in:.2f} s"
        )
        failed = _switch_event(Kind.KIND_SWITCH_FAILED, self.group_id, self.lock.switch)
        failed.node, failed.detail = failure.node, why
        self.bus.publish(failed)
        log.warning("group %s: %s", self.group_id, why)
        self.executor.post(self._on_node_failed, failure, why)

    def _on_node_failed(self, now: float, failure: step.NodeFailure, why: str) -> list[Any]:
        self.health.switch_detail = why
        if failure.unreachable:
            self.health.unreachable[failure.node] = failure.detail
            self.lock.on_node_unreachable()
        else:
            self.health.unreachable.pop(failure.node, None)
        return []

    def switch_ended(self, switch: fx.StartSwitch, outcome: step.Outcome) -> None:
        self.executor.post(self._on_switch_ended, switch, outcome)

    def _on_switch_ended(self, now: float, s: fx.StartSwitch, outcome: step.Outcome) -> list[Any]:
        """The lock decides what comes after the switch; its events go out once that is
        saved (SWITCH_DONE before GRANTED, which the Acquire's answer precedes)."""
        self.health.switch_detail = ""
        if isinstance(outcome, step.Done):
            log.info(
                "group %s: switch %s -> %s done in %.1f ms%s",
                self.group_id,
                s.from_job or "-",
                s.to_job,
                outcome.seconds * 1000,
                " (restored)" if outcome.restored else "",
                extra={"group_id": self.group_id, "job_id": s.to_job, "grant_epoch": s.epoch},
            )
            self._count_switch("completed")
            self._switch_duration.observe(outcome.seconds)
            if not s.recovered:  # a recovered switch's time is only part of one
                self.lock.on_switch_measured(s.from_job, s.to_job, seconds=outcome.seconds)
            done = _switch_event(Kind.KIND_SWITCH_DONE, self.group_id, s)
            done.detail = "restored" if outcome.restored else ""
            done.duration_ms = int(outcome.seconds * 1000)
            decided = self.lock.on_switch_done(epoch=s.epoch, restored=outcome.restored, now=now)
            return [fx.Publish(done), *decided]
        self.views.clear()
        name, detail, decided = self._ended(s, outcome, now)
        if name:
            self._count_switch(name)
            failed = _switch_event(Kind.KIND_SWITCH_FAILED, self.group_id, s)
            failed.detail = detail
            return [fx.Publish(failed), *decided]
        return decided

    def _ended(
        self, s: fx.StartSwitch, outcome: step.Outcome, now: float
    ) -> tuple[str, str, list[fx.Action]]:
        """(the outcome's name for the metric, what the event says, what the lock decides)
        of a switch that ended without its grant."""
        lk = self.lock
        match outcome:
            case step.Refused(code=code, detail=detail):
                decided = lk.on_switch_refused(epoch=s.epoch, code=code, detail=detail, now=now)
                return "refused", f"refused: {detail}", decided
            case step.Unparkable(detail=detail):
                decided = lk.on_switch_unparkable(epoch=s.epoch, detail=detail, now=now)
                self._retry_parking(lk.unparkable_tries)
                return "unparkable", detail, decided
            case step.StaleEpoch(node=node, mark=mark):
                why = (
                    f"grant epoch {s.epoch} is behind node {node}'s mark {mark} (this "
                    "orchestrator's state was lost or truncated); granting again past it"
                )
                log.warning("group %s: %s", self.group_id, why)
                return "stale_epoch", why, lk.on_stale_epoch(epoch=s.epoch, mark=mark, now=now)
            case step.Degraded(node=node, cause=cause):
                return (
                    "degraded",
                    f"node {node} degraded: {cause}",
                    self._degrade(s, node, cause, now),
                )
            case step.Deposed(detail=detail):
                # The group's state is the new leader's: nothing is recorded here (this
                # replica steps down and its groups stop).
                log.warning(
                    "group %s: switch to %s stopped, this leader was deposed: %s",
                    self.group_id,
                    s.to_job,
                    detail,
                )
                return "", "", []
            case step.Abandoned(detail=detail):
                decided = lk.on_switch_failed(epoch=s.epoch, detail=detail, now=now)
                return "abandoned", f"abandoned (nobody waits any more): {detail}", decided
        return "", "", []

    def _degrade(self, s: fx.StartSwitch, node: str, cause: str, now: float) -> list[fx.Action]:
        reason = (
            f"group {self.group_id}: node {node} is degraded ({cause}); fix the cause, "
            f"then clear it: tslice clear-degraded {self.group_id} --node {node}"
        )
        log.error("%s", reason, extra={"group_id": self.group_id})
        self.health.degraded[node] = cause
        return self.lock.on_degraded(epoch=s.epoch, cause=cause, reason=reason, now=now)

    def _count_switch(self, outcome: str) -> None:
        series = self._switch_outcomes.get(outcome)
        if series is None:
            series = self.services.metrics.switches.labels(group_id=self.group_id, outcome=outcome)
            self._switch_outcomes[outcome] = series
        series.inc()

    def _retry_parking(self, tries: int) -> None:
        """The nodes could not park the switch's snapshot: try again later (what they
        hold changes when other groups restore or end their jobs)."""
        delay = self._backoff.delay(tries)
        asyncio.get_running_loop().call_later(delay, self.executor.post, self._on_parking_retry)

    def _on_parking_retry(self, now: float) -> list[fx.Action]:
        return self.lock.on_parking_retry(now=now)

    # ---- executor.Group ----------------------------------------------------------------

    def prefetch_after(self, now: float) -> list[fx.Effect]:
        """Bring the next waiter's state in beside the holder (see policy.prefetch), if
        it declared a footprint: once per waiter and grant."""
        lk = self.lock
        if lk.holder is None or lk.switch is not None or not lk.attached_waiters:
            return []
        if not lk.footprints or self._stopping:
            return []  # (nobody declared one: the ranking is not even asked)
        candidate = prefetch.next_to_prefetch(lk, switching=False, now=now)
        if candidate is None or candidate == self._prefetched:
            return []
        self._prefetched = candidate
        return [fx.Prefetch(candidate)]

    def start_prefetch(self, candidate: prefetch.Candidate) -> None:
        work = step.prefetch_everywhere(self.services.pool, self.nodes, self.group_id, candidate)
        self._spawn(work, f"prefetch:{candidate.job}")

    def count_deferred_snapshot(self) -> None:
        self._deferred_snapshots.inc()

    def settled(self) -> None:
        lk = self.lock
        self._leases.sync(lk)
        self._arm_wake(None if self._stopping else lk.wake_at)
        # The state as status.reported_state names it, cheaply: only its name is timed.
        unknown = self.services.store_health.problem or self.health.unreachable or lk.recovering
        state = "UNKNOWN" if unknown else lk.phase().value
        if state != self.since.state:
            self.since.state, self.since.ns = state, time.time_ns()

    # ---- timers ------------------------------------------------------------------------

    def _arm_wake(self, at: float | None) -> None:
        """Wake the lock at ``at`` (a policy keeps the group for its resident), or not."""
        if self._wake is not None and self._wake[0] == at:
            return
        if self._wake is not None:
            self._wake[1].cancel()
            self._wake = None
        if at is not None:
            delay = max(0.0, at - time.monotonic())
            timer = asyncio.get_running_loop().call_later(delay, self._woken)
            self._wake = (at, timer)

    def _woken(self) -> None:
        self._wake = None
        self.executor.post(self._on_expire)

    def _on_expire(self, now: float) -> list[fx.Action]:
        return self.lock.on_expire(now=now)

    async def _expire(self) -> None:
        for deadline in self.lock.expiry_deadlines():
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self.executor.post(self._on_expire)

    def _lease_expired(self, job: str, epoch: int, lease_ms: int) -> None:
        self.executor.post(self._on_lease_expired, job, epoch, lease_ms)

    def _on_lease_expired(self, now: float, job: str, epoch: int, lease_ms: int) -> list[Any]:
        if self._leases.covers(job, epoch):
            return []  # a Hold stream arrived meanwhile
        deferred = self.lock.attached_waiters == 0
        decided: list[Any] = self.lock.on_lease_expired(job, epoch=epoch, now=now)
        if not decided:
            return []
        log.warning(
            "group %s: job %s kept no Hold stream open for its lease (%d ms); lock released",
            self.group_id,
            job,
            lease_ms,
            extra={"group_id": self.group_id, "job_id": job, "grant_epoch": epoch},
        )
        if deferred:
            decided.append(fx.CountDeferredSnapshot())
        return decided


async def evict_everywhere(
    drivers: Iterable[GroupDriver], job: str, reason: str = "", *, by: str = admin.BY_ADMIN
) -> list[tuple[str, fx.EvictOutcome]]:
    """Take ``job`` out of every group where it holds or waits (an administrator's
    Evict without a group, or a job whose processes are all gone): ``(group_id,
    outcome)`` per group it was in. Groups that are stopping are skipped."""
    live = [d for d in drivers if not d.stopping]
    outcomes = await asyncio.gather(*(d.evict(job, reason, by=by) for d in live))
    return [
        (d.group_id, out) for d, out in zip(live, outcomes, strict=True) if out.role is not None
    ]


def _switch_event(kind: int, gid: str, s: fx.StartSwitch | state.Switch | None) -> bus.Event:
    """An event about switch ``s`` (None: no switch is under way)."""
    if s is None:
        return bus.Event(kind, gid)
    return bus.Event(kind, gid, s.to_job, from_job=s.from_job or "", grant_epoch=s.epoch)
