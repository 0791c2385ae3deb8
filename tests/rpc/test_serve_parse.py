"""``multiplex.serve`` parsing its own requests needs the call's context: without it a
request that does not parse could not be refused, so it is refused at once instead."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.rpc import multiplex


async def _no_requests() -> AsyncIterator[bytes]:
    return
    yield b""  # (an async generator)


async def test_serve_that_parses_needs_the_calls_context() -> None:
    replies = multiplex.serve(
        _no_requests(),
        lambda request: None,  # type: ignore[arg-type,return-value]
        request_id=lambda request: 0,
        duplicate=lambda request: None,
        name="Session",
        parse=opb.SessionRequest.FromString,
    )
    with pytest.raises(ValueError, match="needs the call's context"):
        await replies.__anext__()
