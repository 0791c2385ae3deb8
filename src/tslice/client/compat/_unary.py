"""The llm-d-compatible path: Acquire and Yield as unary calls.

tslice's clients send both over one ``Session`` stream; an orchestrator without that
RPC (llm-d's, an older tslice) answers ``UNIMPLEMENTED``, the session raises
:class:`~tslice.rpc.multiplex.Unsupported`, and from then on the unary calls of
the wire contract carry them. This is the one place that decides between the two:
the session and the transport know nothing of the unary path, and the transport
retries, times and maps errors of either alike.

:class:`UnaryFallback` and :class:`SyncUnaryFallback` look like the generated stub's
methods (``(request, timeout=, metadata=)``, and ``future()`` for the sync one).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from tslice.client import _channel
from tslice.rpc import multiplex

Req = TypeVar("Req")
Rep = TypeVar("Rep")

Metadata = _channel.Metadata | None


class UnaryFallback(Generic[Req, Rep]):
    """``await call(request, timeout=, metadata=)``: over the session, else unary."""

    def __init__(
        self,
        session: Callable[[Req, float | None], Awaitable[Rep]],
        unary: _channel.AsyncUnary[Req, Rep],
    ) -> None:
        self._session = session
        self._unary = unary

    async def __call__(
        self, request: Req, *, timeout: float | None = None, metadata: Metadata = None
    ) -> Rep:
        try:
            return await self._session(request, timeout)
        except multiplex.Unsupported:
            return await self._unary(request, timeout=timeout, metadata=metadata)


class SyncUnaryFallback(Generic[Req, Rep]):
    """``call.future(request, timeout=, metadata=).result()``: over the session, else unary.

    ``session`` None: always unary (an RPC the Session stream does not carry), still
    started so that an interrupt finds it (see :class:`_Outcome`).
    """

    def __init__(
        self,
        session: Callable[[Req, float | None], Rep] | None,
        unary: _channel.SyncUnary[Req, Rep],
    ) -> None:
        self._session = session
        self._unary = unary

    def future(
        self, request: Req, *, timeout: float | None = None, metadata: Metadata = None
    ) -> _Outcome[Req, Rep]:
        return _Outcome(self, request, timeout, metadata)


#: How long the waiting thread blocks at a time: an interrupt is held back while it waits
#: in C, and must land in Python (inside the transport's try) to cancel the call.
_INTERRUPTIBLE_S = 0.05


@dataclasses.dataclass
class _Outcome(Generic[Req, Rep]):
    """What the sync transport waits on: ``result()``, and ``cancel()`` on an interrupt
    (the session abandons its own request when its wait is interrupted).

    An interrupt (Ctrl-C, raised in the waiting thread at whatever bytecode it is on)
    must always find the unary call it interrupts: grpc's ``future()`` returns the call
    only after sending it, so an interrupt landing in between lost the call and left the
    job queued on the orchestrator as a ghost waiter. The call is therefore started by a
    helper thread, which hands it over under a lock and cancels it itself when
    ``cancel()`` came first; the waiting thread only waits.
    """

    call: SyncUnaryFallback[Req, Rep]
    request: Req
    timeout: float | None
    metadata: Metadata
    _unary: _channel.Outcome[Rep] | None = None
    _start_error: BaseException | None = None
    _cancelled: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _started: threading.Event = dataclasses.field(default_factory=threading.Event)

    def result(self) -> Rep:
        session = self.call._session
        if session is not None:
            try:
                return session(self.request, self.timeout)
            except multiplex.Unsupported:
                pass
        threading.Thread(target=self._start, name="tslice-unary-call", daemon=True).start()
        while not self._started.wait(_INTERRUPTIBLE_S):
            pass
        if self._start_error is not None:
            raise self._start_error
        assert self._unary is not None
        return self._unary.result()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            unary = self._unary
        if unary is not None:
            unary.cancel()

    def _start(self) -> None:
        """(helper thread) Send the call and hand it over; cancel it if already given up."""
        try:
            unary = self.call._unary.future(
                self.request, timeout=self.timeout, metadata=self.metadata
            )
        except BaseException as err:  # handed to the waiting thread, raised there
            self._start_error = err
            self._started.set()
            return
        with self._lock:
            self._unary = unary
            cancelled = self._cancelled
        if cancelled:
            unary.cancel()
        self._started.set()
