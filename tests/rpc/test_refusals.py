"""A refusal for a caller that has already gone (its deadline passed, or it cancelled)
ends the handler quietly: gRPC can no longer send the status, and calling abort then
raises in its core and logs an error with a traceback, which an operator would take
for a server fault (seen in the fuzz run: an Acquire refused as its deadline passed)."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import grpc.aio
import pytest

from tslice.rpc import refusals

_METHOD = "/test.Refusals/Wait"


async def test_a_refusal_for_a_caller_that_left_ends_the_handler_without_an_error_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started = asyncio.Event()
    ended: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    async def wait(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        started.set()
        # The refusal comes just as the caller leaves (gRPC cancels the handler then: the
        # race is made certain by going on past that cancellation).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        try:
            await refusals.abort(
                context, refusals.Refused(refusals.Code.DEADLINE_EXCEEDED, "too late")
            )
        except BaseException as err:  # (what ended it is what the test looks at)
            ended.set_result(err)
            raise
        ended.set_result(None)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "test.Refusals", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with caplog.at_level(logging.ERROR, logger="grpc"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                    _METHOD
                )
                call = method(b"")
                await started.wait()
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            outcome = await asyncio.wait_for(ended, 10)
    finally:
        await server.stop(None)
    assert isinstance(outcome, asyncio.CancelledError), outcome
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
