"""An embedded orchestrator (no leader term) meets an agent that an HA leader fenced: the
switch is refused, nothing moves, and the group says why and how to fix it."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest

import tslice
from tests.client.servers import Servers
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.security import leader_term


async def _fence(address: str, term: int) -> None:
    """A read of an elected leader in ``term``: the agent adopts it."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.SnapshotAgentServiceStub(channel)
        await stub.Status(pb.StatusRequest(), metadata=leader_term.Term(term).metadata())


def test_an_unfenced_orchestrator_is_refused_by_a_fenced_agent(tmp_path: pathlib.Path) -> None:
    servers = Servers(tmp_path)
    try:
        address = servers.start_agent("node-a")
        asyncio.run(_fence(address, 3))
        servers.start_orchestrator()
        with tslice.Client(
            servers.orchestrator, job_id="job-a", default_group="g", retry=tslice.client.NO_RETRY
        ) as client:
            with pytest.raises(tslice.Unavailable, match="without a leader term"):
                client.acquire(timeout=20)
            (degraded,) = client.status().degraded
            assert "DELETE FROM leader_term" in degraded.reason
    finally:
        servers.close()
    journal = tmp_path / "agent-node-a" / device.JOURNAL_FILE
    assert not journal.exists() or device.read_journal(journal) == []
