"""Evict and Drain on a real local cluster (orchestrator and a noop agent, processes on
loopback): a holder's lock is taken and the waiter granted, a waiter's Acquire ends ABORTED
with the reason, unknown jobs and groups are NOT_FOUND, a drained group grants nothing
until resumed, and the drain mark survives a SIGKILL of the orchestrator."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from tests.orchestrator.admin_calls import TIMEOUT_S, acquire, orchestrator, status, waiting
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim import cluster


@pytest.fixture(scope="module")
def local() -> Iterator[cluster.LocalCluster]:
    with cluster.LocalCluster(agents=[cluster.SimAgent(name="node-1", backend="noop")]) as running:
        yield running


@pytest.fixture
def stub(local: cluster.LocalCluster) -> Iterator[opb_grpc.TimeSliceOrchestratorServiceStub]:
    with orchestrator(local) as made:
        yield made


def refused(call: object, request: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=TIMEOUT_S)  # type: ignore[operator]
    return err.value


def held_and_awaited(stub: opb_grpc.TimeSliceOrchestratorServiceStub, group: str) -> grpc.Future:
    """``group`` held by job-a, job-b's Acquire of it pending."""
    acquire(stub, "job-a", group)
    return waiting(stub, "job-b", group)


def evict(
    stub: opb_grpc.TimeSliceOrchestratorServiceStub, group: str, job: str, reason: str
) -> opb.EvictResponse:
    request = opb.EvictRequest(group_id=group, job_id=job, reason=reason)
    reply: opb.EvictResponse = stub.Evict(request, timeout=TIMEOUT_S)
    return reply


def test_evicting_the_holder_grants_the_waiter_and_its_yield_says_it_no_longer_holds(
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
) -> None:
    granted = held_and_awaited(stub, "ev-holder")
    reply = evict(stub, "ev-holder", "job-a", "hung in NCCL")
    (eviction,) = reply.evictions
    assert (eviction.group_id, eviction.role, eviction.next_job) == (
        "ev-holder",
        opb.Eviction.ROLE_HOLDER,
        "job-b",
    )
    assert granted.result(timeout=TIMEOUT_S).success
    assert status(stub, "ev-holder").locking_job == "job-b"
    err = refused(stub.Yield, opb.YieldRequest(job_id="job-a", group_id="ev-holder"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "held by job 'job-b'" in err.details()
    assert "evicted from group 'ev-holder' by an administrator: hung in NCCL" in err.details()
    stub.Yield(opb.YieldRequest(job_id="job-b", group_id="ev-holder"), timeout=TIMEOUT_S)
    # Nobody holds it now: the evicted job's Yield is still told why it does not hold.
    err = refused(stub.Yield, opb.YieldRequest(job_id="job-a", group_id="ev-holder"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no longer holds group 'ev-holder'" in err.details() and "NCCL" in err.details()


def test_an_evicted_holders_hold_stream_ends_naming_the_reason_and_it_cannot_reopen_one(
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
) -> None:
    request = opb.AcquireRequest(job_id="job-l", group_id="ev-lease", lease_ms=60_000)
    epoch = stub.Acquire(request, timeout=TIMEOUT_S).grant_epoch
    hold = opb.HoldRequest(job_id="job-l", group_id="ev-lease", grant_epoch=epoch)
    stream = stub.Hold(hold, timeout=TIMEOUT_S)
    assert next(stream).lease_ms == 60_000  # the stream is registered
    evict(stub, "ev-lease", "job-l", "node drained for repair")
    lost = next(e for e in stream if e.lost or e.released)
    assert lost.lost == "evicted from group 'ev-lease' by an administrator: node drained for repair"
    with pytest.raises(grpc.RpcError) as err:
        next(iter(stub.Hold(hold, timeout=TIMEOUT_S)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "node drained for repair" in err.value.details()


def test_evicting_a_waiter_ends_its_acquire_aborted_with_the_reason(
    stub: opb_grpc.TimeSliceOrchestratorServiceStub,
) -> None:
    pending = held_and_awaited(stub, "ev-waiter")
    reply = evict(stub, "ev-waiter", "job-b", "quota")
    assert [e.role for e in reply.evictions] == [opb.Eviction.ROLE_WAITER]
    err = pending.exception(timeout=TIMEOUT_S)
    assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.ABORTED
    assert err.details() == "evicted from group 'ev-waiter' by an administrator: quota"
    group = status(stub, "ev-waiter")
    assert list(group.waiting_jobs) == [] and group.locking_job == "job-a"
    # Now it is nowhere in that group, and nowhere at all.
    err = refused(stub.Evict, opb.EvictRequest(group_id="ev-waiter", job_id="job-b"))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "job 'job-b' neither holds nor waits for group 'ev-waiter'" in err.details()
    err = refused(stub.Evict, opb.EvictRequest(job_id="job-b"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "any group" in err.details()
    err = refused(stub.Evict, opb.EvictRequest(group_id="no-such-group", job_id="job-a"))
    assert err.code() == grpc.StatusCode.NOT_FOUND and "no-such-group" in err.details()
    # An empty group_id: every group where it holds or waits.
    reply = evict(stub, "", "job-a", "done")
    assert ("ev-waiter", opb.Eviction.ROLE_HOLDER) in [
        (e.group_id, e.role) for e in reply.evictions
    ]
    assert status(stub, "ev-waiter").locking_job == ""


def test_a_drained_group_grants_nothing_even_after_a_restart_until_resumed(
    local: cluster.LocalCluster,
) -> None:
    with orchestrator(local) as stub:
        acquire(stub, "job-a", "drained")
        reply = stub.Drain(opb.DrainRequest(group_id="drained", drain=True), timeout=TIMEOUT_S)
        assert (reply.draining, reply.was_draining, reply.locking_job) == (True, False, "job-a")
        pending = waiting(stub, "job-b", "drained")
        # The holder keeps its turn until it yields; the yield hands on nothing.
        stub.Yield(opb.YieldRequest(job_id="job-a", group_id="drained"), timeout=TIMEOUT_S)
        group = status(stub, "drained")
        assert group.draining and group.locking_job == "" and list(group.waiting_jobs) == ["job-b"]
        assert "draining" in group.detail
    local.kill(cluster.ORCHESTRATOR)
    assert isinstance(pending.exception(timeout=TIMEOUT_S), grpc.RpcError)
    local.restart(cluster.ORCHESTRATOR)
    with orchestrator(local) as stub:
        assert status(stub, "drained").draining  # the mark was on disk
        pending = waiting(stub, "job-b", "drained")  # re-attaches to its place
        group = status(stub, "drained")
        assert group.locking_job == "" and list(group.waiting_jobs) == ["job-b"]
        reply = stub.Drain(opb.DrainRequest(group_id="drained", drain=False), timeout=TIMEOUT_S)
        assert (reply.draining, reply.was_draining) == (False, True)
        assert pending.result(timeout=TIMEOUT_S).success
        assert not status(stub, "drained").draining
        stub.Yield(opb.YieldRequest(job_id="job-b", group_id="drained"), timeout=TIMEOUT_S)
