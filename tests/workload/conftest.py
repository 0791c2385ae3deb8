"""Fixtures for the workload-side tests: a real agent-side ChannelHub behind grpc.aio.

The workload library is synchronous (threads); everything that blocks on it from a
test must go through ``asyncio.to_thread`` so that the server keeps running on the
test's event loop.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator, Iterator

import pytest

from tests.workload.workload_support import HubServer


@pytest.fixture
def socket_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tslice-") as tmp:
        yield os.path.join(tmp, "agent.sock")


@pytest.fixture(params=["tcp", "unix"])
async def agent_hub(request: pytest.FixtureRequest, socket_path: str) -> AsyncIterator[HubServer]:
    """A hub on TCP and, in a second run, on a Unix socket."""
    bind = "127.0.0.1:0" if request.param == "tcp" else f"unix:{socket_path}"
    running = await HubServer.start(bind, ping_interval_s=0.2, missed_pings=3)
    yield running
    await running.stop()


@pytest.fixture
async def tcp_hub() -> AsyncIterator[HubServer]:
    running = await HubServer.start("127.0.0.1:0", ping_interval_s=0.2, missed_pings=3)
    yield running
    await running.stop()
