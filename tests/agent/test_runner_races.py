"""The runner under interleavings a test can only reach by holding a job's lock itself:
what a Grant does when the records move between its plan and its move."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from tests.agent.agent_doubles import GatedBackend
from tslice.agent import metrics
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan, runner
from tslice.agent.state import store


async def _steps_until(condition: Callable[[], bool], *, limit: int = 1000) -> None:
    """Let the loop run until ``condition`` holds (each step one turn; no clock involved)."""
    for _ in range(limit):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def _order(core: runner.AgentCore, job_id: str, *, epoch: int, evict: str = "") -> grant_plan.Order:
    return grant_plan.order(
        job_id=job_id,
        group="g",
        epoch=epoch,
        footprint_bytes=0,
        config=None,
        evict=[core.key(evict, "g")] if evict else [],
    )


async def test_an_eviction_whose_state_left_meanwhile_moves_on_to_bring_the_job_in(
    tmp_path: Path,
) -> None:
    backend = GatedBackend()
    db = await store.Store.open(tmp_path)
    core = runner.AgentCore(
        node="n",
        backends={"gated": backend},
        default_backend="gated",
        store=db,
        agent_metrics=metrics.AgentMetrics(),
    )
    await core.start()
    try:
        assert (await core.grant(_order(core, "a", epoch=1))).granted  # a activated
        snapshot = await core.directive(model.Kind.SNAPSHOT, job_id="a", group="g", config=None)
        assert snapshot.status is model.OpStatus.PENDING  # a is TRANSITIONING
        lock = core._locks["a"]
        await lock.acquire()
        backend.release()  # a's snapshot returns; its outcome waits for a's lock
        await _steps_until(lambda: len(lock._waiters or ()) == 1)
        # The Grant plans to evict a (still TRANSITIONING), then waits for a's lock too.
        granting = asyncio.ensure_future(core.grant(_order(core, "b", epoch=2, evict="a")))
        await _steps_until(lambda: len(lock._waiters or ()) == 2)
        lock.release()  # a's outcome first (SAVED); then the eviction finds nothing to do
        outcome = await asyncio.wait_for(granting, timeout=10.0)
        assert outcome.granted and outcome.state is model.State.RUNNING
        b = core.job("b", "g")
        assert b is not None and b.state is model.State.RUNNING  # b was brought in
        a = core.job("a", "g")
        assert a is not None and a.state is model.State.SAVED
    finally:
        await core.close(grace_s=1.0)
        await db.close()
