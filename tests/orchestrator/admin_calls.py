"""Admin RPC calls against a real orchestrator (shared by the orchestrator's and the
CLI's admin tests): a stub, a granted Acquire, a pending one, a group's status."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim import cluster

TIMEOUT_S = 20.0
Kind = opb.OrchestratorEvent


@contextlib.contextmanager
def orchestrator(
    local: cluster.LocalCluster,
) -> Iterator[opb_grpc.TimeSliceOrchestratorServiceStub]:
    with grpc.insecure_channel(local.orchestrator_address) as channel:
        yield opb_grpc.TimeSliceOrchestratorServiceStub(channel)


def acquire(stub: opb_grpc.TimeSliceOrchestratorServiceStub, job: str, group: str) -> None:
    reply = stub.Acquire(opb.AcquireRequest(job_id=job, group_id=group), timeout=TIMEOUT_S)
    assert reply.success


def waiting(stub: opb_grpc.TimeSliceOrchestratorServiceStub, job: str, group: str) -> grpc.Future:
    """``job``'s Acquire of ``group``, pending: returned once the orchestrator queued it."""
    events = stub.WatchEvents(
        opb.WatchEventsRequest(group_id=group, kinds=[Kind.KIND_QUEUED]), timeout=TIMEOUT_S
    )
    events.initial_metadata()  # subscribed: the QUEUED event cannot be missed
    pending = stub.Acquire.future(opb.AcquireRequest(job_id=job, group_id=group), timeout=TIMEOUT_S)
    assert any(e.job_id == job for e in events)
    events.cancel()
    return pending


def status(stub: opb_grpc.TimeSliceOrchestratorServiceStub, group: str) -> opb.GroupStatus:
    reply = stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group), timeout=TIMEOUT_S)
    return reply.group
