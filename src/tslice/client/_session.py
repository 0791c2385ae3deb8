"""Acquire and Yield of the clients over the orchestrator's ``Session`` stream (see
:mod:`tslice.rpc.multiplex`): :class:`Session` for ``AsyncClient`` (a
:class:`~tslice.rpc.multiplex.Caller`), :class:`SyncSession` for ``Client`` (its
blocking twin, :class:`~tslice.rpc.multiplex.ThreadCaller`).

They are the first and last legs of every hand-over; a message on an open stream
costs about half a unary call. A call raises ``grpc.RpcError`` as a unary call would
(so the transport's retry and error mapping apply unchanged): a timed-out or
cancelled Acquire sends ``cancel`` (the job leaves the queue at once, as when a unary
call is cancelled); a broken stream fails the calls in flight with ``UNAVAILABLE``
and the next call opens a new one. An orchestrator without the RPC makes a call
raise :class:`~tslice.rpc.multiplex.Unsupported`:
:mod:`tslice.client.compat._unary` then makes the unary call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

import grpc
import grpc.aio

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.rpc import multiplex

R = TypeVar("R")

_NAME = "the orchestrator"


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _request_id(reply: opb.SessionResponse) -> int:
    return reply.request_id


def _cancel(request_id: int) -> opb.SessionRequest:
    return opb.SessionRequest(request_id=request_id, cancel=True)


@dataclasses.dataclass(frozen=True)
class _Call(Generic[R]):
    """One kind of call over the stream: its message, what ends it early, its reply."""

    message: Callable[[int], opb.SessionRequest]
    #: Sent when the caller gives up on the call (``None``: nothing to take back).
    abandon: Callable[[int], opb.SessionRequest] | None
    payload: Callable[[opb.SessionResponse], R]

    def reply(self, response: opb.SessionResponse) -> R:
        """The payload, or the reply's status raised as a unary call would raise it."""
        if response.status_code:
            raise _rpc_error(multiplex.status_code(response.status_code), response.status_message)
        return self.payload(response)


def _acquire(request: opb.AcquireRequest, timeout: float | None) -> _Call[opb.AcquireResponse]:
    # A stream has no per-request deadline: the request carries the time left, so that the
    # orchestrator can answer one a fault holds back with the reason before it runs out.
    if timeout is not None:
        timed = opb.AcquireRequest()
        timed.CopyFrom(request)
        timed.timeout_ms = max(1, int(timeout * 1000))
        request = timed
    return _Call(
        message=lambda request_id: opb.SessionRequest(request_id=request_id, acquire=request),
        abandon=_cancel,
        payload=lambda response: response.acquire,
    )


def _release(request: opb.YieldRequest) -> _Call[opb.YieldResponse]:
    return _Call(
        message=lambda request_id: opb.SessionRequest(request_id=request_id, release=request),
        abandon=None,
        payload=lambda response: response.release,
    )


@contextlib.contextmanager
def _as_unary_errors() -> Iterator[None]:
    """A broken stream or an expired deadline fails the call as a unary call would."""
    try:
        yield
    except multiplex.Broken as err:
        raise _rpc_error(err.code, err.detail) from err
    except TimeoutError as err:
        raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from err


class Session:
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
        return await self._call(_acquire(request, timeout), timeout)

    async def yield_(self, request: opb.YieldRequest, timeout: float | None) -> opb.YieldResponse:
        return await self._call(_release(request), timeout)

    async def close(self) -> None:
        await self._caller.close()

    async def _call(self, call: _Call[R], timeout: float | None) -> R:
        with _as_unary_errors():
            reply = await self._caller.call(call.message, timeout_s=timeout, abandon=call.abandon)
        return call.reply(reply)


class SyncSession:
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
        return self._call(_acquire(request, timeout), timeout)

    def yield_(self, request: opb.YieldRequest, timeout: float | None) -> opb.YieldResponse:
        return self._call(_release(request), timeout)

    def close(self) -> None:
        self._caller.close()

    def _call(self, call: _Call[R], timeout: float | None) -> R:
        with _as_unary_errors():
            reply = self._caller.call(call.message, timeout_s=timeout, abandon=call.abandon)
        return call.reply(reply)
