"""Restarting the orchestrator of a LocalCluster in the middle of a switch, for the
chaos tests of crash recovery."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Iterator

from tslice.client import AsyncClient, EventKind, OrchestratorEvent
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster


async def next_of(events: AsyncIterator[OrchestratorEvent], job: str) -> OrchestratorEvent:
    """The next event of ``job`` on ``events``."""
    async for event in events:
        if event.job_id == job:
            return event
    raise AssertionError(f"the event stream ended before an event of {job}")


@contextlib.contextmanager
def frozen(cluster: LocalCluster, name: str) -> Iterator[None]:
    """Process ``name`` stopped (SIGSTOP) inside the block: an agent frozen from before a
    switch starts answers none of its calls, so the switch is still in flight when the
    block kills what it kills, however long that takes."""
    pid = cluster.pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def restart_until_rolled_forward(cluster: LocalCluster, group: str, job: str) -> None:
    """Restart the (killed) orchestrator and wait until the switch it finds on disk is
    rolled forward and grants ``job`` (who holds ``group`` when this returns)."""
    await asyncio.to_thread(cluster.restart, ORCHESTRATOR)
    async with AsyncClient(cluster.orchestrator_address, job_id="watcher", lease_s=None) as w:
        events = w.watch_events(group, kinds=[EventKind.SWITCH_DONE])
        await events.started()
        if (await w.status(group)).locking_job != job:
            await asyncio.wait_for(next_of(events, job), 20)
        await events.aclose()
        assert (await w.status(group)).locking_job == job
