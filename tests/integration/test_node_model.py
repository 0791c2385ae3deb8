"""Issue 7 §1 on real servers (orchestrator and agents on loopback, simulated devices).

Each test is a bug the node model had: a job's state for one group moved by a switch
on another group; deferred residents of idle groups that never gave way; a footprint
that can never fit retried until the caller's deadline; a node that keeps refusing
retried forever.
"""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest

from tests.orchestrator.orch_harness import Cluster, yield_
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

GiB = 1024**3


@pytest.fixture
async def cluster(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        await c.close()


async def states(cluster: Cluster, node: str) -> dict[tuple[str, str], int]:
    """The agent's records by (job, group)."""
    reply = await cluster.agents[node].stub.Status(pb.StatusRequest())
    return {(j.job_id, j.group): j.state for j in reply.job_statuses}


def acquire(stub: object, job: str, group: str, *, timeout: float = 10.0, **kw: object) -> object:
    request = opb.AcquireRequest(job_id=job, group_id=group, **kw)  # type: ignore[arg-type]
    return stub.Acquire(request, timeout=timeout)  # type: ignore[attr-defined]


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


async def test_a_switch_on_one_group_never_moves_a_jobs_state_for_another(
    cluster: Cluster,
) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()  # local mode: both groups span node-a's devices
    stub = cluster.stub()
    await acquire(stub, "a", "sampler")
    await acquire(stub, "a", "trainer")  # one job may hold both (weight sync)
    await yield_(stub, "a", "trainer")
    # b wants the trainer pool, which shares its devices with a's sampler pool: it waits.
    err = await rpc_error(acquire(stub, "b", "trainer", timeout=1.0))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    st = await states(cluster, "node-a")
    assert st[("a", "sampler")] == pb.JOB_STATE_RUNNING
    assert st[("a", "trainer")] == pb.JOB_STATE_RUNNING  # deferred: nobody took it yet

    await yield_(stub, "a", "sampler")
    await acquire(stub, "b", "trainer", timeout=10.0)
    st = await states(cluster, "node-a")
    # The trainer switch moved a's trainer state only; a's sampler state stayed (it fits).
    assert st[("a", "trainer")] == pb.JOB_STATE_SAVED
    assert st[("b", "trainer")] == pb.JOB_STATE_RUNNING
    assert st[("a", "sampler")] == pb.JOB_STATE_RUNNING
    # And a's sampler state is still a zero-cost re-acquire once b is done.
    await yield_(stub, "b", "trainer")
    again = await acquire(stub, "a", "sampler", timeout=10.0)
    assert not again.context_restored


async def test_deferred_residents_of_idle_groups_give_way(cluster: Cluster) -> None:
    # tslice up's defaults: every group spans the node; a state takes 40 % of a device.
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    for group in ("g1", "g2", "g3", "g4"):
        await acquire(stub, "x", group, timeout=10.0)
        await yield_(stub, "x", group)
    granted = await acquire(stub, "x", "g5", timeout=10.0)
    assert granted.success
    st = await states(cluster, "node-a")
    assert st[("x", "g5")] == pb.JOB_STATE_RUNNING
    resident = [g for (job, g), s in st.items() if s == pb.JOB_STATE_RUNNING]
    saved = [g for (job, g), s in st.items() if s == pb.JOB_STATE_SAVED]
    assert len(resident) == 2 and "g5" in resident  # two states fit on a device
    assert len(saved) == 3
    # A group whose resident gave way brings it back when it is acquired again.
    back = await acquire(stub, "x", saved[0], timeout=10.0)
    assert back.context_restored


async def test_a_footprint_that_can_never_fit_is_refused_at_once(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator()
    stub = cluster.stub()
    err = await rpc_error(acquire(stub, "huge", "g", footprint_bytes=11 * GiB, timeout=30.0))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "holds only" in (err.details() or "")
    # Nothing is left behind: the group serves the next job at once.
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert list(status.waiting_jobs) == [] and status.locking_job == ""
    assert (await acquire(stub, "small", "g", timeout=5.0)).success


async def test_a_node_that_keeps_refusing_is_degraded_until_an_operator_clears_it(
    cluster: Cluster,
) -> None:
    agent = await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]}, max_refusals=2)
    stub = cluster.stub()
    # Something wedged the node for this group: a grant mark the orchestrator cannot pass.
    await agent.stub.Grant(pb.GrantRequest(job_id="stray", group="g", grant_epoch=2**62))
    err = await rpc_error(acquire(stub, "a", "g", timeout=30.0))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "node node-a is degraded" in (err.details() or "")
    assert "clear-degraded g --node node-a" in (err.details() or "")
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert [d.node for d in status.degraded] == ["node-a"]
    assert "stale grant" in status.degraded[0].reason
    # While degraded, an Acquire is told why at once.
    err = await rpc_error(acquire(stub, "b", "g", timeout=30.0))
    assert err.code() == grpc.StatusCode.UNAVAILABLE

    err = await rpc_error(stub.ClearDegraded(opb.ClearDegradedRequest(group_id="g", node="nope")))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not in group 'g'" in (err.details() or "")
    cleared = await stub.ClearDegraded(opb.ClearDegradedRequest(group_id="g"))
    assert list(cleared.cleared) == ["node-a"]
    status = (await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id="g"))).group
    assert list(status.degraded) == []
