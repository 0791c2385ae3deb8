"""A leaseless job (llm-d's unary clients: Acquire, never Hold) is the target of a switch
when the orchestrator is SIGKILLed. After the restart the switch is rolled forward and
the target holds the group, but its Acquire died with the old process: the grant was
never delivered. It has ``--reattach-grace`` to re-issue its Acquire and claim it. When
the orchestrator was killed once more before that, the holder on disk looked like one
whose client got the reply: with no lease and no grace it kept the group for ever, and
every other job waited behind a holder that did not exist.

Real processes: an orchestrator and one sim agent whose copies take COPY_S; the agent is
frozen (SIGSTOP) from before a yields until the orchestrator is dead, so the switch is
caught in the middle however slow the machine is (a loaded one could otherwise take
longer than a copy between the switch's start and the kill, and b would get its grant);
the device journal is checked against the jobs' windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import pytest

from tests.chaos.restarts import frozen, next_of, restart_until_rolled_forward
from tslice.client import AsyncClient, EventKind
from tslice.sim import checker
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster, SimAgent

COPY_S = 0.5
#: Long enough to restart twice inside it and to watch the events after the second start
#: (else b's release is missed): 2.5 s at load 3 on two cores, which 6 s left a slow runner
#: little room for; c waits the grace out, so the test takes about this long.
GRACE_S = 10.0


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    node = SimAgent(name="node-1", latency_s=COPY_S, bandwidth_bytes_per_s=10**15)
    args = ["--reattach-grace", str(GRACE_S)]
    with LocalCluster(agents=[node], groups={"g": ("node-1",)}, orchestrator_args=args) as c:
        yield c


async def test_an_unclaimed_grant_is_released_after_a_second_restart(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_address
    windows: list[checker.Window] = []
    async with (
        AsyncClient(address, job_id="a", lease_s=None) as a,
        AsyncClient(address, job_id="b", lease_s=None) as b,
        AsyncClient(address, job_id="watcher", lease_s=None) as watcher,
    ):
        wa = checker.Window(job="a", group="g", requested=time.time())
        windows.append(wa)
        await a.acquire("g", timeout=20)
        wa.acquired = time.time()
        events = watcher.watch_events("g", kinds=[EventKind.QUEUED, EventKind.SWITCH_STARTED])
        await events.started()
        b_acquire = asyncio.create_task(b.acquire("g", timeout=60))
        await asyncio.wait_for(next_of(events, "b"), 20)  # queued
        with frozen(cluster, "node-1"):
            wa.yielded = time.time()
            await a.yield_("g")
            await asyncio.wait_for(next_of(events, "b"), 20)  # the switch a -> b started
            # Mid-switch (node-1 answers nothing): the orchestrator dies with b's Acquire,
            # and b's client gives up on it (a unary client whose process went away).
            cluster.kill(ORCHESTRATOR)
        b_acquire.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await b_acquire
        with contextlib.suppress(Exception):
            await events.aclose()

    # The switch is rolled forward and grants b, who is not there to claim it; the
    # orchestrator is killed again while b's grace still runs.
    await restart_until_rolled_forward(cluster, "g", "b")
    cluster.kill(ORCHESTRATOR)
    await asyncio.to_thread(cluster.restart, ORCHESTRATOR)

    async with (
        AsyncClient(address, job_id="watcher", lease_s=None) as watcher,
        AsyncClient(address, job_id="c", lease_s=None) as c,
    ):
        released = watcher.watch_events("g", kinds=[EventKind.CANCELLED])
        await released.started()
        wc = checker.Window(job="c", group="g", requested=time.time())
        windows.append(wc)
        # b never came back: by the end of its grace (counted from the first restart)
        # it loses the lock and c is granted.
        granted = await c.acquire("g", timeout=GRACE_S + 20)
        wc.acquired = time.time()
        assert granted.success
        assert (await c.status("g")).locking_job == "c"
        why = await asyncio.wait_for(next_of(released, "b"), 10)
        await released.aclose()
        assert "never claimed" in why.detail, why
        wc.yielded = time.time()
        await c.yield_("g")

    violations = checker.check(
        journal=cluster.read_journals(), windows=windows, group_nodes=cluster.group_nodes()
    )
    assert violations == [], "\n".join(map(str, violations))
