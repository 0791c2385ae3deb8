"""Acquire and Yield of the clients over the orchestrator's ``Session`` stream (see
:mod:`tslice.common.multiplex`): :class:`Session` for ``AsyncClient``, :class:`SyncSession`
(the stream read by a daemon thread) for ``Client``.

They are the first and last legs of every hand-over; a message on an open stream
costs about half a unary call. :class:`Session` offers the two calls with the
signature of the generated stub's methods (``request, timeout=, metadata=``) and
raises ``grpc.RpcError`` as they do, so the transport's retry and error mapping apply
unchanged (the sync twin offers the stub methods' ``future()``). A timed-out or
cancelled Acquire sends ``cancel`` (the job leaves the queue
at once, as when a unary call is cancelled); a broken stream fails the calls in flight
with ``UNAVAILABLE`` and the next call opens a new one. An orchestrator without the RPC
(llm-d's, an older tslice) gets the unary calls.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import multiplex


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Session:
    def __init__(self, stub: Any, *, metadata: Sequence[tuple[str, str]]) -> None:
        self._stub = stub
        self._caller: multiplex.Caller[opb.SessionRequest, opb.SessionResponse] = multiplex.Caller(
            lambda: stub.Session(metadata=tuple(metadata)),
            reply_id=lambda r: r.request_id,
            name="the orchestrator",
        )

    async def acquire(
        self, request: opb.AcquireRequest, *, timeout: float | None = None, metadata: Any = None
    ) -> opb.AcquireResponse:
        reply = await self._call(
            lambda rid: opb.SessionRequest(request_id=rid, acquire=request),
            lambda: self._stub.Acquire(request, timeout=timeout, metadata=metadata),
            timeout,
            cancellable=True,
        )
        return reply if isinstance(reply, opb.AcquireResponse) else reply.acquire

    async def yield_(
        self, request: opb.YieldRequest, *, timeout: float | None = None, metadata: Any = None
    ) -> opb.YieldResponse:
        reply = await self._call(
            lambda rid: opb.SessionRequest(request_id=rid, release=request),
            lambda: self._stub.Yield(request, timeout=timeout, metadata=metadata),
            timeout,
            cancellable=False,
        )
        return reply if isinstance(reply, opb.YieldResponse) else reply.release

    async def close(self) -> None:
        await self._caller.close()

    async def _call(
        self,
        request: Callable[[int], opb.SessionRequest],
        unary: Callable[[], Any],
        timeout: float | None,
        *,
        cancellable: bool,
    ) -> Any:
        if self._caller.supported is not False:
            try:
                reply = await self._caller.call(
                    request,
                    timeout_s=timeout,
                    abandon=(
                        (lambda rid: opb.SessionRequest(request_id=rid, cancel=True))
                        if cancellable
                        else None
                    ),
                )
            except multiplex.Unsupported:
                pass  # the unary call below
            except multiplex.Broken as err:
                raise _rpc_error(err.code, err.detail) from err
            except TimeoutError as err:
                raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from err
            else:
                if reply.status_code:
                    code = multiplex.status_code(reply.status_code)
                    raise _rpc_error(code, reply.status_message)
                return reply
        return await unary()


class _Reply:
    """What ``call.future()`` returns in the sync transport: ``result()`` and ``cancel()``."""

    def __init__(self, session: SyncSession, request_id: int, timeout: float | None) -> None:
        self._session = session
        self._id = request_id
        self._timeout = timeout
        self.future: concurrent.futures.Future[opb.SessionResponse] = concurrent.futures.Future()

    def result(self) -> opb.SessionResponse:
        try:
            reply = self.future.result(self._timeout)
        except concurrent.futures.TimeoutError as err:
            self.cancel()
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from err
        finally:
            self._session._forget(self._id)
        if reply.status_code:
            raise _rpc_error(multiplex.status_code(reply.status_code), reply.status_message)
        return reply

    def cancel(self) -> None:
        self._session._abandon(self._id)


class SyncSession:
    """The sync client's :class:`Session`: the stream is read by a daemon thread, and each
    call's ``future(request, timeout=, metadata=)`` behaves as the stub's does."""

    def __init__(self, stub: Any, *, metadata: Sequence[tuple[str, str]]) -> None:
        self._stub = stub
        self._metadata = tuple(metadata)
        self._guard = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Reply] = {}
        self._cancellable: set[int] = set()
        self._outbox: queue.SimpleQueue[opb.SessionRequest | None] | None = None
        self._call: Any = None
        #: None until the orchestrator answered (or refused the RPC) once.
        self.supported: bool | None = None
        self.acquire = _Method(self, "acquire", stub.Acquire, cancellable=True)
        self.yield_ = _Method(self, "release", stub.Yield, cancellable=False)

    def close(self) -> None:
        with self._guard:
            call, self._call, self._outbox = self._call, None, None
        if call is not None:
            call.cancel()  # the orchestrator drops what this client still waits for

    def start(self, field: str, request: Any, timeout: float | None, cancellable: bool) -> _Reply:
        with self._guard:
            outbox = self._ensure_open()
            request_id = next(self._ids)
            reply = _Reply(self, request_id, timeout)
            self._pending[request_id] = reply
            if cancellable:
                self._cancellable.add(request_id)
        outbox.put(opb.SessionRequest(request_id=request_id, **{field: request}))
        return reply

    def _ensure_open(self) -> queue.SimpleQueue[opb.SessionRequest | None]:
        if self._outbox is None:
            outbox: queue.SimpleQueue[opb.SessionRequest | None] = queue.SimpleQueue()
            call = self._stub.Session(_drain(outbox), metadata=self._metadata)
            self._outbox, self._call = outbox, call
            threading.Thread(
                target=self._read, args=(call, outbox), name="tslice-session", daemon=True
            ).start()
        return self._outbox

    def _read(self, call: Any, outbox: queue.SimpleQueue[opb.SessionRequest | None]) -> None:
        code, detail = grpc.StatusCode.UNAVAILABLE, "the orchestrator closed the stream"
        try:
            for reply in call:
                self.supported = True
                with self._guard:
                    waiter = self._pending.get(reply.request_id)
                if waiter is not None and not waiter.future.done():
                    waiter.future.set_result(reply)
        except grpc.RpcError as err:
            code, detail = err.code(), err.details() or err.code().name.lower()
        outbox.put(None)  # ends the request iterator
        with self._guard:
            if self._call is call:
                self._call = self._outbox = None
            waiters = list(self._pending.values())
        failure: Exception
        if multiplex.unusable(code, worked=self.supported):
            self.supported = False
            failure = multiplex.Unsupported("the orchestrator")
        else:
            failure = _rpc_error(code, detail)
        for waiter in waiters:
            if not waiter.future.done():
                waiter.future.set_exception(failure)

    def _forget(self, request_id: int) -> None:
        with self._guard:
            self._pending.pop(request_id, None)
            self._cancellable.discard(request_id)

    def _abandon(self, request_id: int) -> None:
        with self._guard:
            cancellable = request_id in self._cancellable
            outbox = self._outbox
        if cancellable and outbox is not None:
            outbox.put(opb.SessionRequest(request_id=request_id, cancel=True))
        self._forget(request_id)


class _Method:
    """``session.acquire`` / ``session.yield_`` with the stub method's ``future()``."""

    def __init__(self, session: SyncSession, field: str, unary: Any, *, cancellable: bool):
        self._session = session
        self._field = field
        self._unary = unary
        self._cancellable = cancellable

    def future(self, request: Any, *, timeout: float | None = None, metadata: Any = None) -> Any:
        if self._session.supported is False:
            return self._unary.future(request, timeout=timeout, metadata=metadata)
        return _Unwrap(
            self._session.start(self._field, request, timeout, self._cancellable),
            self._field,
            lambda: self._unary.future(request, timeout=timeout, metadata=metadata),
        )


class _Unwrap:
    """The typed reply of a session call; the unary call if the session turns out missing."""

    def __init__(self, reply: _Reply, field: str, unary: Callable[[], Any]) -> None:
        self._reply = reply
        self._field = field
        self._unary = unary
        self._fallback: Any = None

    def result(self) -> Any:
        try:
            return getattr(self._reply.result(), self._field)
        except multiplex.Unsupported:
            self._fallback = self._unary()
            return self._fallback.result()

    def cancel(self) -> None:
        if self._fallback is not None:
            self._fallback.cancel()
        else:
            self._reply.cancel()


def _drain(
    outbox: queue.SimpleQueue[opb.SessionRequest | None],
) -> Iterator[opb.SessionRequest]:
    while (request := outbox.get()) is not None:
        yield request
