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
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import ids
from tslice.orchestrator import events, group, manager


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, msg: str) -> NoReturn:
    await context.abort(code, msg)
    raise AssertionError("unreachable")  # context.abort always raises


async def _valid_id(context: grpc.aio.ServicerContext, kind: str, value: str) -> str:
    try:
        return ids.check_id(kind, value)
    except ids.InvalidIdError as err:
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))


class OrchestratorServicer(opb_grpc.TimeSliceOrchestratorServiceServicer):
    def __init__(self, *, groups: manager.GroupManager, bus: events.EventBus) -> None:
        self._groups = groups
        self._bus = bus

    async def _group(
        self, context: grpc.aio.ServicerContext, gid: str, *, create: bool = False
    ) -> group.GroupDriver:
        driver = self._groups.get(gid, create=create)
        if driver is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, self._groups.not_found_message(gid))
        return driver

    async def Acquire(
        self, request: opb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireResponse:
        started = time.monotonic()
        job = await _valid_id(context, "job_id", request.job_id)
        gid = await _valid_id(context, "group_id", request.group_id)
        if request.footprint_bytes < 0:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"footprint_bytes must be >= 0 (got {request.footprint_bytes}); 0 = default",
            )
        if request.lease_ms < 0:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lease_ms must be >= 0 (got {request.lease_ms}); 0 = no lease",
            )
        driver = await self._group(context, gid, create=True)
        try:
            grant = await driver.acquire(
                job, footprint_bytes=request.footprint_bytes, lease_ms=request.lease_ms
            )
        except group.ShuttingDown as err:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
        except group.AcquireAborted as err:
            await _abort(context, grpc.StatusCode.ABORTED, str(err))
        return opb.AcquireResponse(
            success=True,
            waited_ms=int((time.monotonic() - started) * 1000),
            context_restored=grant.restored,
            grant_epoch=grant.epoch,
        )

    async def Yield(
        self, request: opb.YieldRequest, context: grpc.aio.ServicerContext
    ) -> opb.YieldResponse:
        job = await _valid_id(context, "job_id", request.job_id)
        gid = await _valid_id(context, "group_id", request.group_id)
        driver = await self._group(context, gid)
        try:
            out = await driver.yield_(job)
        except group.ShuttingDown as err:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
        if not out.ok:
            await _abort(
                context,
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
        gid = await _valid_id(context, "group_id", request.group_id)
        driver = await self._group(context, gid)
        return await driver.describe()

    async def WatchEvents(
        self, request: opb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.OrchestratorEvent]:
        gid = request.group_id
        if gid:
            await _valid_id(context, "group_id", gid)
            if not self._groups.local:
                await self._group(context, gid)
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
        job = await _valid_id(context, "job_id", request.job_id)
        gid = await _valid_id(context, "group_id", request.group_id)
        if request.grant_epoch < 0:
            await _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"grant_epoch must be >= 0 (got {request.grant_epoch}); 0 = the current grant",
            )
        driver = await self._group(context, gid)
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
