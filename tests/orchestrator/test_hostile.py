"""Hostile input at the orchestrator's edge (real in-process orchestrator and agents)."""

from __future__ import annotations

import grpc
import pytest

from tests.orchestrator.orch_harness import Cluster
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb


async def test_watch_of_an_unknown_event_kind_is_refused(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    call = stub.WatchEvents(opb.WatchEventsRequest(kinds=[opb.OrchestratorEvent.KIND_GRANTED, 42]))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kinds" in info.value.details() and "KIND_GRANTED (2)" in info.value.details()
