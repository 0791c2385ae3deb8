"""Restarting the orchestrator of a LocalCluster in the middle of a switch, for the
chaos tests of crash recovery."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator

from tslice.client import AsyncClient, EventKind, OrchestratorEvent
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster


async def next_of(events: AsyncIterator[OrchestratorEvent], job: str) -> OrchestratorEvent:
    """The next event of ``job`` on ``events``."""
    async for event in events:
        if event.job_id == job:
            return event
    raise AssertionError(f"the event stream ended before an event of {job}")


@contextlib.contextmanager
def frozen(cluster: LocalCluster, name: str) -> Iterator[Callable[[], None]]:
    """Process ``name`` stopped (SIGSTOP) inside the block, or until the block calls what
    it is given: an agent frozen from before a switch starts answers none of its calls, so
    the switch is still in flight when the block acts, however long that takes."""
    pid = cluster.pid(name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGSTOP)
    thaw = functools.partial(os.kill, pid, signal.SIGCONT)
    try:
        yield thaw
    finally:
        thaw()


async def restart_until_rolled_forward(
    cluster: LocalCluster, group: str, job: str, *, agent: str = "node-1"
) -> None:
    """Restart the (killed) orchestrator and wait until the switch it finds on disk is
    rolled forward and grants ``job``: its SWITCH_DONE.

    ``agent``, a node of the group, is frozen until the events are watched, so that the
    switch cannot end unseen. A status is no proof: a recovered switch names its target as
    the holder while it still runs, and once it is done the grant of a target that is gone
    may lose its lease before a status call on a slow machine."""
    with frozen(cluster, agent) as thaw:
        await asyncio.to_thread(cluster.restart, ORCHESTRATOR)
        address = cluster.orchestrator_address
        async with AsyncClient(address, job_id="watcher", lease_s=None) as w:
            events = w.watch_events(group, kinds=[EventKind.SWITCH_DONE])
            await events.started()
            thaw()
            await asyncio.wait_for(next_of(events, job), 20)
            await events.aclose()
