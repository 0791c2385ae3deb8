"""Acquire and Yield over the orchestrator's ``Session`` stream (see
:mod:`tslice.rpc.multiplex`): :class:`Session` for ``AsyncClient`` (a
:class:`~tslice.rpc.multiplex.Caller`), :class:`SyncSession` for ``Client`` (its
blocking twin, :class:`~tslice.rpc.multiplex.ThreadCaller`: one reader thread per
stream, none per call).

They are the first and last legs of every hand-over; a message on an open stream
costs about half a unary call. Their methods are shaped like the generated stub's
(``acquire(request, timeout=, metadata=)``; the sync ones through ``future()``), so
the transport times, retries and maps them as it does a unary call: a call raises
``grpc.RpcError`` as a unary call would. A timed-out or cancelled Acquire sends
``cancel`` (the job leaves the queue at once, as when a unary call is cancelled); a
broken stream fails the calls in flight with ``UNAVAILABLE`` and the next call opens a
new one, at the address the transport moved on to. An orchestrator without the RPC
makes the first call raise :class:`~tslice.rpc.multiplex.Unsupported`: the channel's
calls object (:mod:`tslice.client._services`) then takes llm-d's unary calls for good.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc
import grpc.aio

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _channel, _failover
from tslice.rpc import multiplex

Req = TypeVar("Req")
R = TypeVar("R")

_NAME = "the orchestrator"
_METHOD = "/timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService/Session"
_REQUEST_ID: Callable[[opb.SessionResponse], int] = operator.attrgetter("request_id")
_Message = Callable[[int], opb.SessionRequest]


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _cancel(request_id: int) -> opb.SessionRequest:
    return opb.SessionRequest(request_id=request_id, cancel=True)


def _acquire(request: opb.AcquireRequest, timeout: float | None) -> _Message:
    # A stream has no per-request deadline: the request carries the time left, so that the
    # orchestrator can answer one a fault holds back with the reason before it runs out.
    if timeout is not None:
        timed = opb.AcquireRequest()
        timed.CopyFrom(request)
        timed.timeout_ms = max(1, int(timeout * 1000))
        request = timed
    return lambda request_id: opb.SessionRequest(request_id=request_id, acquire=request)


def _release(request: opb.YieldRequest) -> _Message:
    return lambda request_id: opb.SessionRequest(request_id=request_id, release=request)


_AS_IT_CAME = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.UNIMPLEMENTED})


def _broken(err: multiplex.Broken) -> grpc.aio.AioRpcError:
    """A stream that ended before the reply: UNAVAILABLE (re-issued on a new stream, as
    Acquire and Yield may be), whatever code the connection's end came with (a peer
    killed mid-write may end it INTERNAL); CANCELLED stays (the client closed it), and so
    does UNIMPLEMENTED (no retry makes a server that lost the RPC have it again)."""
    if err.code in _AS_IT_CAME:
        return _rpc_error(err.code, err.detail)
    return _rpc_error(
        grpc.StatusCode.UNAVAILABLE, f"the Session stream broke ({err.code.name}: {err.detail})"
    )


def _timed_out() -> grpc.aio.AioRpcError:
    return _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")


def _answer(reply: opb.SessionResponse) -> opb.SessionResponse:
    """The reply, or its status raised as a unary call would raise it."""
    if reply.status_code:
        raise _rpc_error(multiplex.status_code(reply.status_code), reply.status_message)
    return reply


class _Stream:
    """Where the Session stream is opened, and who hears how it failed (the transport:
    the next call goes to the address it moves on to)."""

    def __init__(self, transport: _channel.SyncTransport | _channel.AsyncTransport) -> None:
        self._transport = transport
        self._open_method = _failover.unwatched(
            transport.channel,
            "stream_stream",
            _METHOD,
            opb.SessionRequest.SerializeToString,
            opb.SessionResponse.FromString,
        )
        self._used = ""

    def open(self, *requests: Any) -> Any:
        self._used = self._transport.where()
        metadata = self._transport.metadata(_channel.NO_OPTIONS)
        return self._open_method(*requests, metadata=metadata)

    def failed(self, err: grpc.RpcError) -> None:
        self._transport.stream_failed(self._used, err)


class Session:
    """``acquire``/``yield_`` over one Session stream (``grpc.aio``)."""

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        stream = _Stream(transport)
        self._caller: multiplex.Caller[opb.SessionRequest, opb.SessionResponse] = multiplex.Caller(
            stream.open, reply_id=_REQUEST_ID, name=_NAME, failed=stream.failed
        )

    async def acquire(
        self, request: opb.AcquireRequest, *, timeout: float | None = None, metadata: object = None
    ) -> opb.AcquireResponse:
        try:
            reply = await self._caller.call(
                _acquire(request, timeout), timeout_s=timeout, abandon=_cancel
            )
        except multiplex.Broken as err:
            raise _broken(err) from err
        except TimeoutError as err:
            raise _timed_out() from err
        return _answer(reply).acquire

    async def yield_(
        self, request: opb.YieldRequest, *, timeout: float | None = None, metadata: object = None
    ) -> opb.YieldResponse:
        # (The twin of acquire, not a shared helper: a hand-over's calls stay few.)
        try:
            reply = await self._caller.call(_release(request), timeout_s=timeout)
        except multiplex.Broken as err:
            raise _broken(err) from err
        except TimeoutError as err:
            raise _timed_out() from err
        return _answer(reply).release

    async def close(self) -> None:
        await self._caller.close()


class SyncSession:
    """Blocking twin of :class:`Session`; ``acquire.future(...)`` and ``yield_.future(...)``
    as the sync stub's methods (``result()`` makes the call)."""

    def __init__(self, transport: _channel.SyncTransport) -> None:
        stream = _Stream(transport)
        self._caller: multiplex.ThreadCaller[opb.SessionRequest, opb.SessionResponse] = (
            multiplex.ThreadCaller(
                stream.open, reply_id=_REQUEST_ID, name=_NAME, failed=stream.failed
            )
        )
        self.acquire: Blocking[opb.AcquireRequest, opb.AcquireResponse] = Blocking(
            lambda request, timeout: (
                self._call(_acquire(request, timeout), _cancel, timeout).acquire
            )
        )
        self.yield_: Blocking[opb.YieldRequest, opb.YieldResponse] = Blocking(
            lambda request, timeout: self._call(_release(request), None, timeout).release
        )

    def close(self) -> None:
        self._caller.close()

    def _call(
        self, message: _Message, abandon: _Message | None, timeout: float | None
    ) -> opb.SessionResponse:
        try:
            reply = self._caller.call(message, timeout_s=timeout, abandon=abandon)
        except multiplex.Broken as err:
            raise _broken(err) from err
        except TimeoutError as err:
            raise _timed_out() from err
        return _answer(reply)


class Blocking(Generic[Req, R]):
    """A blocking call shaped like a sync stub method: ``future(request, timeout=,
    metadata=)`` whose ``result()`` makes it (the session abandons its own request when
    the wait is interrupted, so ``cancel()`` has nothing left to do)."""

    def __init__(self, call: Callable[[Req, float | None], R]) -> None:
        self._call = call

    def future(
        self, request: Req, *, timeout: float | None = None, metadata: object = None
    ) -> Later[R]:
        return Later(lambda: self._call(request, timeout))


@dataclasses.dataclass
class Later(Generic[R]):
    """A blocking call made by ``result()``, shaped like the future of a sync stub call."""

    make: Callable[[], R]

    def result(self) -> R:
        return self.make()

    def cancel(self) -> None:
        pass
