"""Found by the chaos suite: a switch rolled forward after an orchestrator restart granted
its target without the lease the target had asked for. When that client was gone (killed
during the switch) and the orchestrator restarted once more before the re-attach grace
ran out, the grant was on disk as an ordinary holder with no lease: a ghost holder that
no lease, grace or yield ever released, and every later Acquire of the group waited for
ever.

Real processes: an orchestrator and one sim agent whose copies take 3 s, a holder job
``b`` with a 1 s lease that is SIGKILLed while the switch to it runs, then the
orchestrator SIGKILLed twice. The agent is frozen (SIGSTOP) from before the switch
starts until the orchestrator is dead, so the switch is caught in the middle however
slow the machine is.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from tests.chaos.restarts import frozen, next_of, restart_until_rolled_forward
from tslice.client import AsyncClient, EventKind
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster, SimAgent

LEASE_S = 1.0
COPY_S = 3.0


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    node = SimAgent(name="node-1", latency_s=COPY_S, bandwidth_bytes_per_s=10**15)
    # A long re-attach grace: what releases the lock below is b's lease, not the grace.
    args = ["--reattach-grace", "120"]
    with LocalCluster(agents=[node], groups={"g": ("node-1",)}, orchestrator_args=args) as c:
        yield c


def _job_b(address: str) -> subprocess.Popen[str]:
    script = textwrap.dedent(
        f"""
        import time, tslice
        client = tslice.Client({address!r}, job_id="b", lease_s={LEASE_S})
        client.acquire("g")
        time.sleep(600)
        """
    )
    return subprocess.Popen([sys.executable, "-c", script], text=True, env=os.environ.copy())


# Remove the mark with the fix: strict, so the fix landing without it fails loudly.
async def test_a_recovered_grant_keeps_its_targets_lease_across_restarts(
    cluster: LocalCluster,
) -> None:
    address = cluster.orchestrator_address
    async with (
        AsyncClient(address, job_id="a", lease_s=None) as a,
        AsyncClient(address, job_id="watcher", lease_s=None) as watcher,
    ):
        await a.acquire("g", timeout=20)
        events = watcher.watch_events("g", kinds=[EventKind.QUEUED, EventKind.SWITCH_STARTED])
        await events.started()
        b = _job_b(address)
        try:
            await asyncio.wait_for(next_of(events, "b"), 20)  # queued
            with frozen(cluster, "node-1"):
                await a.yield_("g")
                await asyncio.wait_for(next_of(events, "b"), 20)  # the switch a -> b started
                # Mid-switch (node-1 answers nothing): b dies, then the orchestrator.
                b.kill()
                b.wait(10)
                cluster.kill(ORCHESTRATOR)
        finally:
            await events.aclose()
            if b.poll() is None:
                b.kill()
                b.wait()
    # The switch is rolled forward and grants b, who is not there to re-attach, and the
    # orchestrator restarts again before the grace is out.
    await restart_until_rolled_forward(cluster, "g", "b")
    cluster.kill(ORCHESTRATOR)
    await asyncio.to_thread(cluster.restart, ORCHESTRATOR)

    async with AsyncClient(address, job_id="c", lease_s=None) as c:
        # b's 1 s lease runs out (counted from the restart): c gets the group.
        granted = await c.acquire("g", timeout=15)
        assert granted.success
        assert (await c.status("g")).locking_job == "c"
