"""Acquire and Yield of an :class:`~tslice.AsyncClient` over the orchestrator's
``Session`` stream (see :mod:`tslice.common.multiplex`).

They are the first and last legs of every hand-over; a message on an open stream
costs about half a unary call. :class:`Session` offers the two calls with the
signature of the generated stub's methods (``request, timeout=, metadata=``) and
raises ``grpc.RpcError`` as they do, so the transport's retry and error mapping apply
unchanged. A timed-out or cancelled Acquire sends ``cancel`` (the job leaves the queue
at once, as when a unary call is cancelled); a broken stream fails the calls in flight
with ``UNAVAILABLE`` and the next call opens a new one. An orchestrator without the RPC
(llm-d's, an older tslice) gets the unary calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
