"""The v1alpha1 TimeSliceOrchestratorService servicer (grpc.aio).

Validation and status-code mapping live here; decisions live in the group
drivers. Status codes: INVALID_ARGUMENT (bad ids or footprint), NOT_FOUND
(unknown group), PERMISSION_DENIED (yield of a lock another job holds),
UNAVAILABLE (shutting down; retry), ABORTED (the job yielded while its own
Acquire was pending), FAILED_PRECONDITION (Hold by a job that does not hold the
group); CANCELLED / DEADLINE_EXCEEDED come from the caller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import ids, multiplex
from tslice.orchestrator import events, group, manager

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class Refusal(Exception):
    """A request answered with an error status (unary: the call's status; Session: a reply)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    await context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort always raises


def _checked_id(kind: str, value: str) -> str:
    try:
        return ids.check_id(kind, value)
    except ids.InvalidIdError as err:
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None


async def _valid(context: grpc.aio.ServicerContext, check: Callable[..., _T], *args: Any) -> _T:
    """``check(*args)``, its refusal sent as the RPC's status."""
    try:
        return check(*args)
    except Refusal as refusal:
        await _abort(context, refusal.code, refusal.message)


async def _answered(context: grpc.aio.ServicerContext, call: Awaitable[_T]) -> _T:
    try:
        return await call
    except Refusal as refusal:
        await _abort(context, refusal.code, refusal.message)


def _refused(request_id: int, code: grpc.StatusCode, message: str) -> opb.SessionResponse:
    return opb.SessionResponse(
        request_id=request_id, status_code=code.value[0], status_message=message
    )


class OrchestratorServicer(opb_grpc.TimeSliceOrchestratorServiceServicer):
    def __init__(self, *, groups: manager.GroupManager, bus: events.EventBus) -> None:
        self._groups = groups
        self._bus = bus
        #: Set when the orchestrator stops: Session streams end at once.
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End the long-lived Session streams (after the groups stopped)."""
        self._closing.set()

    def _driver(self, gid: str, *, create: bool = False) -> group.GroupDriver:
        driver = self._groups.get(gid, create=create)
        if driver is None:
            raise Refusal(grpc.StatusCode.NOT_FOUND, self._groups.not_found_message(gid))
        return driver

    async def Acquire(
        self, request: opb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireResponse:
        return await _answered(context, self.acquire(request))

    async def Yield(
        self, request: opb.YieldRequest, context: grpc.aio.ServicerContext
    ) -> opb.YieldResponse:
        return await _answered(context, self.yield_(request))

    async def Session(
        self,
        request_iterator: AsyncIterator[opb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[opb.SessionResponse]:
        async for reply in multiplex.serve(
            request_iterator,
            self._session_reply,
            request_id=lambda r: r.request_id,
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
            else:
                raise Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    "a Session request carries acquire, release or cancel",
                )
        except Refusal as refusal:
            return _refused(request.request_id, refusal.code, refusal.message)
        except Exception as err:
            # A unary call would end UNKNOWN; a Session request must not go unanswered.
            log.exception("session request %d failed", request.request_id)
            return _refused(
                request.request_id,
                grpc.StatusCode.INTERNAL,
                f"the orchestrator failed on this request ({type(err).__name__}: {err})",
            )
        return reply

    async def acquire(self, request: opb.AcquireRequest) -> opb.AcquireResponse:
        """One Acquire (unary or over a Session); raises :class:`Refusal`."""
        started = time.monotonic()
        job = _checked_id("job_id", request.job_id)
        gid = _checked_id("group_id", request.group_id)
        if request.footprint_bytes < 0:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"footprint_bytes must be >= 0 (got {request.footprint_bytes}); 0 = default",
            )
        if request.lease_ms < 0:
            raise Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms must be >= 0 (got {request.lease_ms}); 0 = no lease",
            )
        driver = self._driver(gid, create=True)
        try:
            grant = await driver.acquire(
                job, footprint_bytes=request.footprint_bytes, lease_ms=request.lease_ms
            )
        except group.ShuttingDown as err:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(err)) from err
        except group.AcquireAborted as err:
            raise Refusal(grpc.StatusCode[err.code], str(err)) from err
        return opb.AcquireResponse(
            success=True,
            waited_ms=int((time.monotonic() - started) * 1000),
            context_restored=grant.restored,
            grant_epoch=grant.epoch,
        )

    async def yield_(self, request: opb.YieldRequest) -> opb.YieldResponse:
        """One Yield (unary or over a Session); raises :class:`Refusal`."""
        job = _checked_id("job_id", request.job_id)
        gid = _checked_id("group_id", request.group_id)
        driver = self._driver(gid)
        try:
            out = await driver.yield_(job)
        except group.ShuttingDown as err:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, str(err)) from err
        if not out.ok:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"group {gid!r} is held by job {out.holder!r}, not {job!r}; "
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
        gid = await _valid(context, _checked_id, "group_id", request.group_id)
        driver = await _valid(context, self._driver, gid)
        return await driver.describe()

    async def ClearDegraded(
        self, request: opb.ClearDegradedRequest, context: grpc.aio.ServicerContext
    ) -> opb.ClearDegradedResponse:
        gid = await _valid(context, _checked_id, "group_id", request.group_id)
        driver = await _valid(context, self._driver, gid)
        node = request.node
        if node and node not in {n.name for n in driver.nodes}:
            known = ", ".join(n.name for n in driver.nodes)
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"node {node!r} is not in group {gid!r} (its nodes: {known})",
            )
        return opb.ClearDegradedResponse(cleared=await driver.clear_degraded(node))

    async def WatchEvents(
        self, request: opb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.OrchestratorEvent]:
        gid = request.group_id
        if gid:
            await _valid(context, _checked_id, "group_id", gid)
            if not self._groups.local:
                await _valid(context, self._driver, gid)
        sub = self._bus.subscribe(group_id=gid, kinds=frozenset(request.kinds))
        try:
            # Headers go out once subscribed: a client awaiting initial_metadata() then
            # knows that no later event will be missed.
            await context.send_initial_metadata(())
            async for event in sub:
                yield event
        finally:
            self._bus.unsubscribe(sub)

    async def Hold(
        self, request: opb.HoldRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.HoldEvent]:
        job = await _valid(context, _checked_id, "job_id", request.job_id)
        gid = await _valid(context, _checked_id, "group_id", request.group_id)
        if request.grant_epoch < 0:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"grant_epoch must be >= 0 (got {request.grant_epoch}); 0 = the current grant",
            )
        driver = await _valid(context, self._driver, gid)
        try:
            session = await driver.open_hold(job, epoch=request.grant_epoch)
        except group.ShuttingDown as err:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
        except group.NotHolder as err:
            await _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
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
                except group.ShuttingDown as err:
                    await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
                if lost:
                    yield opb.HoldEvent(lost=lost)
                else:
                    yield opb.HoldEvent(released=True)
                return
        finally:
            driver.close_hold(session)
