"""The llm-d-compatible path: Acquire and Yield as unary calls.

tslice's clients send both over one ``Session`` stream; an orchestrator without that
RPC (llm-d's, an older tslice) answers ``UNIMPLEMENTED``, the session raises
:class:`~tslice.common.multiplex.Unsupported`, and from then on the unary calls of
the wire contract carry them. This is the one place that decides between the two:
the session and the transport know nothing of the unary path, and the transport
retries, times and maps errors of either alike.

:class:`UnaryFallback` and :class:`SyncUnaryFallback` look like the generated stub's
methods (``(request, timeout=, metadata=)``, and ``future()`` for the sync one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from tslice.client import _channel
from tslice.common import multiplex

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
    """``call.future(request, timeout=, metadata=).result()``: over the session, else unary."""

    def __init__(
        self, session: Callable[[Req, float | None], Rep], unary: _channel.SyncUnary[Req, Rep]
    ) -> None:
        self._session = session
        self._unary = unary

    def future(
        self, request: Req, *, timeout: float | None = None, metadata: Metadata = None
    ) -> _Outcome[Req, Rep]:
        return _Outcome(self, request, timeout, metadata)


@dataclasses.dataclass
class _Outcome(Generic[Req, Rep]):
    """What the sync transport waits on: ``result()``, and ``cancel()`` on an interrupt
    (the session abandons its own request when its wait is interrupted)."""

    call: SyncUnaryFallback[Req, Rep]
    request: Req
    timeout: float | None
    metadata: Metadata
    _unary: _channel.Outcome[Rep] | None = None

    def result(self) -> Rep:
        try:
            return self.call._session(self.request, self.timeout)
        except multiplex.Unsupported:
            self._unary = self.call._unary.future(
                self.request, timeout=self.timeout, metadata=self.metadata
            )
            return self._unary.result()

    def cancel(self) -> None:
        if self._unary is not None:
            self._unary.cancel()
