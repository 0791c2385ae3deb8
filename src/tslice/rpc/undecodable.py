"""Requests that are not the message their method takes: refused with INVALID_ARGUMENT.

gRPC parses a request before the servicer sees it; bytes that do not parse end a unary
call UNKNOWN ("Unexpected DecodeError", with a traceback in the server's log) and end a
stream OK, silently, as if every request had been answered. This interceptor makes
every method of a server (the health service's too) parse its own requests, so that a
caller whose bytes do not parse is told so with INVALID_ARGUMENT, naming the type it
must send; nothing of the bytes is echoed. A stream ends at the first request that
does not parse (what it asked before is answered first).

The two streams a hand-over travels (``Session``, ``GrantStream``) parse their own
requests, in :func:`tslice.rpc.multiplex.serve`'s reader, with the same refusal: they are
marked :func:`parses_own_requests`, and this interceptor only hands them the raw bytes.
That spares every message on them a generator layer of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import message

_Parse = Callable[[bytes], Any]
_Method = TypeVar("_Method", bound=Callable[..., Any])


def parses_own_requests(method: _Method) -> _Method:
    """Mark a servicer's stream method that parses its requests itself (through
    ``multiplex.serve(parse=...)``): the interceptor gives it raw bytes, unwrapped."""
    method.parses_own_requests = True  # type: ignore[attr-defined]
    return method


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Refuse a request that does not parse with INVALID_ARGUMENT (see the module doc)."""

    def __init__(self) -> None:
        # One wrapper per method (the servicers' handlers do not change): no work per call.
        self._wrappers: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        handler = await continuation(details)
        method = str(details.method)
        known = self._wrappers.get(method)
        if known is None or known[0] is not handler:
            known = (handler, _parsing(handler, method))
            self._wrappers[method] = known
        return known[1]


def _parsing(handler: Any, method: str) -> Any:
    """``handler`` taking raw bytes and parsing them itself (unchanged: no handler, or
    one that takes raw bytes already)."""
    parse = getattr(handler, "request_deserializer", None)
    if handler is None or parse is None or not hasattr(handler, "_replace"):
        return handler
    wrapped: dict[str, Any] = {"request_deserializer": None}
    if getattr(handler.stream_stream, "parses_own_requests", False):
        return handler._replace(**wrapped)
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behaviour = getattr(handler, kind)
        if behaviour is not None:
            wrap = _streamed if kind.startswith("stream") else _single
            wrapped[kind] = wrap(behaviour, parse, method)
    return handler._replace(**wrapped)


def refusal(parse: _Parse, method: str, err: Exception) -> str:
    """What a caller whose bytes did not parse is told."""
    owner = getattr(parse, "__self__", None)
    name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "") or "request"
    return (
        f"{method}: the request is not a valid {name} ({type(err).__name__}); "
        f"send a serialized {name}, e.g. from a client generated from tslice's protos"
    )


async def _parsed(raw: bytes, parse: _Parse, method: str, context: Any) -> Any:
    try:
        return parse(raw)
    except message.DecodeError as err:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refusal(parse, method, err))


def _single(behaviour: Callable[..., Any], parse: _Parse, method: str) -> Callable[..., Any]:
    """A method taking one request: parse it first (as a coroutine or an async
    generator, whichever ``behaviour`` is, since gRPC tells them apart)."""
    if inspect.isasyncgenfunction(behaviour):

        async def streaming(raw: bytes, context: Any) -> AsyncIterator[Any]:
            request = await _parsed(raw, parse, method, context)
            async for reply in behaviour(request, context):
                yield reply

        return streaming

    async def single(raw: bytes, context: Any) -> Any:
        return await behaviour(await _parsed(raw, parse, method, context), context)

    return single


def _streamed(behaviour: Callable[..., Any], parse: _Parse, method: str) -> Callable[..., Any]:
    """A method taking a stream of requests: each parsed as it arrives. At the first
    that does not parse the servicer sees the stream end (as if half-closed: it answers
    what it runs and ends); the call then ends with INVALID_ARGUMENT. The status is sent
    from the handler's own task, once its replies are written: gRPC refuses a status
    sent while a write is in flight."""

    async def requests(raw: AsyncIterator[bytes], refused: list[str]) -> AsyncIterator[Any]:
        async for item in raw:
            try:
                request = parse(item)
            except message.DecodeError as err:
                refused.append(refusal(parse, method, err))
                return
            yield request

    if inspect.isasyncgenfunction(behaviour):

        async def streaming(raw: AsyncIterator[bytes], context: Any) -> AsyncIterator[Any]:
            refused: list[str] = []
            async for reply in behaviour(requests(raw, refused), context):
                yield reply
            if refused:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0])

        return streaming

    async def single(raw: AsyncIterator[bytes], context: Any) -> Any:
        refused: list[str] = []
        reply = await behaviour(requests(raw, refused), context)
        if refused:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused[0])
        return reply

    return single
