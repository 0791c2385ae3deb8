"""Grants to one agent over a single long-lived ``GrantStream`` call.

A message on an open stream costs about half a unary call (no new HTTP/2 stream, no
headers, no call object on either side), and the Grant is on every hand-over's path.
Requests carry an id; a reader task hands each reply to the future of its request.
The stream is opened on first use and again after it broke (agent restarted, network
cut): a break fails the Grants in flight with :class:`Broken`, and the switch retries
them as it retries a failed unary call. An agent without the RPC (llm-d's, or an older
tslice) answers ``UNIMPLEMENTED``: :class:`Unsupported`, and the caller uses the unary
``Grant`` from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks

log = logging.getLogger(__name__)


class Unsupported(Exception):
    """The agent has no GrantStream RPC."""


class Broken(Exception):
    """The stream ended or failed before the reply came; ``code`` says how."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class GrantStream:
    """Requests in, replies matched by ``request_id``; re-opened on demand."""

    def __init__(self, open_call: Callable[[], Any], *, name: str) -> None:
        self._open_call = open_call
        self._name = name
        #: None until the agent answered (or refused) once.
        self.supported: bool | None = None
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[pb.GrantStreamResponse]] = {}
        self._ids = itertools.count(1)
        self._writing = asyncio.Lock()

    async def grant(
        self,
        request: pb.GrantRequest,
        *,
        timeout_s: float,
        issued: Callable[[], None] | None = None,
    ) -> pb.GrantStreamResponse:
        """Send ``request`` and wait for its reply; raise Unsupported, Broken or TimeoutError."""
        if self.supported is False:
            raise Unsupported(self._name)
        call = self._ensure_open()
        request_id = next(self._ids)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[pb.GrantStreamResponse] = loop.create_future()
        self._pending[request_id] = reply
        timer = loop.call_later(timeout_s, _expire, reply, timeout_s)
        try:
            async with self._writing:  # one write at a time on a stream
                try:
                    await call.write(pb.GrantStreamRequest(request_id=request_id, grant=request))
                except (grpc.RpcError, asyncio.InvalidStateError) as err:
                    # The stream is over: its reader fails the reply with the reason.
                    log.debug("grant stream to %s: write failed: %s", self._name, err)
            if issued is not None:
                issued()
            return await reply
        finally:
            timer.cancel()
            self._pending.pop(request_id, None)

    async def close(self) -> None:
        call, reader = self._call, self._reader
        self._call = self._reader = None
        if call is not None:
            call.cancel()
        if reader is not None:
            await tasks.cancel_all([reader])
        _fail(self._pending, Broken(grpc.StatusCode.CANCELLED, "the orchestrator is closing"))

    def _ensure_open(self) -> Any:
        if self._call is None:
            self._call = self._open_call()
            self._reader = tasks.spawn(self._read(self._call), name=f"grant-stream:{self._name}")
        return self._call

    async def _read(self, call: Any) -> None:
        code, detail = grpc.StatusCode.UNAVAILABLE, "the agent closed the grant stream"
        try:
            async for reply in call:
                self.supported = True
                waiter = self._pending.get(reply.request_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply)
        except grpc.RpcError as err:
            code = err.code()
            detail = err.details() or code.name.lower()
        if self._call is call:
            self._call = self._reader = None
        if code == grpc.StatusCode.UNIMPLEMENTED and not self.supported:
            self.supported = False
            log.info("agent %s has no GrantStream; using unary Grant calls", self._name)
            failure: Exception = Unsupported(self._name)
        else:
            failure = Broken(code, detail)
        _fail(self._pending, failure)


def _fail(pending: dict[int, asyncio.Future[pb.GrantStreamResponse]], err: Exception) -> None:
    for waiter in list(pending.values()):
        if not waiter.done():
            waiter.set_exception(err)


def _expire(reply: asyncio.Future[pb.GrantStreamResponse], timeout_s: float) -> None:
    if not reply.done():
        reply.set_exception(TimeoutError(f"no grant reply within {timeout_s:g} s"))
