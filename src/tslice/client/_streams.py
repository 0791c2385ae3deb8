"""What the client hands out for a streaming call (:class:`SyncStream`,
:class:`AsyncStream`: replies as they come, errors as tslice errors, ``cancel()``), and
the standard health check typed without grpcio-health-checking on the job side."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Generic, Protocol, TypeAlias, TypeVar, overload

import grpc
import grpc.aio
from google.protobuf import wrappers_pb2

from tslice.common import errors

T = TypeVar("T")
_Rep_co = TypeVar("_Rep_co", covariant=True)


class _SyncCall(Protocol[_Rep_co]):
    def __iter__(self) -> Iterator[_Rep_co]: ...

    def cancel(self) -> object: ...

    def initial_metadata(self) -> object: ...


class _AsyncCall(Protocol[_Rep_co]):
    def __aiter__(self) -> AsyncIterator[_Rep_co]: ...

    def cancel(self) -> object: ...

    def initial_metadata(self) -> Awaitable[object]: ...


# -- streams ----------------------------------------------------------------------------------


class SyncStream(Generic[T]):
    """Responses of a streaming call; errors arrive as tslice errors; ``cancel()`` ends it."""

    def __init__(self, call: _SyncCall[T], *, group_id: str | None = None) -> None:
        self._call = call
        self._group_id = group_id
        self._cancelled = False

    def __iter__(self) -> Iterator[T]:
        try:
            yield from self._call
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise errors.from_grpc(err, group_id=self._group_id) from err

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def started(self) -> None:
        """Block until the server has answered with its headers (or the call failed: the
        iteration raises the error)."""
        with contextlib.suppress(grpc.RpcError):
            self._call.initial_metadata()


class AsyncStream(Generic[T]):
    """Async twin of :class:`SyncStream`; the call starts at the first ``async for`` or
    ``started()``, once the transport is connected."""

    def __init__(
        self,
        open_call: Callable[[], _AsyncCall[T]],
        *,
        connect: Callable[[], Awaitable[None]],
        group_id: str | None = None,
    ) -> None:
        self._open_call = open_call
        self._connect = connect
        self._call: _AsyncCall[T] | None = None
        self._group_id = group_id
        self._cancelled = False

    async def _opened(self) -> _AsyncCall[T]:
        if self._call is None:
            await self._connect()
            self._call = self._open_call()
            if self._cancelled:
                self._call.cancel()
        return self._call

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            async for item in await self._opened():
                yield item
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise errors.from_grpc(err, group_id=self._group_id) from err
        except asyncio.CancelledError:
            if not self._cancelled:
                raise

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def started(self) -> None:
        """See :meth:`SyncStream.started`."""
        call = await self._opened()
        with contextlib.suppress(grpc.RpcError):
            await call.initial_metadata()


#: ``grpc.health.v1`` on the wire without grpcio-health-checking on the job side: the
#: request is ``string service = 1`` and the reply ``ServingStatus status = 1`` (an enum
#: is a varint), byte for byte protobuf's own StringValue and Int32Value.
HealthCheckRequest: TypeAlias = wrappers_pb2.StringValue
HealthCheckResponse: TypeAlias = wrappers_pb2.Int32Value
SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


@overload
def health_check(
    channel: grpc.aio.Channel,
) -> grpc.aio.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse]: ...
@overload
def health_check(
    channel: grpc.Channel,
) -> grpc.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse]: ...
def health_check(
    channel: grpc.Channel | grpc.aio.Channel,
) -> (
    grpc.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse]
    | grpc.aio.UnaryUnaryMultiCallable[HealthCheckRequest, HealthCheckResponse]
):
    """The standard ``grpc.health.v1.Health/Check`` on ``channel``, typed."""
    return channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=HealthCheckRequest.SerializeToString,
        response_deserializer=HealthCheckResponse.FromString,
    )
