"""Request ids on a multiplexed stream are unique among the requests in flight.

:func:`tslice.rpc.multiplex.serve` keys the requests it runs by their id; a caller
that sends a second request with the id of one still running would make the first
unreachable (its cancel, and the end of the stream, would reach only the second), so
an Acquire could outlive its stream as a ghost waiter and later become a holder with
no client. :func:`serve` here answers such a second request at once with the
caller's refusal (``duplicate``) and never runs it; the first goes on. An id may be
used again once its request was answered or cancelled.

Inside, every request gets a key of its own for ``multiplex.serve``: the caller's id
only routes its cancel messages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from tslice.rpc import multiplex

Req = TypeVar("Req")
Rep = TypeVar("Rep")


@dataclasses.dataclass(frozen=True)
class _Incoming(Generic[Req]):
    #: Unique on the stream (``multiplex.serve`` runs and cancels requests by it).
    key: int
    request_id: int
    request: Req
    #: Its id was in flight already: answered with the refusal, not run.
    duplicate: bool = False


async def serve(
    requests: AsyncIterator[Req],
    handle: Callable[[Req], Awaitable[Rep]],
    *,
    request_id: Callable[[Req], int],
    duplicate: Callable[[Req], Rep],
    is_cancel: Callable[[Req], bool] = lambda _request: False,
    name: str,
    closing: asyncio.Event | None = None,
) -> AsyncIterator[Rep]:
    """``multiplex.serve`` with ids unique among the requests in flight (see above)."""
    in_flight: dict[int, int] = {}  # the caller's id -> the key of its running request
    keys = itertools.count(1)

    async def incoming() -> AsyncIterator[_Incoming[Req]]:
        async for request in requests:
            rid = request_id(request)
            if is_cancel(request):
                key = in_flight.pop(rid, None)
                if key is not None:  # a cancel of nothing in flight changes nothing
                    yield _Incoming(key, rid, request)
                continue
            key = next(keys)
            if rid in in_flight:
                yield _Incoming(key, rid, request, duplicate=True)
                continue
            in_flight[rid] = key
            yield _Incoming(key, rid, request)

    async def run(item: _Incoming[Req]) -> Rep:
        if item.duplicate:
            return duplicate(item.request)
        try:
            return await handle(item.request)
        finally:
            if in_flight.get(item.request_id) == item.key:
                del in_flight[item.request_id]

    async for reply in multiplex.serve(
        incoming(),
        run,
        request_id=lambda item: item.key,
        is_cancel=lambda item: is_cancel(item.request),
        name=name,
        closing=closing,
    ):
        yield reply


def duplicate_message(request_id: int) -> str:
    return (
        f"request_id {request_id} is already in flight on this stream; give every request "
        "a new id (an id may be used again once its request was answered)"
    )
