"""The v1alpha1 TimeSliceOrchestratorService servicer (grpc.aio).

Validation and status-code mapping live here; decisions live in the group
drivers. Status codes: INVALID_ARGUMENT (bad ids or footprint), NOT_FOUND
(unknown group; Evict of a job that neither holds nor waits), PERMISSION_DENIED
(yield of a lock another job holds), UNAVAILABLE (shutting down; retry), ABORTED
(the job yielded while its own Acquire was pending, or an administrator evicted
it), FAILED_PRECONDITION (Hold by a job that does not hold the group; Yield by a
job an administrator evicted); UNAVAILABLE also while the orchestrator cannot write its
state (``store_health``: a full disk, a corrupt database), naming why, for every call that
would change a group; CANCELLED / DEADLINE_EXCEEDED come from the caller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import validation
from tslice.orchestrator import (
    decisions,
    events,
    group,
    history,
    manager,
    set_acquire,
    store_health,
    tap,
)
from tslice.rpc import refusals, unique_requests
from tslice.security import roles
from tslice.server import logs

_T = TypeVar("_T")
log = logging.getLogger(__name__)


#: Characters of an administrator's eviction reason (it travels into errors and logs).
MAX_REASON = 256
#: Groups of one AcquireSet.
MAX_SET_GROUPS = 16


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
    roles.require_job(job)  # a job credential acts only as its own job ids
    _at_least_0("footprint_bytes", request.footprint_bytes, "default")
    try:
        validation.check_lease("lease_ms", request.lease_ms)
    except validation.InvalidInput as err:
        raise refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err)) from None
    return _sooner(time_left, _at_least_0("timeout_ms", request.timeout_ms, "no deadline"))


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


def _eviction(gid: str, out: decisions.EvictOutcome) -> opb.Eviction:
    role = (
        opb.Eviction.ROLE_HOLDER if out.role is decisions.Role.HOLDER else opb.Eviction.ROLE_WAITER
    )
    return opb.Eviction(group_id=gid, role=role, next_job=out.next_job)


def _refused(request_id: int, refused: refusals.Refused) -> opb.SessionResponse:
    return opb.SessionResponse(
        request_id=request_id,
        status_code=refusals.status_number(refused.code),
        status_message=validation.bounded(refused.message),
    )


def _duplicate(request: opb.SessionRequest) -> opb.SessionResponse:
    """A second request with the id of one in flight: refused, never run (no ghost waiter)."""
    message = unique_requests.duplicate_message(request.request_id)
    return _refused(request.request_id, refusals.Refused(refusals.Code.INVALID_ARGUMENT, message))


class OrchestratorServicer(opb_grpc.TimeSliceOrchestratorServiceServicer):
    def __init__(
        self,
        *,
        groups: manager.GroupManager,
        bus: events.EventBus,
        store: store_health.StoreHealth | None = None,
        event_tap: tap.EventTap | None = None,
    ) -> None:
        self._groups = groups
        self._bus = bus
        #: While the state cannot be written, calls that would change a group are refused.
        self._store = store if store is not None else store_health.StoreHealth()
        #: The history behind WatchEvents' ``since`` (None: none kept).
        self._tap = event_tap
        #: Set when the orchestrator stops: Session streams end at once.
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End the long-lived Session streams (after the groups stopped)."""
        self._closing.set()

    def _driver(self, gid: str) -> group.GroupDriver:
        return self._found(gid, self._groups.get(gid))

    def _found(self, gid: str, driver: group.GroupDriver | None) -> group.GroupDriver:
        if driver is None:
            raise refusals.Refused(refusals.Code.NOT_FOUND, self._groups.not_found_message(gid))
        return driver

    async def Acquire(
        self, request: opb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireResponse:
        time_left = context.time_remaining()
        return await refusals.answered(context, self.acquire(request, time_left=time_left))

    async def AcquireSet(
        self, request: opb.AcquireSetRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireSetResponse:
        time_left = context.time_remaining()
        return await refusals.answered(context, self.acquire_set(request, time_left=time_left))

    async def Yield(
        self, request: opb.YieldRequest, context: grpc.aio.ServicerContext
    ) -> opb.YieldResponse:
        return await refusals.answered(context, self.yield_(request))

    async def Session(
        self,
        request_iterator: AsyncIterator[opb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[opb.SessionResponse]:
        async for reply in unique_requests.serve(
            request_iterator,
            self._session_reply,
            request_id=lambda r: r.request_id,
            duplicate=_duplicate,
            is_cancel=lambda r: r.WhichOneof("call") == "cancel",
            name="session",
            closing=self._closing,
        ):
            yield reply

    async def _session_reply(self, request: opb.SessionRequest) -> opb.SessionResponse:
        reply = opb.SessionResponse(request_id=request.request_id)
        try:
            kind = request.WhichOneof("call")
            if kind == "acquire":
                reply.acquire.CopyFrom(await self.acquire(request.acquire))
            elif kind == "release":
                reply.release.CopyFrom(await self.yield_(request.release))
            elif kind == "acquire_set":
                reply.acquire_set.CopyFrom(await self.acquire_set(request.acquire_set))
            else:
                raise refusals.Refused(
                    refusals.Code.INVALID_ARGUMENT,
                    "a Session request carries acquire, acquire_set, release or cancel",
                )
        except refusals.Refused as refused:
            return _refused(request.request_id, refused)
        except Exception as err:
            # A unary call would end UNKNOWN; a Session request must not go unanswered.
            log.exception("session request %d failed", request.request_id)
            failed = f"the orchestrator failed on this request ({type(err).__name__}: {err})"
            return _refused(request.request_id, refusals.Refused(refusals.Code.INTERNAL, failed))
        return reply

    async def acquire(
        self, request: opb.AcquireRequest, *, time_left: float | None = None
    ) -> opb.AcquireResponse:
        """One Acquire (unary or over a Session); raises ``refusals.Refused``.

        ``time_left``: seconds to the call's deadline (None: none; Session requests),
        bounded by the request's own ``timeout_ms`` (how a Session request carries one)."""
        started = time.monotonic()
        job = refusals.checked_id("job_id", request.job_id)
        gid = refusals.checked_id("group_id", request.group_id)
        logs.IDS.set({"job_id": job, "group_id": gid})  # every log line of this call
        time_left = _checked_terms(job, request, time_left)
        self._store.check()
        driver = self._found(gid, await self._groups.get_or_create(gid))
        grant = await driver.acquire(
            job,
            footprint_bytes=request.footprint_bytes,
            lease_ms=request.lease_ms,
            time_left=time_left,
        )
        return opb.AcquireResponse(
            success=True,
            waited_ms=int((time.monotonic() - started) * 1000),
            context_restored=grant.restored,
            grant_epoch=grant.epoch,
        )

    async def acquire_set(
        self, request: opb.AcquireSetRequest, *, time_left: float | None = None
    ) -> opb.AcquireSetResponse:
        """One AcquireSet (unary or over a Session); raises ``refusals.Refused``."""
        started = time.monotonic()
        job = refusals.checked_id("job_id", request.job_id)
        gids = _checked_set(list(request.group_ids))
        time_left = _checked_terms(job, request, time_left)
        self._store.check()
        # Every group is checked before any is asked for: an unknown one loses nothing.
        drivers = {gid: self._found(gid, await self._groups.get_or_create(gid)) for gid in gids}
        grants = await set_acquire.acquire_set(
            drivers,
            job,
            footprint_bytes=request.footprint_bytes,
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

    async def yield_(self, request: opb.YieldRequest) -> opb.YieldResponse:
        """One Yield (unary or over a Session); raises ``refusals.Refused``."""
        job = refusals.checked_id("job_id", request.job_id)
        gid = refusals.checked_id("group_id", request.group_id)
        logs.IDS.set({"job_id": job, "group_id": gid})  # every log line of this call
        roles.require_job(job)
        self._store.check()
        driver = self._groups.get(gid)
        kept = await self._groups.keep_yield(gid, job) if driver is None else None
        out = kept or await self._found(gid, driver).yield_(job)
        if not out.ok and out.holder is None:
            # Nobody holds it, and an administrator took it from this job.
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job!r} no longer holds group {gid!r}: it was {out.evicted}; "
                "Acquire it again",
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

    async def ListGroups(
        self, request: opb.ListGroupsRequest, context: grpc.aio.ServicerContext
    ) -> opb.ListGroupsResponse:
        return opb.ListGroupsResponse(group_ids=self._groups.ids())

    async def GetGroupStatus(
        self, request: opb.GetGroupStatusRequest, context: grpc.aio.ServicerContext
    ) -> opb.GetGroupStatusResponse:
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        driver = await refusals.checked(context, self._driver, gid)
        return await driver.describe()

    async def ClearDegraded(
        self, request: opb.ClearDegradedRequest, context: grpc.aio.ServicerContext
    ) -> opb.ClearDegradedResponse:
        gid = await refusals.checked(context, refusals.checked_id, "group_id", request.group_id)
        driver = await refusals.checked(context, self._driver, gid)
        node = request.node
        if node:
            await refusals.checked(context, refusals.checked_id, "node", node)
        if node and node not in {n.name for n in driver.nodes}:
            known = ", ".join(n.name for n in driver.nodes)
            missing = f"node {node!r} is not in group {gid!r} (its nodes: {known})"
            # NOT_FOUND is kept for unknown groups: a bad node of a known one is an argument.
            await refusals.abort(context, refusals.Refused(refusals.Code.INVALID_ARGUMENT, missing))
        await refusals.checked(context, self._store.check)
        return opb.ClearDegradedResponse(cleared=await driver.clear_degraded(node))

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
        driver = await refusals.checked(context, self._driver, gid)
        out = await refusals.answered(context, driver.evict(job, reason))
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
        driver = await refusals.checked(context, self._driver, gid)
        await refusals.checked(context, self._store.check)
        return await refusals.answered(context, driver.drain(request.drain))

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
        query = await refusals.checked(context, self._history_query, request)
        sub = self._bus.subscribe(group_id=gid, kinds=frozenset(request.kinds))
        # In the same turn as the subscription: the replay ends where the live part starts.
        mark = self._tap.mark() if query is not None and self._tap is not None else None
        try:
            # Headers go out once subscribed: a client awaiting initial_metadata() then
            # knows that no later event will be missed.
            await context.send_initial_metadata(())
            if query is not None and mark is not None and self._tap is not None:
                async for event in self._tap.replay(query, mark):
                    yield event
                if request.history_only or request.HasField("until"):
                    return
            async for event in sub:
                if not job or job in (event.job_id, event.from_job):
                    yield event
        finally:
            self._bus.unsubscribe(sub)

    def _history_query(self, request: opb.WatchEventsRequest) -> history.Query | None:
        """The stored events a WatchEvents asks for (None: live only)."""
        if not request.HasField("since"):
            if request.HasField("until") or request.history_only:
                raise refusals.Refused(
                    refusals.Code.INVALID_ARGUMENT,
                    "until and history_only need since: the time the stored events start",
                )
            return None
        if self._tap is None or self._tap.history is None:
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                "this orchestrator keeps no event history (`history: {enabled: false}` in "
                "its config); watch live events only (no since)",
            )
        since = request.since.ToNanoseconds()
        until = request.until.ToNanoseconds() if request.HasField("until") else 0
        if request.HasField("until") and until < since:
            raise refusals.Refused(
                refusals.Code.INVALID_ARGUMENT,
                f"until ({request.until.ToJsonString()}) is before since "
                f"({request.since.ToJsonString()})",
            )
        return history.Query(
            since_ns=since,
            until_ns=until,
            group_id=request.group_id,
            job_id=request.job_id,
            kinds=frozenset(request.kinds),
        )

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
        driver = await refusals.checked(context, self._driver, gid)
        session = await refusals.answered(context, driver.open_hold(job, epoch=request.grant_epoch))
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
            driver.close_hold(session)
