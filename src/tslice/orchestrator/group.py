"""The per-group driver: one worker task that owns a :class:`lock.GroupLock`.

Every change to a group goes through the worker's inbox, so a group's events are
serialised while groups run in parallel (a stuck agent of one group never blocks
another). The worker handles a batch of commands in two phases:

1. *apply*: mutate the pure lock and do the bookkeeping that must be exact at
   that instant (which Acquire RPCs a grant went to, which one departed);
2. *persist*, then *effect*: write the new state in one SQLite transaction and
   only then reply to RPCs, publish events and start switches ("write before act").

Switches run in their own task and post their outcome back to the inbox, so
Acquire, Yield and cancellations keep flowing during a long switch. Waiters wait
on futures resolved by the worker: no polling anywhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from google.protobuf import timestamp_pb2

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import refusals, tasks
from tslice.orchestrator import agents, config, events, lock, metrics, overlap, steps, store, switch

log = logging.getLogger(__name__)

Kind = opb.OrchestratorEvent

_STATE_PB = {
    "UNKNOWN": opb.GroupStatus.STATE_UNKNOWN,
    "IDLE": opb.GroupStatus.STATE_IDLE,
    "IDLE_YIELDED": opb.GroupStatus.STATE_IDLE_YIELDED,
    "LOCKED": opb.GroupStatus.STATE_LOCKED,
    "SWITCHING": opb.GroupStatus.STATE_SWITCHING,
}

_T = TypeVar("_T")

#: How long a group's events may be held back while a switch gets going (see _hold_events).
EVENT_HOLD_S = 0.005


def _resolve(future: asyncio.Future[_T], value: _T) -> None:
    if not future.done():
        future.set_result(value)


_JOB_STATE_PB = {
    pb.JOB_STATE_UNSPECIFIED: opb.SnapshotAgentJobState.STATE_UNSPECIFIED,
    pb.JOB_STATE_IDLE: opb.SnapshotAgentJobState.STATE_IDLE,
    pb.JOB_STATE_RUNNING: opb.SnapshotAgentJobState.STATE_RUNNING,
    pb.JOB_STATE_TRANSITIONING: opb.SnapshotAgentJobState.STATE_TRANSITIONING,
    pb.JOB_STATE_SAVED: opb.SnapshotAgentJobState.STATE_SAVED,
    pb.JOB_STATE_FAULTED: opb.SnapshotAgentJobState.STATE_FAULTED,
}


def _shutting_down() -> refusals.Refused:
    return refusals.Refused(refusals.Code.UNAVAILABLE, "orchestrator shutting down; retry")


@dataclasses.dataclass(eq=False)
class HoldSession:
    """One open Hold stream of the holder: while any is open, its lease cannot expire."""

    job: str
    epoch: int
    lease_ms: int
    #: Resolved when the stream must end: "" = the job yielded, else why the lock was lost.
    ended: asyncio.Future[str]


@dataclasses.dataclass(frozen=True)
class Grant:
    epoch: int
    restored: bool


@dataclasses.dataclass(eq=False)
class _Waiter:
    job: str
    future: asyncio.Future[Grant]
    granted_epoch: int | None = None


Effect = Callable[[], None]


class _Urgent:
    """An effect on the hand-over path (resolve an Acquire, start a switch): it runs first."""

    def __init__(self, fn: Effect) -> None:
        self._fn = fn

    def __call__(self) -> None:
        self._fn()


@dataclasses.dataclass(frozen=True)
class RecoveryDecision:
    resident: str | None
    verified: bool
    rollback: bool
    reason: str


def decide_recovery(
    *,
    group: str,
    resident: str | None,
    intent: lock.StartSwitch | None,
    known_jobs: set[str],
    views: list[steps.NodeView],
) -> RecoveryDecision:
    """What the agents say after a restart (pure; see DESIGN "crash safety").

    With a switch in progress: roll back when nothing moved (the outgoing job still
    runs on every node, the incoming one nowhere, no operation in flight), else roll
    forward. Without: keep the resident if it runs everywhere; adopt the one job of
    the group that runs everywhere; otherwise leave it unverified so the next
    switch snapshots the extras first.
    """

    def ours(job: str, jv: steps.JobView) -> bool:
        return jv.group == group or job in known_jobs

    running = [
        {j for j, v in view.items() if ours(j, v) and v.state == pb.JOB_STATE_RUNNING}
        for view in views
    ]
    busy = any(
        ours(j, v) and v.state in (pb.JOB_STATE_TRANSITIONING, pb.JOB_STATE_FAULTED)
        for view in views
        for j, v in view.items()
    )
    if intent is not None:
        expected = {intent.from_job} if intent.from_job else set()
        if not busy and all(r == expected for r in running):
            return RecoveryDecision(intent.from_job, True, True, "nothing moved: rolled back")
        return RecoveryDecision(resident, False, False, "switch rolled forward")
    if resident is not None and not busy and all(r == {resident} for r in running):
        return RecoveryDecision(resident, True, False, "resident verified")
    everywhere = set.intersection(*running) if running else set()
    anywhere = set.union(*running) if running else set()
    if not busy and len(everywhere) == 1 and anywhere == everywhere:
        (job,) = everywhere
        return RecoveryDecision(job, True, False, f"adopted {job}, running on every node")
    if not busy and not anywhere:
        return RecoveryDecision(None, True, False, "nothing resident")
    return RecoveryDecision(
        resident, False, False, "agents disagree: extras evicted at next switch"
    )


def _grant_detail(g: lock.Granted) -> str:
    if g.held:
        return "already held"
    if g.zero_cost:
        return "zero-cost"
    return "restored" if g.restored else ""


class GroupDriver:
    """Runs one group: lock, persistence, switches, recovery and status."""

    def __init__(
        self,
        *,
        group_id: str,
        nodes: tuple[config.NodeRef, ...],
        cfg: config.OrchestratorConfig,
        db: store.Store,
        pool: agents.AgentPool,
        bus: events.EventBus,
        metrics: metrics.OrchestratorMetrics,
        record: lock.LockRecord | None = None,
        arbiter: overlap.DeviceArbiter | None = None,
    ) -> None:
        self.group_id = group_id
        self.nodes = nodes
        self._cfg = cfg
        self._db = db
        self._pool = pool
        self._bus = bus
        self._metrics = metrics
        now = time.monotonic()
        if record is None:
            self.lock = lock.GroupLock(reattach_grace_s=cfg.reattach_grace_s)
            self._saved: lock.LockRecord | None = None
        else:
            self.lock = lock.GroupLock.from_record(
                record, now=now, reattach_grace_s=cfg.reattach_grace_s
            )
            self._saved = record
        self._backoff = switch.Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._inbox: asyncio.Queue[Callable[[float], list[Effect]]] = asyncio.Queue()
        self._waiters: dict[str, list[_Waiter]] = {}
        self._replies: set[asyncio.Future[lock.YieldOutcome]] = set()
        self._views: dict[str, steps.NodeView] = {}
        self._unreachable: dict[str, str] = {}
        #: Nodes that kept refusing a switch (node -> reason), until an operator clears them.
        self._degraded: dict[str, str] = {}
        self._switch_detail = ""
        self._tasks: list[asyncio.Task[Any]] = []
        self._switch_task: asyncio.Task[None] | None = None
        #: Effects held back until a starting switch has sent its first calls (see _worker).
        self._deferred: list[Effect] | None = None
        #: Events held back while a switch gets going (see _hold_events); None: not holding.
        self._held: list[opb.OrchestratorEvent] | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        #: Open Hold streams of the holder, and the lease timer that runs while none is open.
        self._holds: set[HoldSession] = set()
        self._holds_reported = 0
        self._lease_timer: asyncio.TimerHandle | None = None
        self._lease_key: tuple[str, int] | None = None
        self._stopping = False
        self._state = ""
        self._queue_depth = -1
        # Labelled children, looked up once (labels() costs more than observe()).
        self._durations: dict[tuple[str, str], Any] = {}
        gid = self.group_id
        self._acquire_wait = self._metrics.acquire_wait.labels(group_id=gid)
        self._switches_completed = self._metrics.switches.labels(group_id=gid, outcome="completed")
        self._switch_duration = self._metrics.switch_duration.labels(group_id=gid)
        self._queue_depth_series = self._metrics.queue_depth.labels(group_id=gid)
        self._state_ts = timestamp_pb2.Timestamp()
        # Groups that share devices take turns through the device claim (see overlap).
        self._arbiter = arbiter if arbiter is not None else overlap.DeviceArbiter()
        self._arbiter.join(
            group_id,
            nodes,
            granted=lambda job: self._post(
                lambda now: self._bind(self.lock.on_claim_granted(job, now=now))
            ),
            contended=lambda: self._post(lambda now: self._bind(self.lock.on_contended(now=now))),
        )
        if self.lock.holder is not None:
            self._arbiter.seize(group_id, self.lock.holder)
            self.lock.keep_claim(self.lock.holder)
        else:
            self.lock.drop_claim()
        self._refresh_state()

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks.append(tasks.spawn(self._worker(), name=f"group:{self.group_id}:worker"))
        if self.lock.recovering:
            self._tasks.append(tasks.spawn(self._recover(), name=f"group:{self.group_id}:recover"))
            self._tasks.append(tasks.spawn(self._expire(), name=f"group:{self.group_id}:expire"))
        # A holder restored from disk has its lease (from now) to re-open its Hold stream.
        self._sync_leases()

    async def stop(self, *, grace_s: float) -> None:
        """Refuse new work, let a switch in flight finish within the grace, fail waiters."""
        self._stopping = True
        self._arbiter.leave(self.group_id)
        sw = self._switch_task
        if sw is not None and not sw.done():
            await asyncio.wait({sw}, timeout=grace_s)
        self._release_deferred()
        self._release_events()
        # Let the worker persist what the switch reported.
        flushed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait(lambda now: [lambda: _resolve(flushed, None)])
        await asyncio.wait({flushed}, timeout=max(grace_s, 0.5))
        live = [t for t in [*self._tasks, self._switch_task] if t is not None]
        await tasks.cancel_all(live)
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        for session in self._holds:
            if not session.ended.done():
                session.ended.set_exception(_shutting_down())
        self._holds.clear()
        # Queue entries stay persisted: after a restart the jobs re-attach and keep their place.
        for waiters in self._waiters.values():
            for w in waiters:
                if not w.future.done():
                    w.future.set_exception(_shutting_down())
        self._waiters.clear()
        for reply in list(self._replies):
            if not reply.done():
                reply.set_exception(_shutting_down())

    # ---- RPC entry points ------------------------------------------------------------------

    async def acquire(self, job: str, *, footprint_bytes: int, lease_ms: int = 0) -> Grant:
        if self._stopping:
            raise _shutting_down()
        started = time.monotonic()
        waiter = _Waiter(job, asyncio.get_running_loop().create_future())

        def apply(now: float) -> list[Effect]:
            self._waiters.setdefault(job, []).append(waiter)
            return self._bind(
                self.lock.on_acquire(
                    job, footprint_bytes=footprint_bytes, lease_ms=lease_ms, now=now
                )
            )

        self._inbox.put_nowait(apply)
        try:
            grant = await waiter.future
        except asyncio.CancelledError:
            if not self._stopping:
                self._inbox.put_nowait(lambda now: self._depart(waiter, now))
            raise
        self._acquire_wait.observe(time.monotonic() - started)
        return grant

    async def yield_(self, job: str) -> lock.YieldOutcome:
        if self._stopping:
            raise _shutting_down()
        reply: asyncio.Future[lock.YieldOutcome] = asyncio.get_running_loop().create_future()
        self._replies.add(reply)
        reply.add_done_callback(self._replies.discard)

        def apply(now: float) -> list[Effect]:
            was_holder = self.lock.holder == job
            out = self.lock.on_yield(job, now=now)
            effects = self._bind(out.actions)
            if out.ok and was_holder and out.snapshot_deferred:
                effects.append(
                    lambda: self._metrics.deferred_snapshots.labels(group_id=self.group_id).inc()
                )
            if out.ok and was_holder:
                released = [h for h in self._holds if h.job == job]
                self._holds.difference_update(released)

                def end_holds() -> None:
                    for h in released:
                        _resolve(h.ended, "")

                effects.append(end_holds)
            effects.append(lambda: _resolve(reply, out))
            return effects

        self._inbox.put_nowait(apply)
        # The yield is applied even if the caller goes away: shield the reply.
        return await asyncio.shield(reply)

    async def open_hold(self, job: str, *, epoch: int) -> HoldSession:
        """Register a Hold stream of ``job`` (``epoch`` 0 = the current grant).

        Refused (FAILED_PRECONDITION) unless ``job`` holds the group under that grant.
        """
        if self._stopping:
            raise _shutting_down()
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[HoldSession] = loop.create_future()

        def apply(now: float) -> list[Effect]:
            lk = self.lock
            if lk.holder != job or lk.switching is not None:
                why = (
                    "its Acquire has not returned yet"
                    if lk.holder == job
                    else f"the holder is {lk.holder!r}"
                    if lk.holder
                    else "nobody holds it"
                )
                opened.set_exception(
                    refusals.Refused(
                        refusals.Code.FAILED_PRECONDITION,
                        f"job {job!r} does not hold group {self.group_id!r} ({why}); "
                        "Acquire it first",
                    )
                )
                return []
            if epoch and epoch != lk.grant_epoch:
                opened.set_exception(
                    refusals.Refused(
                        refusals.Code.FAILED_PRECONDITION,
                        f"job {job!r} does not hold group {self.group_id!r} under grant "
                        f"{epoch} (the current grant is {lk.grant_epoch}); Acquire it again",
                    )
                )
                return []
            session = HoldSession(job, lk.grant_epoch, lk.holder_lease_ms, loop.create_future())
            self._holds.add(session)
            self._metrics.hold_streams_opened.labels(group_id=self.group_id).inc()
            opened.set_result(session)
            return []

        self._post(apply)
        return await opened

    def close_hold(self, session: HoldSession) -> None:
        """The Hold stream ended: if it was the last one, the lease timer starts."""

        def apply(now: float) -> list[Effect]:
            self._holds.discard(session)
            return []

        if not self._stopping:
            self._post(apply)

    async def describe(self) -> opb.GetGroupStatusResponse:
        """Group status plus a live Status read of every node (short deadline)."""
        # What the reads are compared with; if a switch or a grant happens meanwhile,
        # the reads say nothing about the new resident.
        before = (self.lock.grant_epoch, self.lock.switch_count, self.lock.switching)
        results = await asyncio.gather(
            *(
                self._pool.get(n.address).status(timeout_s=self._cfg.status_timeout_s)
                for n in self.nodes
            ),
            return_exceptions=True,
        )
        agent_states: list[opb.SnapshotAgentJobState] = []
        views: list[steps.NodeView] = []
        known = self._known_jobs()
        for node, res in zip(self.nodes, results, strict=True):
            if isinstance(res, agents.AgentError):
                self._unreachable[node.name] = str(res)
                continue
            if isinstance(res, BaseException):
                raise res
            self._unreachable.pop(node.name, None)
            view = steps.view_from_status(res, self.group_id)
            views.append(view)
            for job, jv in sorted(view.items()):
                if jv.group == self.group_id or job in known:
                    agent_states.append(
                        opb.SnapshotAgentJobState(
                            agent=node.name,
                            job_state=_JOB_STATE_PB.get(
                                jv.state, opb.SnapshotAgentJobState.STATE_UNSPECIFIED
                            ),
                            job_id=job,
                        )
                    )
        loaded = self.lock.loaded_job
        unchanged = before == (self.lock.grant_epoch, self.lock.switch_count, self.lock.switching)
        if len(views) == len(self.nodes) and self.lock.switching is None and unchanged:
            resident = self.lock.resident
            everywhere = resident is not None and all(
                v.get(resident) is not None and v[resident].state == pb.JOB_STATE_RUNNING
                for v in views
            )
            if everywhere != self.lock.verified:
                epoch = self.lock.grant_epoch

                def observed(now: float) -> list[Effect]:
                    self.lock.on_observed(
                        epoch=epoch, resident=resident, running_everywhere=everywhere
                    )
                    return []

                self._post(observed)
            loaded = resident if everywhere else None
        elif len(views) != len(self.nodes):
            loaded = None
        self._refresh_state()
        return opb.GetGroupStatusResponse(
            group=self.status(loaded_job=loaded), agent_job_states=agent_states
        )

    def status(self, *, loaded_job: str | None = None) -> opb.GroupStatus:
        state, detail = self._reported_state()
        lk = self.lock
        return opb.GroupStatus(
            group_id=self.group_id,
            group_state=_STATE_PB[state],
            state_timestamp=self._state_ts,
            locking_job=lk.holder or "",
            active_job=lk.active_job or "",
            waiter_queue_depth=len(lk.waiting_jobs),
            loaded_job=loaded_job or "",
            waiting_jobs=lk.waiting_jobs,
            nodes=[n.name for n in self.nodes],
            grant_epoch=lk.grant_epoch,
            switch_count=lk.switch_count,
            detail=detail,
            degraded=[
                opb.DegradedNode(node=n, reason=r) for n, r in sorted(self._degraded.items())
            ],
        )

    # ---- worker ----------------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            batch = [await self._inbox.get()]
            while not self._inbox.empty():
                batch.append(self._inbox.get_nowait())
            now = time.monotonic()
            effects: list[Effect] = []
            for apply in batch:
                try:
                    effects += apply(now)
                except Exception:
                    log.exception("group %s: command failed", self.group_id)
                # Overlapping groups see who holds this one at once (see overlap).
                self._arbiter.note_holder(self.group_id, self.lock.holder)
            await self._persist()
            # Urgent effects first. While a switch they started has not sent its first
            # agent calls, the others (Yield replies, event deliveries) wait, so that
            # the calls leave before them: every Acquire waits on those calls.
            self._run_effects([e for e in effects if isinstance(e, _Urgent)])
            others = [e for e in effects if not isinstance(e, _Urgent)]
            if self._deferred is not None:
                self._deferred += others
            else:
                self._run_effects(others)
            self._sync_leases()
            self._refresh_state()

    def _run_effects(self, effects: list[Effect]) -> None:
        for effect in effects:
            try:
                effect()
            except Exception:
                log.exception("group %s: effect failed", self.group_id)

    def _release_deferred(self) -> None:
        deferred, self._deferred = self._deferred, None
        if deferred:
            self._run_effects(deferred)

    async def _persist(self) -> None:
        record = self.lock.record()
        if record == self._saved:
            return
        attempt = 0
        nodes = [(n.name, n.address) for n in self.nodes]
        while True:
            try:
                await self._db.save(self.group_id, nodes=nodes, record=record, previous=self._saved)
                break
            except store.StoreError as err:
                # Nothing may act on state that is not on disk: hold this group until it is.
                delay = self._backoff.delay(attempt)
                attempt += 1
                log.error("group %s: %s; retrying in %.2f s", self.group_id, err, delay)
                await asyncio.sleep(delay)
        self._saved = record

    def _post(self, apply: Callable[[float], list[Effect]]) -> None:
        self._inbox.put_nowait(apply)

    def _depart(self, waiter: _Waiter, now: float) -> list[Effect]:
        if waiter.granted_epoch is not None:
            return self._bind(
                self.lock.on_undelivered(waiter.job, epoch=waiter.granted_epoch, now=now)
            )
        pending = self._waiters.get(waiter.job, [])
        if waiter not in pending:
            return []  # already failed (aborted) elsewhere
        pending.remove(waiter)
        return self._bind(self.lock.on_cancel(waiter.job, now=now))

    def _bind(self, actions: list[lock.Action]) -> list[Effect]:
        """Bookkeeping now (who got the grant), side effects after persisting.

        Resolving a grant's Acquires and starting a switch are urgent (see _worker);
        events keep their order among the other effects.
        """
        effects: list[Effect] = []
        for action in actions:
            if isinstance(action, lock.Granted):
                receivers = self._waiters.pop(action.job, [])
                for w in receivers:
                    w.granted_epoch = action.epoch
                effects += self._grant_effects(action, receivers)
            elif isinstance(action, lock.Abort):
                aborted = self._waiters.pop(action.job, [])
                effects.append(self._abort_effect(action, aborted))
            elif isinstance(action, lock.StartSwitch):
                effects.append(self._switch_effect(action))
            elif isinstance(action, lock.NeedClaim):
                effects += self._claim(action)
            elif isinstance(action, lock.ReleaseClaim):
                # Another group may now move what is on the shared devices: re-read first.
                self._views.clear()
                self._arbiter.release(self.group_id)
            else:
                effects.append(self._emit_effect(action))
        return effects

    def _claim(self, need: lock.NeedClaim) -> list[Effect]:
        """Ask for the device claim (see overlap); wait for it if it is not free."""
        granted = self._arbiter.request(self.group_id, need.job, need.others)
        if granted is None:
            self._views.clear()
            self.lock.on_claim_waiting()
            return []
        return self._bind(self.lock.on_claim_granted(granted, now=time.monotonic()))

    def _grant_effects(self, g: lock.Granted, receivers: list[_Waiter]) -> list[Effect]:
        def resolve() -> None:
            for w in receivers:
                if not w.future.done():
                    w.future.set_result(Grant(g.epoch, g.restored))

        def announce() -> None:
            self._publish(
                Kind.KIND_GRANTED,
                job_id=g.job,
                grant_epoch=g.epoch,
                duration_ms=int(g.waited_s * 1000),
                detail=_grant_detail(g),
            )

        return [_Urgent(resolve), announce]

    def _abort_effect(self, a: lock.Abort, waiters: list[_Waiter]) -> Effect:
        def effect() -> None:
            for w in waiters:
                if not w.future.done():
                    w.future.set_exception(refusals.Refused(a.code, a.message))

        return effect

    def _emit_effect(self, e: lock.Emit) -> Effect:
        kind = {
            lock.EventKind.QUEUED: Kind.KIND_QUEUED,
            lock.EventKind.YIELDED: Kind.KIND_YIELDED,
            lock.EventKind.CANCELLED: Kind.KIND_CANCELLED,
            lock.EventKind.ROLLED_BACK: Kind.KIND_SWITCH_FAILED,
        }[e.kind]
        return lambda: self._publish(kind, job_id=e.job, detail=e.detail)

    def _switch_effect(self, s: lock.StartSwitch) -> Effect:
        def effect() -> None:
            if self._stopping:
                # The intent is on disk: recovery rolls it back (nothing moved) at restart.
                return
            if self._deferred is None:
                self._deferred = []
            self._hold_events()
            self._switch_task = tasks.spawn(
                self._run_switch(s), name=f"group:{self.group_id}:switch:{s.epoch}"
            )

        return _Urgent(effect)

    # ---- switches --------------------------------------------------------------------------

    def _give_way(self) -> dict[str, frozenset[str]]:
        """Per node, the overlapping groups whose residents may give way to this switch.

        While this group holds the device claim, none of them has a holder.
        """
        by_node: dict[str, set[str]] = {}
        for other in self._arbiter.released(self.group_id):
            for node in self._arbiter.shared_nodes(self.group_id, other):
                by_node.setdefault(node, set()).add(other)
        return {node: frozenset(groups) for node, groups in by_node.items()}

    async def _run_switch(self, s: lock.StartSwitch) -> None:
        plan = steps.SwitchPlan(
            self.group_id,
            s.from_job,
            s.to_job,
            s.epoch,
            s.footprint_bytes,
            give_way=self._give_way(),
        )

        def announce() -> None:
            # Every node's first call is on its way: what waited for that may run now.
            self._release_deferred()
            self._publish(
                Kind.KIND_SWITCH_STARTED,
                job_id=s.to_job,
                from_job=s.from_job or "",
                grant_epoch=s.epoch,
                detail="recovered" if s.recovered else "",
            )

        started = time.monotonic()
        try:
            restored = await switch.run_switch(
                plan=plan,
                nodes=self.nodes,
                pool=self._pool,
                views=self._views,
                hooks=self,
                backoff=self._backoff,
                started=announce,
                max_refusals=self._cfg.max_refusals,
            )
        except asyncio.CancelledError:
            raise
        except switch.JobRefused as refused:
            code, why = refused.code, refused.detail
            self._switch_failed(s, f"refused: {why}")
            self._post(
                lambda now: self._bind(
                    self.lock.on_switch_refused(epoch=s.epoch, code=code, detail=why, now=now)
                )
            )
            return
        except switch.NodeDegraded as degraded:
            node, cause = degraded.node, degraded.reason
            self._switch_failed(s, str(degraded))
            self._degraded[node] = cause
            reason = (
                f"group {self.group_id}: node {node} is degraded ({cause}); fix the cause, "
                f"then clear it: tslice clear-degraded {self.group_id} --node {node}"
            )
            log.error("%s", reason, extra={"group_id": self.group_id})

            def degrade(now: float) -> list[Effect]:
                effects = self._bind(
                    self.lock.on_switch_failed(epoch=s.epoch, detail=cause, now=now)
                )
                return effects + self._bind(self.lock.on_blocked(reason))

            self._post(degrade)
            return
        except Exception as err:
            if not isinstance(err, switch.GiveUp):
                log.exception("group %s: switch to %s crashed", self.group_id, s.to_job)
            detail = str(err)
            self._switch_failed(s, f"abandoned (nobody waits any more): {detail}")
            self._post(
                lambda now: self._bind(
                    self.lock.on_switch_failed(epoch=s.epoch, detail=detail, now=now)
                )
            )
            return
        finally:
            self._release_deferred()  # in case the switch ended before its first calls
        elapsed = time.monotonic() - started
        log.info(
            "group %s: switch %s -> %s done in %.1f ms%s",
            self.group_id,
            s.from_job or "-",
            s.to_job,
            elapsed * 1000,
            " (restored)" if restored else "",
            extra={"group_id": self.group_id, "job_id": s.to_job, "grant_epoch": s.epoch},
        )
        self._switch_detail = ""
        self._switches_completed.inc()
        self._switch_duration.observe(elapsed)

        def announce_done() -> None:
            self._publish(
                Kind.KIND_SWITCH_DONE,
                job_id=s.to_job,
                from_job=s.from_job or "",
                grant_epoch=s.epoch,
                duration_ms=int(elapsed * 1000),
                detail="restored" if restored else "",
            )

        # The worker persists the grant and answers the Acquire (urgent), then publishes
        # SWITCH_DONE and GRANTED and lets the held events go, in that order.
        self._post(
            lambda now: [
                announce_done,
                *self._bind(self.lock.on_switch_done(epoch=s.epoch, restored=restored, now=now)),
                self._release_events,
            ]
        )

    def _switch_failed(self, s: lock.StartSwitch, detail: str) -> None:
        self._switch_detail = ""
        self._metrics.switches.labels(group_id=self.group_id, outcome="abandoned").inc()
        self._publish(
            Kind.KIND_SWITCH_FAILED,
            job_id=s.to_job,
            from_job=s.from_job or "",
            grant_epoch=s.epoch,
            detail=detail,
        )
        self._views.clear()
        self._release_events()

    async def clear_degraded(self, node: str = "") -> list[str]:
        """An operator fixed the cause: the node(s) take switches again."""
        cleared = sorted(n for n in self._degraded if not node or n == node)
        for n in cleared:
            del self._degraded[n]
        if cleared:
            log.warning(
                "group %s: degraded node(s) %s cleared by an operator",
                self.group_id,
                ", ".join(cleared),
                extra={"group_id": self.group_id},
            )
        if not self._degraded:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

            def unblock(now: float) -> list[Effect]:
                return [*self._bind(self.lock.on_unblocked(now=now)), lambda: _resolve(done, None)]

            self._post(unblock)
            await done
        return cleared

    # SwitchHooks
    def wants(self, kind: opb.OrchestratorEvent.Kind) -> bool:
        return self._bus.wants(self.group_id, kind)

    def publish(self, event: opb.OrchestratorEvent) -> None:
        if self._held is not None:
            self._held.append(event)
        else:
            self._bus.publish(event)

    def observe(self, node: str, operation: str, seconds: float) -> None:
        series = self._durations.get((node, operation))
        if series is None:
            series = self._metrics.agent_operation.labels(
                group_id=self.group_id, node=node, operation=operation
            )
            self._durations[(node, operation)] = series
        series.observe(seconds)

    def node_ok(self, node: str) -> None:
        if self._unreachable.pop(node, None) is not None:
            self._refresh_state()

    def node_failed(
        self, node: str, operation: str, detail: str, *, unreachable: bool, retry_in: float
    ) -> None:
        self._metrics.switch_step_failures.labels(
            group_id=self.group_id, node=node, operation=operation
        ).inc()
        self._switch_detail = f"{node}: {operation} failed: {detail}; retrying in {retry_in:.2f} s"
        sw = self.lock.switching
        self._publish(
            Kind.KIND_SWITCH_FAILED,
            job_id=sw.to_job if sw else "",
            from_job=(sw.from_job or "") if sw else "",
            node=node,
            grant_epoch=sw.epoch if sw else 0,
            detail=self._switch_detail,
        )
        log.warning("group %s: %s", self.group_id, self._switch_detail)
        if unreachable:
            self._unreachable[node] = detail
        else:
            self._unreachable.pop(node, None)
        self._refresh_state()

    def should_continue(self) -> bool:
        return not self._stopping and self.lock.wants_switch(now=time.monotonic())

    # ---- recovery --------------------------------------------------------------------------

    async def _recover(self) -> None:
        attempt = 0
        while True:
            results = await asyncio.gather(
                *(self._pool.get(n.address).status() for n in self.nodes), return_exceptions=True
            )
            views: dict[str, steps.NodeView] = {}
            for node, res in zip(self.nodes, results, strict=True):
                if isinstance(res, asyncio.CancelledError):
                    raise res
                if isinstance(res, BaseException):
                    if not isinstance(res, agents.AgentError):
                        log.error(
                            "group %s: reading %s failed", self.group_id, node.name, exc_info=res
                        )
                    self._unreachable[node.name] = str(res)
                else:
                    self._unreachable.pop(node.name, None)
                    views[node.name] = steps.view_from_status(res, self.group_id)
            self._refresh_state()
            if len(views) == len(self.nodes):
                break
            delay = self._backoff.delay(attempt)
            attempt += 1
            log.warning(
                "group %s: recovery waits for unreachable agents (%s); retrying in %.2f s",
                self.group_id,
                "; ".join(self._unreachable.values()),
                delay,
            )
            await asyncio.sleep(delay)
        decision = decide_recovery(
            group=self.group_id,
            resident=self.lock.resident,
            intent=self.lock.switching,
            known_jobs=self._known_jobs(),
            views=list(views.values()),
        )
        log.info(
            "group %s recovered: %s",
            self.group_id,
            decision.reason,
            extra={"group_id": self.group_id, "resident": decision.resident},
        )
        self._views.update(views)
        self._post(
            lambda now: self._bind(
                self.lock.on_recovered(
                    resident=decision.resident,
                    verified=decision.verified,
                    rollback=decision.rollback,
                    now=now,
                )
            )
        )

    # ---- leases ----------------------------------------------------------------------------

    def _sync_leases(self) -> None:
        """End Hold streams of a job that lost the lock; run the lease timer while none is open."""
        lk = self.lock
        holder, epoch, lease_ms = lk.holder, lk.grant_epoch, lk.holder_lease_ms
        for session in list(self._holds):
            if session.job != holder or session.epoch != epoch or lk.switching is not None:
                self._holds.discard(session)
                _resolve(
                    session.ended, f"job {session.job!r} no longer holds group {self.group_id!r}"
                )
        if len(self._holds) != self._holds_reported:
            self._holds_reported = len(self._holds)
            self._metrics.hold_streams.labels(group_id=self.group_id).set(self._holds_reported)
        key = None
        if holder is not None and lease_ms > 0 and not self._holds:
            key = (holder, epoch)
        if key == self._lease_key:
            return
        if self._lease_timer is not None:
            self._lease_timer.cancel()
            self._lease_timer = None
        self._lease_key = key
        if key is not None and not self._stopping:
            job = holder or ""
            self._lease_timer = asyncio.get_running_loop().call_later(
                lease_ms / 1000,
                self._post,
                lambda now: self._lease_expired(job, epoch, lease_ms, now),
            )

    def _lease_expired(self, job: str, epoch: int, lease_ms: int, now: float) -> list[Effect]:
        if any(h.job == job and h.epoch == epoch for h in self._holds):
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
        effects = self._bind(actions)
        if deferred:
            effects.append(
                lambda: self._metrics.deferred_snapshots.labels(group_id=self.group_id).inc()
            )
        return effects

    async def _expire(self) -> None:
        deadline = self.lock.grace_deadline()
        if deadline is None:
            return
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        self._post(lambda now: self._bind(self.lock.on_expire(now=now)))

    # ---- state -----------------------------------------------------------------------------

    def _known_jobs(self) -> set[str]:
        lk = self.lock
        known = {j for j in (lk.holder, lk.resident) if j}
        sw = lk.switching
        if sw is not None:
            known |= {j for j in (sw.from_job, sw.to_job) if j}
        return known | set(lk.waiting_jobs)

    def _reported_state(self) -> tuple[str, str]:
        if self._unreachable:
            return "UNKNOWN", "agents unreachable: " + "; ".join(
                f"{n}: {d}" for n, d in sorted(self._unreachable.items())
            )
        if self.lock.recovering:
            return "UNKNOWN", "recovering after restart: reading the agents"
        phase = self.lock.phase()
        if self.lock.blocked:
            return phase.value, self.lock.blocked
        if phase is lock.Phase.SWITCHING:
            return phase.value, self._switch_detail
        if not self.lock.claimed and self.lock.attached_waiters:
            others = ", ".join(sorted(self._arbiter.conflicts(self.group_id)))
            return phase.value, f"waiting for the devices it shares with group(s) {others}"
        return phase.value, self.lock.detail

    def _refresh_state(self) -> None:
        state, _ = self._reported_state()
        if state != self._state:
            self._state = state
            self._state_ts = timestamp_pb2.Timestamp()
            self._state_ts.FromNanoseconds(time.time_ns())
            self._metrics.set_state(self.group_id, state)
        depth = len(self.lock.waiting_jobs)
        if depth != self._queue_depth:
            self._queue_depth = depth
            self._queue_depth_series.set(depth)

    def _publish(self, kind: opb.OrchestratorEvent.Kind, **fields: Any) -> None:
        if self.wants(kind):  # nobody watching: not even built
            self.publish(events.make_event(kind, group_id=self.group_id, **fields))

    def _hold_events(self) -> None:
        """Hold this group's events back for at most EVENT_HOLD_S.

        Started with a switch: delivering events to watchers takes CPU that the
        hand-over needs (agent calls, the Acquire reply), and a short switch is over
        before the hold ends, so its events go out after the grant, in order and with
        the timestamps of the facts. A long switch streams them from EVENT_HOLD_S on.
        """
        if self._held is None:
            self._held = []
            loop = asyncio.get_running_loop()
            self._hold_timer = loop.call_later(EVENT_HOLD_S, self._release_events)

    def _release_events(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        held, self._held = self._held, None
        for event in held or ():
            self._bus.publish(event)
