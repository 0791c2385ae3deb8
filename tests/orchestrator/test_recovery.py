"""Persistence and recovery: restarts on the same state dir, crafted crash states, SIGKILL."""

from __future__ import annotations

import asyncio
import pathlib

import grpc
import pytest
import yaml

from tests.harness.servers import Server
from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, yield_
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.orchestrator.persistence import records, store


def whole(record: records.LockRecord) -> records.Changes:
    """A record written whole (as a group's first save writes what it started from)."""
    return records.Changes(row=record.row, queued=record.queue, footprints=record.footprints)


K = opb.OrchestratorEvent
GS = opb.GroupStatus


async def status(stub: object, group: str = "g") -> opb.GroupStatus:
    resp = await stub.GetGroupStatus(opb.GetGroupStatusRequest(group_id=group))  # type: ignore[attr-defined]
    return resp.group


async def states(cluster: Cluster, job: str) -> list[int]:
    return [await a.state(job) for a in cluster.agents.values()]


RUNNING, SAVED = pb.JOB_STATE_RUNNING, pb.JOB_STATE_SAVED


async def test_restart_keeps_holder_and_fifo_positions(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    c_task = asyncio.ensure_future(acquire(stub, "c", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="c")
    await cluster.restart_orchestrator()
    for task in (b_task, c_task):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await task
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    again = await acquire(stub, "a", "g")  # the holder keeps the lock
    assert again.grant_epoch == 1 and not again.context_restored
    c_task = asyncio.ensure_future(acquire(stub, "c", "g"))  # c re-attaches first...
    assert (await ev.wait_for(K.KIND_QUEUED, job="c")).detail == "re-attached after restart"
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    st = await status(stub)
    assert list(st.waiting_jobs) == ["b", "c"] and st.locking_job == "a"
    await yield_(stub, "a", "g")
    b = await b_task  # ...but b was queued before c: b goes first
    assert b.grant_epoch == 2 and not c_task.done()
    await yield_(stub, "b", "g")
    assert (await c_task).grant_epoch == 3
    ev.cancel()


async def test_detached_entries_are_dropped_after_the_grace(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_orchestrator(groups={"g": ["node-a"]}, reattach_grace_s=1.0)
    stub = cluster.stub()
    await acquire(stub, "a", "g")
    ev = await Events.open(stub, "g")
    b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
    await ev.wait_for(K.KIND_QUEUED, job="b")
    await cluster.restart_orchestrator()
    with pytest.raises(grpc.aio.AioRpcError):
        await b_task
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    assert list((await status(stub)).waiting_jobs) == ["b"]
    gone = await ev.wait_for(K.KIND_CANCELLED, job="b")
    assert "did not re-attach" in gone.detail
    st = await status(stub)
    assert list(st.waiting_jobs) == [] and st.locking_job == "a"
    ev.cancel()


async def seed_db(cluster: Cluster, record: records.LockRecord, nodes: list[str]) -> None:
    db = await store.Store.open(cluster.tmp_path / "orch")
    pairs = [(n, cluster.agents[n].address) for n in nodes]
    await db.save("g", nodes=pairs, changes=whole(record))
    await db.close()


async def grant(cluster: Cluster, node: str, job: str, epoch: int = 1) -> None:
    agent = cluster.agents[node]
    await agent.stub.Grant(pb.GrantRequest(job_id=job, group="g", grant_epoch=epoch))


async def snapshot(cluster: Cluster, node: str, job: str, *, wait: bool = True) -> None:
    agent = cluster.agents[node]
    op = await agent.stub.Snapshot(pb.SnapshotRequest(job_id=job, group="g"))
    if wait:
        await agent.stub.WaitOperation(
            pb.WaitOperationRequest(operation_id=op.operation_id, timeout_ms=10_000)
        )


def record_with_intent(epoch: int = 2) -> records.LockRecord:
    return records.LockRecord(
        holder=None,
        resident="a",
        grant_epoch=epoch,
        switch_count=1,
        next_seq=3,
        queue=(),
        intent=records.IntentRecord("a", "b", epoch, 2),
        footprints=(),
    )


async def test_intent_with_nothing_moved_is_rolled_back(cluster: Cluster) -> None:
    for n in ("node-a", "node-b"):
        await cluster.start_agent(n)
        await grant(cluster, n, "a")
    await seed_db(cluster, record_with_intent(), ["node-a", "node-b"])
    nodes = [{"name": n, "agent": cluster.agents[n].address} for n in ("node-a", "node-b")]
    port_b = int(cluster.agents["node-b"].address.rsplit(":", 1)[1])
    # Recovery cannot decide while node-b is down: watch it decide once node-b is back,
    # before b re-issues its Acquire (b "gone from the queue").
    await cluster.stop_agent("node-b")
    await cluster.start_orchestrator(
        cluster.config(topology={"groups": {"g": {"nodes": nodes}}}, backoff_max_s=0.05)
    )
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await cluster.start_agent("node-b", port=port_b)
    undone = await ev.wait_for(K.KIND_SWITCH_FAILED, job="b")
    assert "rolled back" in undone.detail
    st = await status(stub)
    assert st.group_state == GS.STATE_IDLE_YIELDED and list(st.waiting_jobs) == ["b"]
    assert st.loaded_job == "a"
    b = await acquire(stub, "b", "g")
    # rolled back (b back at the head of the queue), then promoted again: a new epoch
    assert b.grant_epoch == 3 and not b.context_restored
    assert await states(cluster, "a") == [SAVED, SAVED]
    assert await states(cluster, "b") == [RUNNING, RUNNING]


async def test_intent_half_done_is_rolled_forward(cluster: Cluster) -> None:
    for n in ("node-a", "node-b"):
        await cluster.start_agent(n)
        await grant(cluster, n, "a")
    await snapshot(cluster, "node-a", "a")  # the crash came after node-a's snapshot
    await seed_db(cluster, record_with_intent(), ["node-a", "node-b"])
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    stub = cluster.stub()
    b = await acquire(stub, "b", "g")  # the re-issued Acquire of the switch target
    assert b.grant_epoch == 2
    assert await states(cluster, "a") == [SAVED, SAVED]
    assert await states(cluster, "b") == [RUNNING, RUNNING]
    st = await status(stub)
    assert st.group_state == GS.STATE_LOCKED and st.locking_job == "b" and st.loaded_job == "b"


async def test_rolled_forward_grant_released_if_target_never_returns(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await grant(cluster, "node-a", "a")
    await snapshot(cluster, "node-a", "a")
    await seed_db(cluster, record_with_intent(), ["node-a"])
    await cluster.start_orchestrator(groups={"g": ["node-a"]}, reattach_grace_s=1.0)
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    gone = await ev.wait_for(K.KIND_CANCELLED, job="b")
    assert "did not re-attach" in gone.detail
    st = await status(stub)
    assert st.group_state == GS.STATE_IDLE_YIELDED and st.active_job == "b"
    assert st.locking_job == "" and st.loaded_job == "b"
    ev.cancel()


async def test_recovery_waits_on_an_operation_in_flight(cluster: Cluster) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 0.5})
    await grant(cluster, "node-a", "a")
    await snapshot(cluster, "node-a", "a", wait=False)  # still TRANSITIONING at startup
    await seed_db(cluster, record_with_intent(), ["node-a"])
    await cluster.start_orchestrator(groups={"g": ["node-a"]})
    stub = cluster.stub()
    b = await acquire(stub, "b", "g")
    assert b.grant_epoch == 2
    assert await states(cluster, "a") == [SAVED]
    assert await states(cluster, "b") == [RUNNING]


def bare_record(resident: str | None = None) -> records.LockRecord:
    return records.LockRecord(None, resident, 5, 3, 1, (), None, ())


async def test_resident_adopted_when_it_runs_on_every_node(cluster: Cluster) -> None:
    for n in ("node-a", "node-b"):
        await cluster.start_agent(n)
        await grant(cluster, n, "a")
    await seed_db(cluster, bare_record(), ["node-a", "node-b"])
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    a = await acquire(stub, "a", "g")
    assert a.grant_epoch == 6 and not a.context_restored
    granted = await ev.wait_for(K.KIND_GRANTED, job="a")
    assert granted.detail == "zero-cost"
    assert "SWITCH_STARTED" not in ev.kinds()
    ev.cancel()


async def test_disagreeing_agents_get_their_extras_evicted(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await grant(cluster, "node-a", "a")
    await grant(cluster, "node-b", "c")
    await seed_db(cluster, bare_record("a"), ["node-a", "node-b"])
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    stub = cluster.stub()
    st = await status(stub)
    assert st.loaded_job == ""
    await acquire(stub, "b", "g")
    assert await states(cluster, "b") == [RUNNING, RUNNING]
    assert await cluster.agents["node-a"].state("a") == SAVED
    assert await cluster.agents["node-b"].state("c") == SAVED


async def test_recovery_waits_for_unreachable_agents(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await grant(cluster, "node-a", "a")
    address = cluster.agents["node-a"].address
    port = int(address.rsplit(":", 1)[1])
    await seed_db(cluster, bare_record("a"), ["node-a"])
    await cluster.stop_agent("node-a")
    cfg = cluster.config(
        topology={"groups": {"g": {"nodes": [{"name": "node-a", "agent": address}]}}},
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
    )
    await cluster.start_orchestrator(cfg)
    stub = cluster.stub()
    st = await status(stub)
    assert st.group_state == GS.STATE_UNKNOWN and "node-a" in st.detail
    a_task = asyncio.ensure_future(acquire(stub, "a", "g"))
    await cluster.start_agent("node-a", port=port)
    a = await a_task
    assert a.grant_epoch == 6 and not a.context_restored  # verified, then zero-cost


# ---- a real process killed with SIGKILL ------------------------------------------------------


class OrchestratorProcess:
    """``tslice orchestrator`` over a topology, on a fixed port (tests.harness.servers)."""

    def __init__(self, tmp: pathlib.Path, topology: dict[str, object], port: int) -> None:
        self.port = port
        self.topology = tmp / "topology.yaml"
        self.topology.write_text(yaml.safe_dump(topology))
        args = ["--topology", str(self.topology), "--port", str(port)]
        args += ["--state-dir", str(tmp / "orch"), "--metrics-port", "0"]
        self.server = Server("orchestrator", args, tmp / "orch.log", start=False)

    def start(self) -> None:
        self.server.start()

    async def serving(self) -> grpc.aio.Channel:
        address = await asyncio.to_thread(self.server.wait_ready)
        assert address == f"127.0.0.1:{self.port}"
        return grpc.aio.insecure_channel(address)

    def kill(self) -> None:
        self.server.kill()

    def terminate(self) -> int:
        return self.server.terminate()


async def test_sigkill_mid_switch_then_restart_finishes_the_switch(
    cluster: Cluster, tmp_path: pathlib.Path
) -> None:
    await cluster.start_agent("node-a", sim={"extra_latency_s": 1.5})
    await cluster.start_agent("node-b")
    topology = {
        "groups": {
            "g": {
                "nodes": [
                    {"name": n, "agent": cluster.agents[n].address} for n in ("node-a", "node-b")
                ]
            }
        }
    }
    orch = OrchestratorProcess(tmp_path, topology, free_port())
    orch.start()
    channel = await orch.serving()
    try:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        await acquire(stub, "a", "g")
        ev = await Events.open(stub, "g")
        b_task = asyncio.ensure_future(acquire(stub, "b", "g"))
        await ev.wait_for(K.KIND_QUEUED, job="b")
        await yield_(stub, "a", "g")
        await ev.wait_for(K.KIND_SWITCH_STARTED, job="b")
        # SWITCH_STARTED goes out once every node's Grant is under way: node-a's is in the
        # middle of a 1.5-s snapshot, so the kill cuts an agent call that is changing state.
        orch.kill()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await b_task
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()

        orch.start()
        channel = await orch.serving()
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        b = await acquire(stub, "b", "g")  # the client library re-issues its Acquire
        assert b.success and b.grant_epoch == 2
        assert await states(cluster, "a") == [SAVED, SAVED]
        assert await states(cluster, "b") == [RUNNING, RUNNING]
        # queued jobs re-issue too and keep being served
        a_task = asyncio.ensure_future(acquire(stub, "a", "g"))
        ev = await Events.open(stub, "g")
        await yield_(stub, "b", "g")
        a = await a_task
        assert a.context_restored and a.grant_epoch == 3
        ev.cancel()
        assert orch.terminate() == 0
    finally:
        await channel.close()
        orch.kill()
