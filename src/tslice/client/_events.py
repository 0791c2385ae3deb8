"""The orchestrator's event stream as ``watch_events`` hands it out: a generator of
:class:`~tslice.client.OrchestratorEvent` for ``Client``, an :class:`EventStream` for
``AsyncClient``; closing either ends the gRPC stream."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterator

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _streams, _types


def events(
    stream: _streams.SyncStream[opb.OrchestratorEvent],
) -> Iterator[_types.OrchestratorEvent]:
    try:
        for message in stream:
            yield _types.orchestrator_event(message)
    finally:
        stream.cancel()


async def _async_events(
    stream: _streams.AsyncStream[opb.OrchestratorEvent],
) -> AsyncGenerator[_types.OrchestratorEvent, None]:
    try:
        async for message in stream:
            yield _types.orchestrator_event(message)
    finally:
        stream.cancel()


class EventStream(AsyncIterator[_types.OrchestratorEvent]):
    """Events of :meth:`AsyncClient.watch_events`, for ``async for``."""

    def __init__(self, stream: _streams.AsyncStream[opb.OrchestratorEvent]) -> None:
        self._stream = stream
        self._events = _async_events(stream)

    async def started(self) -> None:
        """Return once the orchestrator has subscribed this stream: no event published
        after that is missed."""
        await self._stream.started()

    async def __anext__(self) -> _types.OrchestratorEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """End the stream."""
        self._stream.cancel()
        await self._events.aclose()
