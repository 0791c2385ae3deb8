"""WatchEvents filters by kind on the server: a watcher gets only what it asked for."""

from __future__ import annotations

from tests.orchestrator.orch_harness import Cluster, Events, acquire, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb


async def test_only_requested_kinds_are_delivered(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    everything = await Events.open(stub, "g")
    queued_only = stub.WatchEvents(
        opb.WatchEventsRequest(group_id="g", kinds=[opb.OrchestratorEvent.KIND_QUEUED])
    )
    await queued_only.initial_metadata()

    await acquire(stub, "a", "g")
    waiting = acquire(stub, "b", "g")
    await everything.wait_for(opb.OrchestratorEvent.KIND_QUEUED, job="b")
    await yield_(stub, "a", "g")
    await waiting
    await yield_(stub, "b", "g")
    await acquire(stub, "a", "g")  # a switch back: more events of every kind
    await everything.wait_for(opb.OrchestratorEvent.KIND_SWITCH_DONE, job="a")
    filtered = [await queued_only.read() for _ in range(3)]
    queued_only.cancel()

    assert [(e.kind, e.job_id) for e in filtered] == [
        (opb.OrchestratorEvent.KIND_QUEUED, "a"),
        (opb.OrchestratorEvent.KIND_QUEUED, "b"),
        (opb.OrchestratorEvent.KIND_QUEUED, "a"),
    ]
    # The unfiltered stream saw the switches the filtered one was spared.
    assert {"SWITCH_STARTED", "SWITCH_DONE"} <= set(everything.kinds())
