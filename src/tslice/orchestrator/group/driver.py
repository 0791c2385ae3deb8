"""The per-group driver: the RPC entry points, lifecycle and state of one group.

:class:`GroupDriver` owns the group's :class:`lock.GroupLock`. Every change to a group
goes through its worker's inbox (``tslice.orchestrator.group.executor``, which applies a batch
of commands, persists the new state, and only then runs the effects): RPCs, the
switch's progress and outcome (``switching``), recovery's reads (``recovery``), lease
timers (``leases``), the device arbiter (``overlap``) and the live reads of
GetGroupStatus (``status``) all post commands. So a group's events are serialised
while groups run in parallel (a stuck agent of one group never blocks another).

Here the lock's decisions become effects (:meth:`GroupDriver.bind`): which Acquire
RPCs a grant went to, which one departed, is booked at once, in the command; replies,
events and switches run after persisting. The callers waiting on the group are kept
in ``callers``. Switches run in their own task and post their outcome back to the
inbox, so Acquire, Yield and cancellations keep flowing during a long switch. Waiters
wait on futures resolved by the worker: no polling anywhere. Only
:meth:`GroupDriver.stop` touches the state directly, once the worker is gone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import tasks
from tslice.orchestrator import config, metrics, policy
from tslice.orchestrator.events import bus as events
from tslice.orchestrator.group import callers, inbox, leases, lock, overlap, recovery, status, wake
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import executor as worker
from tslice.orchestrator.persistence import health as store_health
from tslice.orchestrator.persistence import records, store
from tslice.orchestrator.sets import coordinator as sets
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents
from tslice.orchestrator.switch import prefetching
from tslice.orchestrator.switch import runner as switching
from tslice.orchestrator.switch import step as switch
from tslice.rpc import refusals

log = logging.getLogger(__name__)

_T = TypeVar("_T")
Effect = inbox.Effect


def _shutting_down() -> refusals.Refused:
    return refusals.Refused(refusals.Code.UNAVAILABLE, "orchestrator shutting down; retry")


@dataclasses.dataclass(frozen=True)
class Services:
    """What every group of one orchestrator shares."""

    cfg: config.OrchestratorConfig
    db: store.LockStore
    pool: agents.AgentPool
    bus: events.EventBus
    metrics: metrics.OrchestratorMetrics
    #: Groups that share devices take turns through it (see overlap).
    arbiter: overlap.DeviceArbiter = dataclasses.field(default_factory=overlap.DeviceArbiter)
    #: Sets of groups acquired all-or-nothing are granted through it (see sets).
    sets: sets.SetCoordinator = dataclasses.field(default_factory=sets.SetCoordinator)
    #: Each group's holder, read by a group kept for a set (who may pass it).
    holders: dict[str, Callable[[], str | None]] = dataclasses.field(default_factory=dict)
    #: Whether the state can be written, and why not (see store_health).
    store_health: store_health.StoreHealth = dataclasses.field(
        default_factory=store_health.StoreHealth
    )


#: Who evicts when the Evict RPC does (Kubernetes mode names itself).
BY_ADMIN = "an administrator"


def eviction_message(group_id: str, reason: str, by: str = BY_ADMIN) -> str:
    """What an evicted job is told (its Acquire's error, its later Yield's, its events)."""
    return f"evicted from group {group_id!r} by {by}: {reason or 'no reason given'}"


class GroupDriver:
    """Runs one group: lock, persistence, and the parts that post to its inbox."""

    def __init__(
        self,
        *,
        group_id: str,
        nodes: tuple[config.NodeRef, ...],
        services: Services,
        record: records.LockRecord | None = None,
    ) -> None:
        self.group_id = group_id
        self.nodes = nodes
        #: What it shares with the other groups (an AcquireSet reaches their coordinator).
        self.services = services
        cfg = self._cfg = services.cfg
        self._db = services.db
        self._pool = services.pool
        self._metrics = services.metrics
        self._arbiter = services.arbiter
        grace = cfg.reattach_grace_s
        scheduling = policy.build(cfg.policy_for(group_id))
        if record is None:
            offset = time.time() - time.monotonic()
            self.lock = lock.GroupLock(
                reattach_grace_s=grace, wall_offset_s=offset, policy=scheduling
            )
        else:
            self.lock = lock.GroupLock.from_record(
                record,
                now=time.monotonic(),
                reattach_grace_s=grace,
                wall_now=time.time(),
                policy=scheduling,
            )
        # This driver wakes the lock at lock.wake_at (a policy keeping the group for its
        # resident: see tslice.orchestrator.group.wake).
        self.lock.use_policy(scheduling, woken=True)
        self._wake = wake.Wake(
            lambda: self.post(lambda now: self.bind(self.lock.on_expire(now=now)))
        )
        self._backoff = switch.Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._callers = callers.Callers()
        self.views: dict[str, steps.NodeView] = {}
        self.health = status.Health()
        self.events = events.GroupEvents(services.bus, group_id)
        self._leases = leases.Leases(group_id, self._metrics)
        self._reporter = status.Reporter(group_id, self._metrics)
        self._switches = switching.SwitchRunner(
            self, cfg=cfg, pool=self._pool, series=self._metrics, arbiter=self._arbiter
        )
        self._tasks: list[asyncio.Task[Any]] = []
        #: The last prefetch asked for (one per waiter and grant).
        self._prefetched: prefetching.Candidate | None = None
        self._stopping = False
        self._worker = worker.Worker(
            group_id=group_id,
            nodes=nodes,
            db=self._db,
            backoff=self._backoff,
            saved=record,
            record=self.lock.record,
            stopping=lambda: self._stopping,
            # Overlapping groups see who holds this one at once (see overlap).
            applied=lambda: self._arbiter.note_holder(group_id, self.lock.holder),
            settled=self._settled,
            health=services.store_health,
        )
        #: Collected as idle (local mode): its rows are deleted, a new driver takes its id.
        self.retired = False
        self._acquire_wait = self._metrics.acquire_wait.labels(group_id=group_id)
        self._deferred_snapshots = self._metrics.deferred_snapshots.labels(group_id=group_id)
        self._arbiter.join(
            group_id,
            nodes,
            granted=lambda job: self.post(
                lambda now: self.bind(self.lock.on_claim_granted(job, now=now))
            ),
            contended=lambda: self.post(lambda now: self.bind(self.lock.on_contended(now=now))),
        )
        self._sets = services.sets
        services.holders[group_id] = self._holder
        self._sets.join(
            group_id,
            lambda job, seq: self.post(
                lambda now: self.bind(self.lock.on_set_ready(job, set_seq=seq, now=now))
            ),
        )
        if self.lock.holder is not None:
            self._arbiter.seize(group_id, self.lock.holder)
        self.lock.start_claim(self.lock.holder)
        self._refresh_state()

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        gid = self.group_id
        self._tasks.append(tasks.spawn(self._worker.run(), name=f"group:{gid}:worker"))
        if self.lock.recovering:
            self._tasks.append(tasks.spawn(self._recover(), name=f"group:{gid}:recover"))
            self._tasks.append(tasks.spawn(self._expire(), name=f"group:{gid}:expire"))
        # A holder restored from disk has its lease (from now) to re-open its Hold stream.
        self._sync_leases()

    async def stop(self, *, grace_s: float) -> None:
        """Refuse new work, let a switch in flight finish within the grace, fail waiters."""
        self._stopping = True
        self._wake.cancel()
        self._arbiter.leave(self.group_id)
        self._sets.leave(self.group_id)
        if self.services.holders.get(self.group_id) == self._holder:
            del self.services.holders[self.group_id]
        await self._switches.finish(grace_s=grace_s)
        self.release_deferred()
        self.events.release()
        # Let the worker persist what the switch reported.
        flushed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.post(lambda now: [lambda: inbox.resolve(flushed, None)])
        await asyncio.wait({flushed}, timeout=max(grace_s, 0.5))
        live = [t for t in [*self._tasks, self._switches.task] if t is not None]
        await tasks.cancel_all(live)
        # The worker is gone: what is left is failed here.
        self._leases.stop(_shutting_down())
        # Queue entries stay persisted: after a restart the jobs re-attach and keep their place.
        self._callers.fail_all(_shutting_down)

    # ---- idle collection (local mode) ------------------------------------------------------

    def idle_since(self) -> tuple[int, float] | None:
        """``(activity, since)`` if nobody holds, waits for or switches the group and no
        Hold stream is open (residents are the agents' to tell), else ``None``."""
        lk = self.lock
        busy = (
            self._stopping
            or lk.recovering
            or lk.holder is not None
            or lk.switching is not None
            or bool(lk.waiting_jobs)
            or self._callers.busy
            or self._leases.open_streams > 0
            # An administrator's mark outlives idleness (it is in the group's rows).
            or lk.draining
        )
        return None if busy else (self._worker.activity, self._worker.active_at)

    async def retire(self, activity: int) -> bool:
        """Collect the group if it is still idle and nothing happened to it since
        ``activity`` (the caller read the agents meanwhile): it stops taking calls and its
        rows are deleted at once, before any other group of the same id can save."""

        def decide(now: float) -> bool:
            # This command counts as one activity itself (see _worker).
            if self._worker.activity != activity + 1 or self.idle_since() is None:
                return False
            self._db.forget(self.group_id)
            self._stopping = self.retired = True
            return True

        if self._stopping:
            return False
        return await self._worker.ask(decide)

    def _gone(self) -> refusals.Refused:
        if self.retired:
            return refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"group {self.group_id!r} was just collected as idle; retry (a new "
                "Acquire creates it again)",
            )
        return _shutting_down()

    # ---- RPC entry points ------------------------------------------------------------------

    async def acquire(
        self,
        job: str,
        *,
        footprint_bytes: int,
        lease_ms: int = 0,
        time_left: float | None = None,
        set_seq: int | None = None,
    ) -> callers.Grant:
        """The grant; ``time_left`` is the caller's deadline (None: it has none);
        ``set_seq``: this is one group of that set (see sets), granted with the others."""
        if self._stopping:
            raise self._gone()
        started = time.monotonic()
        if footprint_bytes > 0:
            await callers.check_fits(
                self._pool,
                self.nodes,
                group_id=self.group_id,
                job=job,
                footprint_bytes=footprint_bytes,
                status_timeout_s=self._cfg.status_timeout_s,
            )
        waiter = callers.Waiter.new(job, set_seq)

        def apply(now: float) -> list[Effect]:
            self._callers.add(waiter)
            effects = self.bind(
                self.lock.on_acquire(
                    job,
                    footprint_bytes=footprint_bytes,
                    lease_ms=lease_ms,
                    set_seq=set_seq,
                    now=now,
                )
            )
            return [*effects, self._prefetch]

        def depart() -> None:
            self.post(lambda now: self._depart(waiter, now))

        self.post(apply)
        try:
            grant = await callers.granted(
                waiter,
                time_left,
                group_id=self.group_id,
                held_back_by=self._held_back_by,
                depart=depart,
            )
        except asyncio.CancelledError:
            if not self._stopping:
                depart()
            raise
        self._acquire_wait.observe(time.monotonic() - started)
        return grant

    def _held_back_by(self) -> str:
        """What keeps the group from granting and what to do, when it is a fault or a
        drain ("" = neither: it is busy)."""
        if self.lock.draining:
            return callers.drained(self.group_id)
        state, detail = self._reported_state()
        if state == "UNKNOWN" or (state == "SWITCHING" and self.health.switch_detail):
            return callers.faulted(self.group_id, detail)
        return ""

    async def yield_(self, job: str) -> decisions.YieldOutcome:
        if self._stopping:
            raise self._gone()
        reply = self._callers.reply()

        def apply(now: float) -> list[Effect]:
            was_holder = self.lock.holder == job
            out = self.lock.on_yield(job, now=now)
            effects = self.bind(out.actions)
            if out.ok and was_holder:
                if out.snapshot_deferred:
                    effects.append(self._deferred_snapshots.inc)
                effects.append(self._leases.released(job))
            effects.append(lambda: inbox.resolve(reply, out))
            return effects

        self.post(apply)
        # The yield is applied even if the caller goes away: shield the reply.
        return await asyncio.shield(reply)

    def lost_grant(self, job: str, epoch: int) -> str | None:
        """Why ``job`` no longer holds this group under grant ``epoch`` (None: it does)."""
        lk = self.lock
        if lk.holder == job and lk.grant_epoch == epoch:
            return None
        return lk.eviction(job) or (
            f"its grant {epoch} of group {self.group_id!r} ended meanwhile (yielded, or its "
            f"lease lapsed); {lk.holder or 'nobody'} holds it now"
        )

    async def give_back(self, job: str, epoch: int, why: str) -> None:
        """``job``'s AcquireSet got grant ``epoch`` here but did not complete: its part of
        the grant is undelivered. The group is released only if no other call of the job
        was answered with that grant (see lock.on_undelivered)."""
        await self._decide(
            lambda now: (
                None,
                self.bind(self.lock.on_undelivered(job, epoch=epoch, now=now, why=why)),
            )
        )

    def answered(self, job: str, epoch: int) -> None:
        """``job``'s AcquireSet is answered with grant ``epoch`` of this group: the grant
        is claimed from now (and a lease starts), see lock.on_set_answered."""
        self.post(inbox.change(lambda: self.lock.on_set_answered(job, epoch=epoch)))

    async def open_hold(self, job: str, *, epoch: int) -> leases.HoldSession:
        """Register a Hold stream of ``job`` (``epoch`` 0 = the current grant).

        Refused (FAILED_PRECONDITION) unless ``job`` holds the group under that grant.
        """
        if self._stopping:
            raise _shutting_down()
        return await self._worker.ask(lambda now: self._leases.open(self.lock, job, epoch))

    def close_hold(self, session: leases.HoldSession) -> None:
        """The Hold stream ended: if it was the last one, the lease timer starts."""
        if not self._stopping:
            self.post(inbox.change(lambda: self._leases.close(session)))

    async def describe(self) -> opb.GetGroupStatusResponse:
        """Group status plus a live Status read of every node (short deadline)."""
        before = status.marker(self.lock)
        reads = await steps.read_all(
            self._pool, self.nodes, self.group_id, timeout_s=self._cfg.status_timeout_s
        )

        def described(now: float) -> opb.GetGroupStatusResponse:
            self.health.note(reads)
            loaded = status.observed_resident(
                self.lock, reads, nodes=len(self.nodes), before=before
            )
            self._refresh_state()
            known = status.known_jobs(self.lock)
            return opb.GetGroupStatusResponse(
                group=self._group_status(loaded),
                agent_job_states=status.agent_job_states(
                    reads, group_id=self.group_id, known=known
                ),
            )

        return await self._worker.ask(described)

    async def clear_degraded(self, node: str = "") -> list[str]:
        """An operator fixed the cause: the node(s) take switches again."""

        def clear(now: float) -> tuple[list[str], list[Effect]]:
            degraded = self.health.degraded
            cleared = sorted(n for n in degraded if not node or n == node)
            for n in cleared:
                del degraded[n]
            if cleared:
                log.warning(
                    "group %s: degraded node(s) %s cleared by an operator",
                    self.group_id,
                    ", ".join(cleared),
                    extra={"group_id": self.group_id},
                )
            return cleared, [] if degraded else self.bind(self.lock.on_unblocked(now=now))

        return await self._decide(clear)

    async def evict(
        self, job: str, reason: str = "", *, by: str = BY_ADMIN
    ) -> decisions.EvictOutcome:
        """``by`` (an administrator) takes ``job`` out of the group now (``reason``: their words).

        A holder loses the lock as a lapsed lease does: the next waiter is granted
        through the normal switch, its Hold streams end with the reason, its later
        Yield is refused naming it. A waiter's pending Acquires fail ABORTED with the
        reason. ``role`` None: the job neither held nor waited (nothing changed).
        """
        why = eviction_message(self.group_id, reason, by)

        def evict(now: float) -> tuple[decisions.EvictOutcome, list[Effect]]:
            deferred = self.lock.attached_waiters == 0
            out = self.lock.on_evict(job, why=why, now=now)
            if out.role is None:
                return out, []
            log.warning(
                "group %s: job %s (%s) %s",
                self.group_id,
                job,
                out.role.value,
                why,
                extra={"group_id": self.group_id, "job_id": job},
            )
            effects = self.bind(out.actions)
            if out.role is decisions.Role.HOLDER:
                effects.append(self._leases.released(job, lost=why))
                if deferred and self.lock.switching is None:
                    effects.append(self._deferred_snapshots.inc)
            return out, effects

        return await self._decide(evict)

    async def drain(self, drain: bool) -> opb.DrainResponse:
        """Drain (no new turn is granted; the holder keeps its own) or resume the group.
        The mark is persisted with the group's state."""

        def mark(now: float) -> tuple[opb.DrainResponse, list[Effect]]:
            lk = self.lock
            was = lk.draining
            effects = self.bind(lk.on_drain(drain, now=now))
            if was != drain:
                log.warning(
                    "group %s %s by an administrator",
                    self.group_id,
                    "drained: no new turn is granted" if drain else "resumed",
                    extra={"group_id": self.group_id},
                )
            reply = opb.DrainResponse(
                draining=drain,
                was_draining=was,
                locking_job=lk.holder or "",
                switching=lk.switching is not None,
                waiter_queue_depth=len(lk.waiting_jobs),
            )
            return reply, effects

        return await self._decide(mark)

    async def _decide(self, decide: Callable[[float], tuple[_T, list[Effect]]]) -> _T:
        """Run ``decide`` in the worker; its answer once its effects ran (after persisting)."""
        if self._stopping:
            raise self._gone()
        done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()

        def command(now: float) -> list[Effect]:
            answer, effects = decide(now)
            return [*effects, lambda: inbox.resolve(done, answer)]

        self.post(command)
        # Applied even if the caller goes away: shield the answer.
        return await asyncio.shield(done)

    # ---- commands and their effects ------------------------------------------------------

    def post(self, command: inbox.Command) -> None:
        self._worker.post(command)

    def release_deferred(self) -> None:
        """Run the effects held back until the switch's first calls were sent."""
        self._worker.release_deferred()

    def _depart(self, waiter: callers.Waiter, now: float) -> list[Effect]:
        if waiter.granted_epoch is not None:
            return self.bind(
                self.lock.on_undelivered(waiter.job, epoch=waiter.granted_epoch, now=now)
            )
        if not self._callers.withdraw(waiter):
            return []  # already failed (aborted) elsewhere
        return self.bind(self.lock.on_cancel(waiter.job, now=now))

    def bind(self, actions: list[decisions.Action]) -> list[Effect]:
        """Bookkeeping now (who got the grant), side effects after persisting.

        Resolving a grant's Acquires and starting a switch are urgent (see _worker);
        events keep their order among the other effects.
        """
        effects: list[Effect] = []
        for action in actions:
            if isinstance(action, decisions.Granted):
                receivers = self._callers.granted(action.job, action.epoch)
                parts = 0 if action.held else sum(w.set_seq is not None for w in receivers)
                if parts:
                    self.lock.on_granted_to_set_parts(
                        action.job, epoch=action.epoch, parts=parts, now=time.monotonic()
                    )
                announce = functools.partial(self.events.granted, action)
                effects += [callers.resolve_effect(action, receivers), announce, self._prefetch]
            elif isinstance(action, decisions.Abort):
                effects.append(callers.abort_effect(action, self._callers.take(action.job)))
            elif isinstance(action, decisions.StartSwitch):
                effects.append(self._switch_effect(action))
            elif isinstance(action, decisions.NeedClaim):
                effects += self._claim(action)
            elif isinstance(action, decisions.NeedSet):
                effects += self._kept_for_set(action)
            elif isinstance(action, decisions.NotReady):
                self._sets.withdraw(self.group_id)
            elif isinstance(action, decisions.ReleaseClaim):
                # Another group may now move what is on the shared devices: re-read first.
                self.views.clear()
                self._arbiter.release(self.group_id)
            else:
                effects.append(functools.partial(self.events.decided, action))
        return effects

    def _prefetch(self) -> None:
        """Effect: start bringing the next waiter in beside the holder (see prefetching),
        once per waiter and grant."""
        lk = self.lock
        candidate = prefetching.next_to_prefetch(
            lk, switching=lk.switching is not None, now=time.monotonic()
        )
        if candidate is None or candidate == self._prefetched or self._stopping:
            return
        self._prefetched = candidate
        self._tasks.append(
            tasks.spawn(
                prefetching.prefetch_everywhere(self._pool, self.nodes, self.group_id, candidate),
                name=f"group:{self.group_id}:prefetch:{candidate.job}",
            )
        )
        # (Finished prefetches are dropped: one is started per waiter and grant.)
        self._tasks = [t for t in self._tasks if not t.done()]

    def _holder(self) -> str | None:
        return self.lock.holder

    def _kept_for_set(self, need: decisions.NeedSet) -> list[Effect]:
        """The group is kept for a set member: report it ready (the set's grant comes
        through the inbox, on_set_ready, for every group alike), unless a waiter that
        holds another group is behind it: that one goes first, since it would otherwise
        wait for the set, which may wait for what it holds (see sets.passer)."""
        passing = None
        if need.others:  # (the holders are read only when someone could pass)
            holders = {gid: read() for gid, read in self.services.holders.items()}
            passing = self._sets.passer(self.group_id, need.set_seq, need.others, holders)
        if passing is None:
            self._sets.ready(self.group_id, need.job, need.set_seq)
            return []
        self._sets.withdraw(self.group_id)
        log.info(
            "group %s: job %s, which holds another group, goes before job %s's set",
            self.group_id,
            passing,
            need.job,
            extra={"group_id": self.group_id, "job_id": passing},
        )
        return self.bind(self.lock.on_set_passed(passing, now=time.monotonic()))

    def _claim(self, need: decisions.NeedClaim) -> list[Effect]:
        """Ask for the device claim (see overlap); wait for it if it is not free."""
        granted = self._arbiter.request(self.group_id, need.job, need.others)
        if granted is None:
            self.views.clear()
            self.lock.on_claim_waiting()
            return []
        shared = bool(self._arbiter.conflicts(self.group_id))
        return self.bind(self.lock.on_claim_granted(granted, now=time.monotonic(), shared=shared))

    def _switch_effect(self, s: decisions.StartSwitch) -> Effect:
        def effect() -> None:
            if self._stopping:
                # The intent is on disk: recovery rolls it back (nothing moved) at restart.
                return
            self._worker.hold_back()
            self._switches.start(s)

        return inbox.Urgent(effect)

    # ---- recovery, leases, state ----------------------------------------------------------

    async def _recover(self) -> None:
        views = await recovery.read_until_all_answer(
            group=self.group_id,
            nodes=self.nodes,
            pool=self._pool,
            backoff=self._backoff,
            note=lambda reads: self.post(inbox.change(lambda: self.health.note(reads))),
        )
        self.post(lambda now: self._recovered(views, now))

    def _recovered(self, views: dict[str, steps.NodeView], now: float) -> list[Effect]:
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
        return self.bind(
            lk.on_recovered(
                resident=decision.resident,
                verified=decision.verified,
                rollback=decision.rollback,
                now=now,
            )
        )

    async def _expire(self) -> None:
        for deadline in self.lock.expiry_deadlines():
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            self.post(lambda now: self.bind(self.lock.on_expire(now=now)))

    def _settled(self) -> None:
        self._sync_leases()
        self._refresh_state()
        self._wake.arm(None if self._stopping else self.lock.wake_at)

    def _sync_leases(self) -> None:
        self._leases.sync(self.lock, self.post, self._lease_expired)

    def _lease_expired(self, job: str, epoch: int, lease_ms: int) -> inbox.Command:
        def expired(now: float) -> list[Effect]:
            if self._leases.covers(job, epoch):
                return []  # a Hold stream arrived meanwhile
            deferred = self.lock.attached_waiters == 0
            actions = self.lock.on_lease_expired(job, epoch=epoch, now=now)
            if not actions:
                return []
            log.warning(
                "group %s: job %s kept no Hold stream open for its lease (%d ms); lock released",
                self.group_id,
                job,
                lease_ms,
                extra={"group_id": self.group_id, "job_id": job, "grant_epoch": epoch},
            )
            effects = self.bind(actions)
            if deferred:
                effects.append(self._deferred_snapshots.inc)
            return effects

        return expired

    def _reported_state(self) -> tuple[str, str]:
        return status.reported_state(
            self.lock,
            self.health,
            self._conflicts,
            self._kept_for,
            unsaved=self.services.store_health.problem,
        )

    def _kept_for(self, job: str, seq: int) -> str:
        busy = next((sorted(g - r) for s, j, g, r in self._sets.waiting() if s == seq), [])
        return (
            f"kept free for job {job!r}, whose AcquireSet is granted once all its groups "
            f"are free (still waiting for: {', '.join(busy) or 'nothing'})"
        )

    def _conflicts(self) -> frozenset[str]:
        return self._arbiter.conflicts(self.group_id)

    def _refresh_state(self) -> None:
        lk = self.lock
        reserved = lk.reserved_for is not None
        self._reporter.refresh(self._reported_state()[0], len(lk.waiting_jobs), reserved=reserved)

    def _group_status(self, loaded_job: str | None) -> opb.GroupStatus:
        return status.group_status(
            group_id=self.group_id,
            nodes=self.nodes,
            lk=self.lock,
            health=self.health,
            state=self._reported_state(),
            timestamp=self._reporter.timestamp,
            loaded_job=loaded_job,
        )


async def evict_everywhere(
    drivers: Iterable[GroupDriver], job: str, reason: str = "", *, by: str = BY_ADMIN
) -> list[tuple[str, decisions.EvictOutcome]]:
    """Take ``job`` out of every group where it holds or waits (an administrator's
    Evict without a group, or a job whose processes are all gone): ``(group_id,
    outcome)`` per group it was in. Groups that are stopping are skipped."""
    live = [d for d in drivers if not d.stopping]
    outcomes = await asyncio.gather(*(d.evict(job, reason, by=by) for d in live))
    return [
        (d.group_id, out) for d, out in zip(live, outcomes, strict=True) if out.role is not None
    ]
