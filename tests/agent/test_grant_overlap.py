"""A Grant whose backend overlaps moves brings the job in while it evicts (issue 9 §2), and
Restore with ``prefetch`` brings a saved state in ahead of its grant: planned purely,
then through a real agent on loopback."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from tests.agent.conftest import AgentRunner, GiB
from tests.agent.grant_calls import a_running_b_saved, rpc_error, step
from tests.agent.grant_records import TARGET, order, rec, records
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

S = model.State
COMPLETE = pb.OPERATION_STATUS_COMPLETE


def move(grant: grant_plan.Order, *found: model.Job, overlap: bool = True) -> grant_plan.Move:
    return grant_plan.next_move(grant, records(*found), target=TARGET, overlap=overlap)


# ---- planned ----------------------------------------------------------------------------------


def test_an_overlapping_backend_brings_a_saved_job_in_with_the_evictions() -> None:
    grant = order(evict=[("j0", "g")], restore=True)
    found = (rec("j0", S.RUNNING), rec("j1", S.SAVED))
    assert move(grant, *found) == grant_plan.Evict((("j0", "g"),), bring_in=True)
    # Sequential where the backend does not overlap, or nothing is to be restored.
    assert move(grant, *found, overlap=False) == grant_plan.Evict((("j0", "g"),))
    assert move(order(evict=[("j0", "g")]), *found) == grant_plan.Evict((("j0", "g"),))
    assert move(grant, rec("j0", S.RUNNING)) == grant_plan.Evict((("j0", "g"),))


def test_no_overlap_while_another_group_must_give_way_or_an_evictee_is_faulted() -> None:
    grant = order(evict=[("j0", "g")], give_way=[("k", "h")], restore=True)
    found = (rec("j0", S.RUNNING), rec("j1", S.SAVED), rec("k", S.RUNNING, group="h"))
    assert move(grant, *found) == grant_plan.Evict((("j0", "g"),))
    faulted = (rec("j0", S.FAULTED), rec("j1", S.SAVED))
    assert move(order(evict=[("j0", "g")], restore=True), *faulted) == grant_plan.Evict(
        (("j0", "g"),)
    )


# ---- through an agent -------------------------------------------------------------------------

OVERLAPPING = {"chunks": 4, "overlap": True, "prefetch": True}


async def test_the_grant_runs_snapshot_and_restore_at_once(
    agents: AgentRunner, caplog: pytest.LogCaptureFixture
) -> None:
    agent = await agents.start(backend_settings={"sim": OVERLAPPING})
    await a_running_b_saved(agent)
    caplog.set_level(logging.INFO, logger="tslice.agent.moves.runner")
    caplog.clear()
    reply = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"]))
    assert reply.granted and reply.restored
    kinds = [(op.job_id, op.kind, op.status) for op in reply.operations]
    assert kinds == [("job-a", "snapshot", COMPLETE), ("job-b", "restore", COMPLETE)]
    # The restore started before the snapshot ended: it did not wait for it.
    said = [r.getMessage() for r in caplog.records]
    started = said.index("restore of job job-b started on backend sim")
    ended = next(i for i, m in enumerate(said) if m.startswith("snapshot of job job-a complete"))
    assert started < ended
    assert await agent.state("job-a") == pb.JOB_STATE_SAVED
    assert await agent.state("job-b") == pb.JOB_STATE_RUNNING


async def test_prefetch_keeps_the_job_saved_and_a_later_grant_finds_it_in(
    agents: AgentRunner,
) -> None:
    # Restores crawl (4 GiB in ~1.4 s): a Grant that had to copy could not end within 1 s.
    slow = {"capacity": "10GiB", "restore_bandwidth": "3GB/s"}
    agent = await agents.start(backend_settings={"sim": OVERLAPPING}, sim=slow)
    assert (await agent.stub.Status(pb.StatusRequest())).features.prefetch
    await agent.grant("job-b", epoch=1)
    await agent.snapshot("job-b")
    await agent.grant("job-a", epoch=2)  # 4 GiB each on 10 GiB: b fits beside a
    reply = await agent.stub.Restore(pb.RestoreRequest(job_id="job-b", group="g", prefetch=True))
    assert reply.operation_id == ""
    # The agent reports b's bytes on the device beside a's while b stays SAVED.
    for _ in range(500):
        used = (await agent.stub.Status(pb.StatusRequest())).accelerator_statuses[0]
        if used.memory_used_bytes == 8 * GiB:
            break
        await asyncio.sleep(0.01)
    assert used.memory_used_bytes == 8 * GiB
    assert await agent.state("job-b") == pb.JOB_STATE_SAVED
    granted = await agent.stub.Grant(step("job-b", epoch=3, evict=["job-a"], wait_ms=1000))
    assert granted.granted and granted.restored
    assert await agent.state("job-b") == pb.JOB_STATE_RUNNING


async def test_prefetch_is_refused_unless_saved_and_declared(agents: AgentRunner) -> None:
    agent = await agents.start(backend_settings={"sim": OVERLAPPING})
    await agent.grant("job-a")
    err = await rpc_error(
        agent.stub.Restore(pb.RestoreRequest(job_id="job-a", group="g", prefetch=True))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "only a SAVED job's state is prefetched" in (err.details() or "")
    plain = await agents.start(state_dir=str(agents.tmp_path / "plain"), node_name="node-b")
    await plain.grant("job-b")
    await plain.snapshot("job-b")
    err = await rpc_error(
        plain.stub.Restore(pb.RestoreRequest(job_id="job-b", group="g", prefetch=True))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not prefetch" in (err.details() or "")
    assert await plain.state("job-b") == pb.JOB_STATE_SAVED
