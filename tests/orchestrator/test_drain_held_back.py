"""An Acquire queued on a group an administrator drained is answered, shortly before
its deadline, UNAVAILABLE with the reason and the fix (`tslice admin resume`), as one a
fault holds back is: not with gRPC's bare DEADLINE_EXCEEDED, and not told that the
group retries on its own (a drained group does not). Real processes on loopback: an
orchestrator in local mode and a noop agent."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim import cluster

TIMEOUT_S = 20.0
#: The waiter's deadline: it is answered 0.2 s before it.
DEADLINE_S = 1.0


@pytest.fixture
def stub() -> Iterator[opb_grpc.TimeSliceOrchestratorServiceStub]:
    agent = cluster.SimAgent(name="node-1", backend="noop")
    with (
        cluster.LocalCluster(agents=[agent]) as local,
        grpc.insecure_channel(local.orchestrator_address) as channel,
    ):
        yield opb_grpc.TimeSliceOrchestratorServiceStub(channel)


def test_an_acquire_on_a_drained_group_is_unavailable_naming_the_drain(
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
) -> None:
    granted = stub.Acquire(opb.AcquireRequest(job_id="a", group_id="g"), timeout=TIMEOUT_S)
    assert granted.success
    stub.Drain(opb.DrainRequest(group_id="g", drain=True), timeout=TIMEOUT_S)
    stub.Yield(opb.YieldRequest(job_id="a", group_id="g"), timeout=TIMEOUT_S)
    with pytest.raises(grpc.RpcError) as err:
        stub.Acquire(opb.AcquireRequest(job_id="b", group_id="g"), timeout=DEADLINE_S)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    message = err.value.details()
    assert "group g is drained by an administrator" in message, message
    assert "`tslice admin resume g`" in message, message
    assert "retries on its own" not in message, message
    # The waiter left the queue when it was answered: nothing is left behind it.
    reply = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"), timeout=TIMEOUT_S)
    assert list(reply.group.waiting_jobs) == [], reply
