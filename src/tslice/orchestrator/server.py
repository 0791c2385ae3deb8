"""The v1alpha1 TimeSliceOrchestratorService servicer (grpc.aio).

Validation and status-code mapping live here; decisions live in the groups
(``group.driver``). An Acquire is a waiter of its group, answered when the group's
executor resolves it: over a Session from the waiter's callback
(``rpc.multiplex.serve``), with no task per request; a unary call awaits it.

Status codes: INVALID_ARGUMENT (bad ids or footprint), NOT_FOUND (unknown group; Evict of
a job that neither holds nor waits), PERMISSION_DENIED (yield of a lock another job
holds), UNAVAILABLE (shutting down; retry), ABORTED (the job yielded while its own
Acquire was pending, or an administrator evicted it), FAILED_PRECONDITION (Hold by a job
that does not hold the group; Yield by a job an administrator evicted),
RESOURCE_EXHAUSTED (a footprint that never fits, a group's waiters or the event watchers
past their caps, a watcher that fell behind); UNAVAILABLE also while the orchestrator
cannot write its state (``persistence.health``: a full disk, a corrupt database), naming
why, for every call that would change a group; CANCELLED / DEADLINE_EXCEEDED come from
the caller.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import validation
from tslice.orchestrator.events import bus, tap
from tslice.orchestrator.group import callers, driver, manager
from tslice.orchestrator.group import effects as fx
from tslice.orchestrator.persistence import health
from tslice.orchestrator.sets import acquire as set_acquire
from tslice.rpc import multiplex, refusals, undecodable
from tslice.security import roles
from tslice.server import logs

log = logging.getLogger(__name__)

#: The Session method's wire path: what a refused stream's message names.
_SESSION_PATH = (
    f"/{opb.DESCRIPTOR.services_by_name['TimeSliceOrchestratorService'].full_name}/Session"
)


#: Characters of an administrator's eviction reason (it travels into errors and logs).
MAX_REASON = 256
#: Groups of one AcquireSet.
MAX_SET_GROUPS = 16
#: Ids found valid lately, remembered so that a request of a known job or group costs
#: a lookup, not a match (a bound: the memory is cleared when it is full).
_VALID_IDS_KEPT = 4096


def _checked_fields(message: Any) -> None:
    """Enums, counts and string lengths of a request (after its ids were checked)."""
    try:
        validation.check_message(message)
    except validation.InvalidInput as err:
        raise refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err)) from None


def _at_least_0(field: str, value: int, zero: str) -> int:
    if value < 0:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT, f"{field} must be >= 0 (got {value}); 0 = {zero}"
        )
    return value


def _sooner(time_left: float | None, timeout_ms: int) -> float | None:
    """The nearer of a call's deadline and a request's ``timeout_ms`` (0 = none)."""
    if timeout_ms <= 0:
        return time_left
    own = timeout_ms / 1000
    return own if time_left is None else min(time_left, own)


def _checked_terms(
    job: str, request: opb.AcquireRequest | opb.AcquireSetRequest, time_left: float | None
) -> float | None:
    """The caller may act as ``job``, and the Acquire's numbers are valid; the time left
    (the nearer of the call's deadline and ``timeout_ms``)."""
    check_job = roles.JOB_CHECK.get()
    if check_job is not None:
        check_job(job)  # a job credential acts only as its own job ids
    _at_least_0("footprint_bytes", request.footprint_bytes, "default")
    lease_ms = request.lease_ms
    if lease_ms != 0 and not lease_ms >= validation.MIN_LEASE_MS:  # (the check names why)
        try:
            validation.check_lease("lease_ms", lease_ms)
        except validation.InvalidInput as err:
            raise refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err)) from None
    timeout_ms = request.timeout_ms
    if timeout_ms == 0:
        return time_left
    return _sooner(time_left, _at_least_0("timeout_ms", timeout_ms, "no deadline"))


def _set_footprints(request: opb.AcquireSetRequest, gids: list[str]) -> dict[str, int]:
    """Each group's footprint: its own (``footprints``), else ``footprint_bytes``."""
    named = dict(request.footprints)
    strange = sorted(set(named) - set(gids))
    if strange:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"footprints names {', '.join(map(repr, strange))}, not among group_ids; give "
            "a footprint only for the groups of the set",
        )
    for gid, footprint in named.items():
        _at_least_0(f"footprints[{gid!r}]", footprint, "footprint_bytes")
    return {gid: named.get(gid) or request.footprint_bytes for gid in gids}


def _checked_set(group_ids: list[str]) -> list[str]:
    """An AcquireSet's groups: each a valid id, at least one, each once, at most 16."""
    if not group_ids:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            "group_ids is empty: name the groups to acquire together",
        )
    if len(group_ids) > MAX_SET_GROUPS:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"group_ids names {len(group_ids)} groups; one AcquireSet takes at most "
            f"{MAX_SET_GROUPS}",
        )
    checked = [refusals.checked_id("group_ids", gid) for gid in group_ids]
    repeated = sorted({gid for gid in checked if checked.count(gid) > 1})
    if repeated:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"group_ids names {', '.join(map(repr, repeated))} more than once; name each "
            "group once",
        )
    return checked


def _checked_reason(reason: str) -> str:
    """An eviction reason: short, one printable line (it goes into logs and errors)."""
    if len(reason) > MAX_REASON or not reason.isprintable():
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"reason must be one printable line of at most {MAX_REASON} characters "
            f"(got {len(reason)} characters: {validation.shown(reason)})",
        )
    return reason


def _eviction(gid: str, out: fx.EvictOutcome) -> opb.Eviction:
    role = opb.Eviction.ROLE_HOLDER if out.role is fx.Role.HOLDER else opb.Eviction.ROLE_WAITER
    return opb.Eviction(group_id=gid, role=role, next_job=out.next_job)


def _refused(request_id: int, refused: refusals.Refused) -> opb.SessionResponse:
    return opb.SessionResponse(
        request_id=request_id,
        status_code=refusals.status_number(refused.code),
        status_message=validation.bounded(refused.message),
    )


def _duplicate(request: opb.SessionRequest) -> opb.SessionResponse:
    """A second request with the id of one in flight: refused, never run (no ghost waiter)."""
    message = multiplex.duplicate_message(request.request_id)
    return _refused(request.request_id, refusals.Refused(refusals.Code.INVALID_ARGUMENT, message))


def _acquired(grant: callers.Grant) -> opb.AcquireResponse:
    return opb.AcquireResponse(
        success=True,
        waited_ms=int(grant.waited_s * 1000),
        context_restored=grant.restored,
        grant_epoch=grant.epoch,
    )


def _yielded(request: opb.YieldRequest, out: fx.YieldOutcome) -> opb.YieldResponse:
    """The Yield's answer; raises ``refusals.Refused`` if the job did not hold the group."""
    job, gid = request.job_id, request.group_id
    if not out.ok and out.holder is None:
        # Nobody holds it, and an administrator took it from this job.
        raise refusals.Refused(
            refusals.Code.FAILED_PRECONDITION,
            f"job {job!r} no longer holds group {gid!r}: it was {out.evicted}; Acquire it again",
        )
    if not out.ok:
        evicted = f" (job {job!r} was {out.evicted})" if out.evicted else ""
        raise refusals.Refused(
            refusals.Code.PERMISSION_DENIED,
            f"group {gid!r} is held by job {out.holder!r}, not {job!r}{evicted}; "
            "only the holder can yield it",
        )
    return opb.YieldResponse(
        success=True,
        pending_waiters=out.pending_waiters,
        snapshot_deferred=out.snapshot_deferred,
    )


def _session_answer(request: opb.SessionRequest, done: asyncio.Future[Any]) -> opb.SessionResponse:
    """A Session request's reply, from its finished grant, yield or set (or refusal)."""
    rid = request.request_id
    try:
        result = done.result()
        reply = opb.SessionResponse(request_id=rid)
        if isinstance(result, callers.Grant):
            reply.acquire.CopyFrom(_acquired(result))
        elif isinstance(result, fx.YieldOutcome):
            reply.release.CopyFrom(_yielded(request.release, result))
        else:
            reply.acquire_set.CopyFrom(result)
        return reply
    except refusals.Refused as refused:
        return _refused(rid, refused)
    except Exception as err:
        # A unary call would end UNKNOWN; a Session request must not go unanswered.
        log.error("session request %d failed", rid, exc_info=err)
        failed = f"the orchestrator failed on this request ({type(err).__name__}: {err})"
        return _refused(rid, refusals.Refused(refusals.Code.INTERNAL, failed))


class OrchestratorServicer(opb_grpc.TimeSliceOrchestratorServiceServicer):
    def __init__(
        self,
        *,
        groups: manager.GroupManager,
        events: bus.EventBus,
        store: health.StoreHealth | None = None,
        event_tap: tap.EventTap | None = None,
    ) -> None:
        self._groups = groups
        self._bus = events
        #: While the state cannot be written, calls that would change a group are refused.
        self._store = store if store is not None else health.StoreHealth()
        self._valid_ids: set[str] = set()
        #: The history behind WatchEvents' ``since`` (None: none kept).
        self._tap = event_tap
        #: Set when the orchestrator stops: Session streams end at once.
        self._closing = multiplex.Closing()

    def close(self) -> None:
        """End the long-lived Session streams (after the groups stopped)."""
        self._closing.set()

    def _driver(self, gid: str) -> driver.GroupDriver:
        return self._found(gid, self._groups.get(gid))

    def _found(self, gid: str, found: driver.GroupDriver | None) -> driver.GroupDriver:
        if found is None:
            raise self._not_found(gid)
        return found

    def _not_found(self, gid: str) -> refusals.Refused:
        return refusals.Refused(refusals.Code.NOT_FOUND, self._groups.not_found_message(gid))

    def _checked_id(self, field: str, value: str) -> str:
        """``value`` if it is a well-formed id, else refused naming ``field``."""
        if value in self._valid_ids:
            return value
        checked = refusals.checked_id(field, value)
        if len(self._valid_ids) >= _VALID_IDS_KEPT:
            self._valid_ids.clear()
        self._valid_ids.add(checked)
        return checked

    async def Acquire(
        self, request: opb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireResponse:
        time_left = context.time_remaining()
        return await refusals.answered(context, self._unary_acquire(request, time_left))

    async def AcquireSet(
        self, request: opb.AcquireSetRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireSetResponse:
        time_left = context.time_remaining()
        return await refusals.answered(context, self.acquire_set(request, time_left=time_left))

    async def Yield(
        self, request: opb.YieldRequest, context: grpc.aio.ServicerContext
    ) -> opb.YieldResponse:
        return await refusals.answered(context, self._unary_yield(request))

    async def _unary_yield(self, request: opb.YieldRequest) -> opb.YieldResponse:
        return _yielded(request, await self.yield_(request))

    @undecodable.parses_own_requests
    async def Session(
        self,
        request_iterator: AsyncIterator[bytes | opb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[opb.SessionResponse]:
        async for reply in multiplex.serve(
            request_iterator,
            self._session_start,
            request_id=operator.attrgetter("request_id"),
            duplicate=_duplicate,
            answer=self._session_answer,
            is_cancel=operator.methodcaller("HasField", "cancel"),
            name=_SESSION_PATH,
            closing=self._closing,
            parse=opb.SessionRequest.FromString,
            context=context,
        ):
            yield reply

    #: The reply to a finished Session request (a test's scripted servicer wraps it).
    _session_answer = staticmethod(_session_answer)

    def _session_start(self, request: opb.SessionRequest) -> Awaitable[Any]:
        """A Session request under way: its grant, its yield's outcome, its set."""
        kind = request.WhichOneof("call")
        if kind == "acquire":
            return self.acquire(request.acquire)
        if kind == "release":
            return self.yield_(request.release)
        if kind == "acquire_set":
            return self.acquire_set(request.acquire_set)
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            "a Session request carries acquire, acquire_set, release or cancel",
        )

    def acquire(
        self, request: opb.AcquireRequest, *, time_left: float | None = None
    ) -> Awaitable[callers.Grant]:
        """One Acquire under way (over a Session, or unary): its grant. Raises
        ``refusals.Refused``. ``time_left``: seconds to the call's deadline (None: none),
        bounded by the request's own ``timeout_ms``."""
        started = self._acquiring(request, time_left)
        return started.future if isinstance(started, callers.Waiter) else started

    async def _unary_acquire(
        self, request: opb.AcquireRequest, time_left: float | None
    ) -> opb.AcquireResponse:
        started = self._acquiring(request, time_left)
        if not isinstance(started, callers.Waiter):
            return _acquired(await started)
        try:
            grant = await started.future
        except asyncio.CancelledError:
            if started.future.done() and not started.future.cancelled():
                callers.undelivered(started)  # granted, its reply lost
            raise
        return _acquired(grant)

    def _acquiring(
        self, request: opb.AcquireRequest, time_left: float | None
    ) -> callers.Waiter | Coroutine[Any, Any, callers.Grant]:
        """The Acquire under way (unary or over a Session): its waiter, or a coroutine
        where its group must be created first or its nodes read for the footprint."""
        job = self._checked_id("job_id", request.job_id)
        gid = self._checked_id("group_id", request.group_id)
        logs.IDS.set({"job_id": job, "group_id": gid})  # every log line of this call
        time_left = _checked_terms(job, request, time_left)
        if self._store.problem:  # (read on every call: an attribute)
            raise self._store.refusal()
        found = self._groups.by_id.get(gid)
        footprint = request.footprint_bytes
        if found is None or (footprint > 0 and found.needs_read()):
            return self._acquire_later(request, job, gid, time_left)
        return found.acquire(
            job, footprint_bytes=footprint, lease_ms=request.lease_ms, time_left=time_left
        )

    async def _acquire_later(
        self, request: opb.AcquireRequest, job: str, gid: str, time_left: float | None
    ) -> callers.Grant:
        """An Acquire that first creates its group (local mode) or reads its nodes."""
        found = self._found(gid, await self._groups.get_or_create(gid))
        footprint = request.footprint_bytes
        if footprint > 0:
            await found.fits(job, footprint)
        waiter = found.acquire(
            job, footprint_bytes=footprint, lease_ms=request.lease_ms, time_left=time_left
        )
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                callers.undelivered(waiter)  # granted, its reply lost
            raise

    async def acquire_set(
        self, request: opb.AcquireSetRequest, *, time_left: float | None = None
    ) -> opb.AcquireSetResponse:
        """One AcquireSet (unary or over a Session); raises ``refusals.Refused``."""
        started = time.monotonic()
        job = refusals.checked_id("job_id", request.job_id)
        gids = _checked_set(list(request.group_ids))
        time_left = _checked_terms(job, request, time_left)
        footprints = _set_footprints(request, gids)
        if self._store.problem:  # (read on every call: an attribute)
            raise self._store.refusal()
        # Every group is checked before any is asked for: an unknown one loses nothing.
        drivers = {gid: self._found(gid, await self._groups.get_or_create(gid)) for gid in gids}
        grants = await set_acquire.acquire_set(
            drivers,
            job,
            footprints=footprints,
            lease_ms=request.lease_ms,
            time_left=time_left,
        )
        return opb.AcquireSetResponse(
            success=True,
            waited_ms=int((time.monotonic() - started) * 1000),
            grants=[
                opb.SetGrant(
                    group_id=gid,
                    context_restored=grants[gid].restored,
                    grant_epoch=grants[gid].epoch,
                )
                for gid in gids
            ],
        )

    def yield_(self, request: opb.YieldRequest) -> Awaitable[fx.YieldOutcome]:
        """One Yield under way (over a Session, or unary): its outcome once persisted.
        Raises ``refusals.Refused``."""
        job = self._checked_id("job_id", request.job_id)
        gid = self._checked_id("group_id", request.group_id)
        logs.IDS.set({"job_id": job, "group_id": gid})  # every log line of this call
        check_job = roles.JOB_CHECK.get()
        if check_job is not None:
            check_job(job)
        if self._store.problem:  # (read on every call: an attribute)
            raise self._store.refusal()
        found = self._groups.by_id.get(gid)
        if found is None:
            return self._yield_kept(gid, job)
        return found.yield_(job)

    async def _yield_kept(self, gid: str, job: str) -> fx.YieldOutcome:
        """A Yield for a group that is not running (kept for it if it is stopped)."""
        kept = await self._groups.keep_yield(gid, job)
        if kept is None:
            raise self._not_found(gid)
        return kept

    async def ListGroups(
        self, request: opb.ListGroupsRequest, context: grpc.aio.ServicerContext
    ) -> opb.ListGroupsResponse:
        return opb.ListGroupsResponse(group_ids=self._groups.ids())

    async def GetGroupStatus(
        self, request: opb.GetGroupStatusRequest, context: grpc.aio.ServicerContext
    ) -> opb.GetGroupStatusResponse:
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        found = await refusals.checked(context, self._driver, gid)
        return await found.describe()

    async def ClearDegraded(
        self, request: opb.ClearDegradedRequest, context: grpc.aio.ServicerContext
    ) -> opb.ClearDegradedResponse:
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        found = await refusals.checked(context, self._driver, gid)
        node = request.node
        if node:
            await refusals.checked(context, refusals.checked_id, "node", node)
        if node and node not in {n.name for n in found.nodes}:
            known = ", ".join(n.name for n in found.nodes)
            missing = f"node {node!r} is not in group {gid!r} (its nodes: {known})"
            # NOT_FOUND is kept for unknown groups: a bad node of a known one is an argument.
            await refusals.abort(context, refusals.Refused(refusals.Code.INVALID_ARGUMENT, missing))
        await refusals.checked(context, self._store.check)
        return opb.ClearDegradedResponse(cleared=await found.clear_degraded(node))

    async def Evict(
        self, request: opb.EvictRequest, context: grpc.aio.ServicerContext
    ) -> opb.EvictResponse:
        job = await refusals.checked(context, refusals.checked_id, "job_id", request.job_id)
        reason = await refusals.checked(context, _checked_reason, request.reason)
        if request.group_id:
            await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        await refusals.checked(context, self._store.check)
        if not request.group_id:
            evicted = await self._groups.evict(job, reason)
            if not evicted:
                nowhere = (
                    f"job {job!r} neither holds nor waits for any group; nothing to evict "
                    "(see `tslice list`)"
                )
                await refusals.abort(context, refusals.Refused(refusals.Code.NOT_FOUND, nowhere))
            return opb.EvictResponse(evictions=[_eviction(gid, out) for gid, out in evicted])
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        found = await refusals.checked(context, self._driver, gid)
        out = await refusals.answered(context, found.evict(job, reason))
        if out.role is None:
            absent = (
                f"job {job!r} neither holds nor waits for group {gid!r}; nothing to evict "
                f"(see `tslice status {gid}`)"
            )
            await refusals.abort(context, refusals.Refused(refusals.Code.NOT_FOUND, absent))
        return opb.EvictResponse(evictions=[_eviction(gid, out)])

    async def Drain(
        self, request: opb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> opb.DrainResponse:
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        found = await refusals.checked(context, self._driver, gid)
        await refusals.checked(context, self._store.check)
        return await refusals.answered(context, found.drain(request.drain))

    async def WatchEvents(
        self, request: opb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.OrchestratorEvent]:
        gid = request.group_id
        if gid:
            await refusals.checked(context, refusals.checked_id, "group_id", gid)
            if not self._groups.local and not request.HasField("since"):
                await refusals.checked(context, self._driver, gid)
        job = request.job_id
        if job:
            await refusals.checked(context, refusals.checked_id, "job_id", job)
        await refusals.checked(context, _checked_fields, request)
        query = await refusals.checked(context, tap.query, request, self._tap)
        try:
            sub = self._bus.subscribe(
                group_id=gid, kinds=frozenset(request.kinds), job_id=job, caller=_caller(context)
            )
        except refusals.Refused as refused:  # too many watchers: refused before any event
            await refusals.abort(context, refused)
        # In the same turn as the subscription: the replay ends where the live part starts.
        mark = self._tap.mark() if query is not None and self._tap is not None else None
        missed = 0
        try:
            # Headers go out once subscribed: a client awaiting initial_metadata() then
            # knows that no later event will be missed.
            await context.send_initial_metadata(())
            if query is not None and mark is not None and self._tap is not None:
                async for event in self._tap.replay(query, mark):
                    yield event
                if request.history_only or request.HasField("until"):
                    return
            try:
                async for event in sub:
                    yield event
            except bus.FellBehind as behind:
                missed = behind.missed
                await refusals.abort(
                    context, refusals.Refused(refusals.Code.RESOURCE_EXHAUSTED, str(behind))
                )
        finally:
            self._bus.unsubscribe(sub, missed=missed)

    async def Hold(
        self, request: opb.HoldRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.HoldEvent]:
        job = await refusals.checked(context, refusals.checked_id, "job_id", request.job_id)
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        await refusals.checked(
            context, roles.require_job, job
        )  # nobody keeps another job's lock alive
        await refusals.checked(
            context, _at_least_0, "grant_epoch", request.grant_epoch, "the current grant"
        )
        found = await refusals.checked(context, self._driver, gid)
        session = await refusals.answered(context, found.open_hold(job, epoch=request.grant_epoch))
        try:
            # Keepalives well within the lease show the holder that the lock is still its own.
            interval = max(session.lease_ms / 3000, 0.05) if session.lease_ms > 0 else 10.0
            yield opb.HoldEvent(lease_ms=session.lease_ms)
            while True:
                done, _ = await asyncio.wait({session.ended}, timeout=interval)
                if not done:
                    yield opb.HoldEvent(lease_ms=session.lease_ms)
                    continue
                try:
                    lost = session.ended.result()
                except refusals.Refused as refused:
                    await refusals.abort(context, refused)
                if lost:
                    yield opb.HoldEvent(lost=lost)
                else:
                    yield opb.HoldEvent(released=True)
                return
        finally:
            found.close_hold(session)


def _caller(context: grpc.aio.ServicerContext) -> str:
    """Whose the call is, for the caps on watchers: its verified identity, else its host."""
    principal = roles.principal_of(context)
    if principal is not None:
        return principal.name
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer
