"""A group's calls besides Acquire and Yield: an administrator's (Evict, Drain,
ClearDegraded), the reads (GetGroupStatus), the Hold streams, an AcquireSet's parts,
and the idle collection of local mode.

:class:`Admin` is a part of :class:`~tslice.orchestrator.group.driver.GroupDriver` (its
base): each call posts a command to the group's executor, like every change to a group,
and is answered once the change is saved (applied even if the caller goes away).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator.group import effects as fx
from tslice.orchestrator.group import executor, leases, lock, services, status
from tslice.orchestrator.switch import plan
from tslice.rpc import refusals

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Who evicts when the Evict RPC does (Kubernetes mode names itself).
BY_ADMIN = "an administrator"


def shutting_down() -> refusals.Refused:
    return refusals.Refused(refusals.Code.UNAVAILABLE, "orchestrator shutting down; retry")


def eviction_message(group_id: str, reason: str, by: str = BY_ADMIN) -> str:
    """What an evicted job is told (its Acquire's error, its later Yield's, its events)."""
    return f"evicted from group {group_id!r} by {by}: {reason or 'no reason given'}"


class Admin:
    """The calls of a group besides Acquire and Yield (see the module docstring)."""

    group_id: str
    nodes: Any
    lock: lock.GroupLock
    executor: executor.Executor
    health: status.Health
    retired: bool
    services: services.Services
    since: status.Since
    _leases: leases.Leases
    _stopping: bool

    def settled(self) -> None:
        """(the driver's: what follows a batch)"""
        raise NotImplementedError

    def gone(self) -> refusals.Refused:
        """Why a call to a group that stopped is refused."""
        if self.retired:
            return refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"group {self.group_id!r} was just collected as idle; retry (a new "
                "Acquire creates it again)",
            )
        return shutting_down()

    def reported_state(self) -> tuple[str, str]:
        return status.reported_state(
            self.lock,
            self.health,
            self._conflicts,
            self._kept_for,
            unsaved=self.services.store_health.problem,
        )

    def _kept_for(self, job: str, seq: int) -> str:
        waiting = self.services.sets.waiting()
        busy = next((sorted(g - r) for s, j, g, r in waiting if s == seq), [])
        return (
            f"kept free for job {job!r}, whose AcquireSet is granted once all its groups "
            f"are free (still waiting for: {', '.join(busy) or 'nothing'})"
        )

    def _conflicts(self) -> frozenset[str]:
        return self.services.arbiter.conflicts(self.group_id)

    async def _answered(self, decide: Callable[[float], tuple[_T, list[Any]]]) -> _T:
        """``decide(now)`` in a command; its answer once its effects ran (after saving)."""
        if self._stopping:
            raise self.gone()
        done: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self.executor.post(_deciding, decide, done)
        # Applied even if the caller goes away: shield the answer.
        return await asyncio.shield(done)

    # ---- an AcquireSet's parts -------------------------------------------------------------

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

        def undelivered(now: float) -> tuple[None, list[Any]]:
            return None, self.lock.on_undelivered(job, epoch=epoch, now=now, why=why)

        await self._answered(undelivered)

    def answered(self, job: str, epoch: int) -> None:
        """``job``'s AcquireSet is answered with grant ``epoch`` of this group: the grant
        is claimed from now (and a lease starts), see lock.on_set_answered."""
        self.executor.post(self._on_set_answered, job, epoch)

    def _on_set_answered(self, now: float, job: str, epoch: int) -> list[Any]:
        self.lock.on_set_answered(job, epoch=epoch)
        return []

    # ---- Hold streams ----------------------------------------------------------------------

    async def open_hold(self, job: str, *, epoch: int) -> leases.HoldSession:
        """Register a Hold stream of ``job`` (``epoch`` 0 = the current grant).

        Refused (FAILED_PRECONDITION) unless ``job`` holds the group under that grant.
        """
        if self._stopping:
            raise self.gone()
        return await self.executor.ask(lambda now: self._leases.open(self.lock, job, epoch))

    def close_hold(self, session: leases.HoldSession) -> None:
        """The Hold stream ended: if it was the last one, the lease timer starts."""
        if not self._stopping:
            self.executor.post(self._on_hold_closed, session)

    def _on_hold_closed(self, now: float, session: leases.HoldSession) -> list[Any]:
        self._leases.close(session)
        return []

    # ---- reads -----------------------------------------------------------------------------

    async def describe(self) -> opb.GetGroupStatusResponse:
        """Group status plus a live Status read of every node (short deadline)."""
        before = status.marker(self.lock)
        services = self.services
        reads = await plan.read_all(
            services.pool, self.nodes, self.group_id, timeout_s=services.cfg.status_timeout_s
        )

        def described(now: float) -> opb.GetGroupStatusResponse:
            self.health.note(reads)
            if reads.failed:
                self.lock.on_node_unreachable()
            loaded = status.observed_resident(
                self.lock, reads, nodes=len(self.nodes), before=before
            )
            self.settled()
            known = status.known_jobs(self.lock)
            return opb.GetGroupStatusResponse(
                group=status.group_status(
                    group_id=self.group_id,
                    nodes=self.nodes,
                    lk=self.lock,
                    health=self.health,
                    state=self.reported_state(),
                    timestamp=self.since.timestamp(),
                    loaded_job=loaded,
                ),
                agent_job_states=status.agent_job_states(
                    reads, group_id=self.group_id, known=known
                ),
            )

        return await self.executor.ask(described)

    # ---- an administrator's calls ----------------------------------------------------------

    async def clear_degraded(self, node: str = "") -> list[str]:
        """An operator fixed the cause: the node(s) take switches again."""

        def clear(now: float) -> tuple[list[str], list[Any]]:
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
            return cleared, [] if degraded else self.lock.on_unblocked(now=now)

        return await self._answered(clear)

    async def evict(self, job: str, reason: str = "", *, by: str = BY_ADMIN) -> fx.EvictOutcome:
        """``by`` (an administrator) takes ``job`` out of the group now (``reason``: their words).

        A holder loses the lock as a lapsed lease does: the next waiter is granted
        through the normal switch, its Hold streams end with the reason, its later
        Yield is refused naming it. A waiter's pending Acquires fail ABORTED with the
        reason. ``role`` None: the job neither held nor waited (nothing changed).
        """
        why = eviction_message(self.group_id, reason, by)

        def evict(now: float) -> tuple[fx.EvictOutcome, list[Any]]:
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
            effects: list[Any] = list(out.actions)
            if out.role is fx.Role.HOLDER:
                ending = self._leases.released(job)
                if ending:
                    effects.append(fx.EndHolds(ending, why))
                if deferred and self.lock.switch is None:
                    effects.append(fx.CountDeferredSnapshot())
            return out, effects

        return await self._answered(evict)

    async def drain(self, drain: bool) -> opb.DrainResponse:
        """Drain (no new turn is granted; the holder keeps its own) or resume the group.
        The mark is persisted with the group's state."""

        def mark(now: float) -> tuple[opb.DrainResponse, list[Any]]:
            lk = self.lock
            was = lk.draining
            # Booked here, so that the reply tells the turn a resume granted.
            booked = self.executor.book(lk.on_drain(drain, now=now), now)
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
                switching=lk.switch is not None,
                waiter_queue_depth=len(lk.queue),
            )
            return reply, booked

        return await self._answered(mark)

    # ---- idle collection (local mode) ------------------------------------------------------

    def idle_since(self) -> tuple[int, float] | None:
        """``(activity, since)`` if nobody holds, waits for or switches the group and no
        Hold stream is open (residents are the agents' to tell), else ``None``."""
        lk = self.lock
        busy = (
            self._stopping
            or lk.recovering
            or lk.holder is not None
            or lk.switch is not None
            or bool(lk.queue)
            or any(self.executor.waiting.values())
            or self._leases.open_streams > 0
            # An administrator's mark outlives idleness (it is in the group's rows).
            or lk.draining
        )
        return None if busy else (self.executor.activity, self.executor.active_at)

    async def retire(self, activity: int) -> bool:
        """Collect the group if it is still idle and nothing happened to it since
        ``activity`` (the caller read the agents meanwhile): it stops taking calls and its
        rows are deleted at once, before any other group of the same id can save."""

        def decide(now: float) -> bool:
            # This command counts as one activity itself.
            if self.executor.activity != activity + 1 or self.idle_since() is None:
                return False
            self.services.db.forget(self.group_id)
            self._stopping = self.retired = True
            return True

        if self._stopping:
            return False
        return await self.executor.ask(decide)


def _deciding(
    now: float, decide: Callable[[float], tuple[Any, list[Any]]], done: asyncio.Future[Any]
) -> list[Any]:
    answer, effects = decide(now)
    return [*effects, fx.Answer(done, answer)]
