"""Acquire and Yield of the clients over the orchestrator's ``Session`` stream (see
:mod:`tslice.common.multiplex`): :class:`Session` for ``AsyncClient`` (a
:class:`~tslice.common.multiplex.Caller`), :class:`SyncSession` for ``Client`` (its
blocking twin, :class:`~tslice.common.multiplex.ThreadCaller`).

They are the first and last legs of every hand-over; a message on an open stream
costs about half a unary call. A call raises ``grpc.RpcError`` as a unary call would
(so the transport's retry and error mapping apply unchanged): a timed-out or
cancelled Acquire sends ``cancel`` (the job leaves the queue at once, as when a unary
call is cancelled); a broken stream fails the calls in flight with ``UNAVAILABLE``
and the next call opens a new one. An orchestrator without the RPC makes a call
raise :class:`~tslice.common.multiplex.Unsupported`:
:mod:`tslice.client.compat._unary` then makes the unary call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc
import grpc.aio

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.common import multiplex

R = TypeVar("R")

_NAME = "the orchestrator"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _request_id(reply: opb.SessionResponse) -> int:
    return reply.request_id


def _cancel(request_id: int) -> opb.SessionRequest:
    return opb.SessionRequest(request_id=request_id, cancel=True)


def _acquire(request: opb.AcquireRequest) -> Callable[[int], opb.SessionRequest]:
    return lambda request_id: opb.SessionRequest(request_id=request_id, acquire=request)


def _release(request: opb.YieldRequest) -> Callable[[int], opb.SessionRequest]:
    return lambda request_id: opb.SessionRequest(request_id=request_id, release=request)


class _Replies:
    """How both twins read a call's outcome: the reply's status, else its payload."""

    @staticmethod
    def unwrap(reply: opb.SessionResponse, payload: Callable[[opb.SessionResponse], R]) -> R:
        if reply.status_code:
            raise _rpc_error(multiplex.status_code(reply.status_code), reply.status_message)
        return payload(reply)

    @staticmethod
    def failed(err: multiplex.Broken | TimeoutError) -> grpc.aio.AioRpcError:
        """A broken stream or an expired deadline, as a unary call would fail."""
        if isinstance(err, multiplex.Broken):
            return _rpc_error(err.code, err.detail)
        return _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


class Session(_Replies):
    """``acquire``/``yield_`` over one Session stream (``grpc.aio``)."""

    def __init__(
        self,
        stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub,
        *,
        metadata: Sequence[tuple[str, str]],
    ) -> None:
        self._caller: multiplex.Caller[opb.SessionRequest, opb.SessionResponse] = multiplex.Caller(
            lambda: stub.Session(metadata=tuple(metadata)), reply_id=_request_id, name=_NAME
        )

    async def acquire(
        self, request: opb.AcquireRequest, timeout: float | None
    ) -> opb.AcquireResponse:
        reply = await self._call(_acquire(request), timeout, abandon=_cancel)
        return self.unwrap(reply, lambda r: r.acquire)

    async def yield_(self, request: opb.YieldRequest, timeout: float | None) -> opb.YieldResponse:
        reply = await self._call(_release(request), timeout, abandon=None)
        return self.unwrap(reply, lambda r: r.release)

    async def close(self) -> None:
        await self._caller.close()

    async def _call(
        self,
        message: Callable[[int], opb.SessionRequest],
        timeout: float | None,
        *,
        abandon: Callable[[int], opb.SessionRequest] | None,
    ) -> opb.SessionResponse:
        try:
            return await self._caller.call(message, timeout_s=timeout, abandon=abandon)
        except (multiplex.Broken, TimeoutError) as err:
            raise self.failed(err) from err


class SyncSession(_Replies):
    """Blocking twin of :class:`Session` (the stream is read by a daemon thread)."""

    def __init__(
        self,
        stub: opb_grpc.TimeSliceOrchestratorServiceStub,
        *,
        metadata: Sequence[tuple[str, str]],
    ) -> None:
        def open_call(
            requests: Iterator[opb.SessionRequest],
        ) -> Iterator[opb.SessionResponse]:
            return stub.Session(requests, metadata=tuple(metadata))

        self._caller: multiplex.ThreadCaller[opb.SessionRequest, opb.SessionResponse] = (
            multiplex.ThreadCaller(open_call, reply_id=_request_id, name=_NAME)
        )

    def acquire(self, request: opb.AcquireRequest, timeout: float | None) -> opb.AcquireResponse:
        reply = self._call(_acquire(request), timeout, abandon=_cancel)
        return self.unwrap(reply, lambda r: r.acquire)

    def yield_(self, request: opb.YieldRequest, timeout: float | None) -> opb.YieldResponse:
        reply = self._call(_release(request), timeout, abandon=None)
        return self.unwrap(reply, lambda r: r.release)

    def close(self) -> None:
        self._caller.close()

    def _call(
        self,
        message: Callable[[int], opb.SessionRequest],
        timeout: float | None,
        *,
        abandon: Callable[[int], opb.SessionRequest] | None,
    ) -> opb.SessionResponse:
        try:
            return self._caller.call(message, timeout_s=timeout, abandon=abandon)
        except (multiplex.Broken, TimeoutError) as err:
            raise self.failed(err) from err
