"""A caller that goes away mid-request never leaves a job half-changed.

gRPC aio cancels the handler coroutine when the client disconnects (an orchestrator
SIGKILLed mid-call). These tests deliver that cancellation at the worst moment: while
the store writes the job as TRANSITIONING, before the backend call is started. The
store is the real SQLite store; a hook in its ``commit`` cancels the task that is
writing, so the moment is hit deterministically. (Before the fix, the write was
awaited, the cancellation landed there, and the job stayed TRANSITIONING with an
operation that never ran.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from tslice.agent import metrics
from tslice.agent.backends import noop
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan, runner
from tslice.agent.state import store


class CancellingStore(store.Store):
    """A real store; once armed, its next write of a TRANSITIONING job cancels the writer."""

    armed = False
    fired = False

    def commit(
        self,
        *,
        jobs: Sequence[model.Job] = (),
        ops: Sequence[model.Operation] = (),
        marks: Sequence[model.GrantMark] = (),
        previous: model.Job | None,
    ) -> None:
        if self.armed and any(j.state is model.State.TRANSITIONING for j in jobs):
            self.armed = False
            writer = asyncio.current_task()
            assert writer is not None
            writer.cancel()  # the caller disconnects while the write is in progress
            self.fired = True
        super().commit(jobs=jobs, ops=ops, marks=marks, previous=previous)


class Node:
    """An agent core on a gated store, restartable on the same state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.db: CancellingStore | None = None
        self.core: runner.AgentCore | None = None

    async def start(self) -> runner.AgentCore:
        self.db = await CancellingStore.open(self.state_dir)
        self.core = runner.AgentCore(
            node="node-a",
            backends={"noop": noop.NoopBackend()},
            default_backend="noop",
            store=self.db,
            agent_metrics=metrics.AgentMetrics(),
        )
        await self.core.start()
        return self.core

    async def stop(self) -> None:
        if self.core is not None:
            await self.core.close(grace_s=5.0)
        if self.db is not None:
            await self.db.close()
        self.core = self.db = None


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path / "agent")
    await n.start()
    try:
        yield n
    finally:
        await n.stop()


async def grant(core: runner.AgentCore, job_id: str, **kw: Any) -> grant_plan.GrantOutcome:
    wait_s = kw.pop("wait_s", runner.DEFAULT_GRANT_WAIT_S)
    evict = [core.key(other, "g") for other in kw.pop("evict", ())]
    order = grant_plan.order(
        job_id=job_id,
        group="g",
        epoch=kw.pop("epoch", 0),
        footprint_bytes=0,
        config=None,
        evict=evict,
        **kw,
    )
    return await core.grant(order, wait_s=wait_s)


async def cancel_while_storing(
    db: CancellingStore, request: Callable[[], Coroutine[Any, Any, object]]
) -> None:
    """Run ``request``, cancelled while it stores a TRANSITIONING job."""
    db.armed = True
    call = asyncio.ensure_future(request())
    with pytest.raises(asyncio.CancelledError):
        await call
    assert db.fired


async def settled(core: runner.AgentCore, job_id: str) -> model.Job:
    """The job once its last operation has finished (bounded, event-driven wait)."""
    job = core.job(job_id)
    assert job is not None
    op = await core.wait_operation(job.operation_id, timeout_s=5.0)
    assert op.finished, f"operation {op.op_id} of job {job_id} never finished: {op}"
    final = core.job(job_id)
    assert final is not None
    return final


async def assert_persisted(node: Node, expected: dict[str, model.State]) -> None:
    await node.stop()
    core = await node.start()
    assert {j: core.job(j).state for j in expected} == expected  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["snapshot", "restore", "activate"])
async def test_cancelled_request_still_finishes_its_operation(node: Node, kind: str) -> None:
    core, db = node.core, node.db
    assert core is not None and db is not None
    if kind == "activate":

        def request() -> Coroutine[Any, Any, object]:
            return grant(core, "job-a")

        expected = model.State.RUNNING
    else:
        await grant(core, "job-a")
        if kind == "restore":
            await core.directive(
                model.Kind.SNAPSHOT, job_id="job-a", group="g", config=None, wait_s=5.0
            )

        def request() -> Coroutine[Any, Any, object]:
            return core.directive(model.Kind(kind), job_id="job-a", group="g", config=None)

        expected = model.State.SAVED if kind == "snapshot" else model.State.RUNNING

    await cancel_while_storing(db, request)

    job = await settled(core, "job-a")
    assert job.state is expected
    assert core.get_operation(job.operation_id).status is model.OpStatus.COMPLETE
    await assert_persisted(node, {"job-a": expected})


async def test_cancelled_one_step_grant_leaves_every_move_whole_and_can_be_reissued(
    node: Node,
) -> None:
    core, db = node.core, node.db
    assert core is not None and db is not None
    assert (await grant(core, "job-a", epoch=1)).granted
    await core.directive(model.Kind.SNAPSHOT, job_id="job-a", group="g", config=None, wait_s=5.0)
    assert (await grant(core, "job-b", epoch=2)).granted
    await core.directive(model.Kind.SNAPSHOT, job_id="job-b", group="g", config=None, wait_s=5.0)
    await core.directive(model.Kind.RESTORE, job_id="job-a", group="g", config=None, wait_s=5.0)

    # Cut while the eviction of job-a is being stored.
    await cancel_while_storing(
        db,
        lambda: grant(core, "job-b", epoch=3, evict=["job-a"], restore=True, wait_s=5.0),
    )
    assert (await settled(core, "job-a")).state is model.State.SAVED

    again = await grant(core, "job-b", epoch=3, evict=["job-a"], restore=True, wait_s=5.0)
    assert again.granted and again.restored and again.state is model.State.RUNNING
    await assert_persisted(node, {"job-a": model.State.SAVED, "job-b": model.State.RUNNING})
