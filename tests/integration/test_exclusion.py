"""End to end on real processes: mutual exclusion under load and across an orchestrator crash.

An orchestrator and four simulated agents run as separate processes on 127.0.0.1
(``tslice.sim.cluster.LocalCluster``): group ``g1`` spans node-1 and node-2, group ``g2``
node-3 and node-4. Each job's footprint is 50 GiB of an 80 GiB device, so two jobs can
never be resident together without the simulated device refusing it. The checker replays
every device journal against the windows the jobs saw and proves exclusion throughout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest

from tslice.client import AsyncClient, EventKind
from tslice.common import errors
from tslice.sim import checker
from tslice.sim.cluster import LocalCluster, SimAgent

pytestmark = pytest.mark.slow

GiB = 1024**3
GROUPS = {"g1": ("node-1", "node-2"), "g2": ("node-3", "node-4")}


@dataclasses.dataclass
class Window(checker.Window):
    context_restored: bool = False


def _cluster(*, latency_s: float, bandwidth: int) -> LocalCluster:
    agents = [
        SimAgent(
            name=name,
            capacity_bytes=80 * GiB,
            footprint_bytes=50 * GiB,
            bandwidth_bytes_per_s=bandwidth,
            latency_s=latency_s,
        )
        for nodes in GROUPS.values()
        for name in nodes
    ]
    return LocalCluster(agents=agents, groups=GROUPS)


async def _run_job(
    address: str,
    job: str,
    *,
    cycles: int,
    seed: int,
    windows: list[Window],
    hold_max_s: float,
) -> None:
    """``cycles`` acquire/hold/yield cycles on random groups with random phase lengths."""
    rng = random.Random(seed)
    async with AsyncClient(address, job_id=job) as client:
        for _ in range(cycles):
            group = rng.choice(sorted(GROUPS))
            window = Window(job=job, group=group, requested=time.time())
            windows.append(window)
            try:
                result = await client.acquire(group, timeout=60)
            except errors.TsliceError as err:
                window.error = str(err)
                raise
            window.acquired = time.time()
            window.context_restored = result.context_restored
            await asyncio.sleep(rng.uniform(0, hold_max_s))
            # The window closes before the Yield RPC: the device may be snapshotted as
            # soon as the orchestrator has read it.
            window.yielded = time.time()
            await client.yield_(group)
            await asyncio.sleep(rng.uniform(0, hold_max_s))


def _verdict(cluster: LocalCluster, windows: list[Window]) -> list[checker.Violation]:
    return checker.check(
        journal=cluster.read_journals(), windows=windows, group_nodes=cluster.group_nodes()
    )


async def test_three_jobs_fifty_cycles_two_groups_of_two_nodes_stay_exclusive() -> None:
    windows: list[Window] = []
    with _cluster(latency_s=0.002, bandwidth=4000 * 10**9) as cluster:
        address = cluster.orchestrator_address
        await asyncio.gather(
            *(
                _run_job(address, f"job-{i}", cycles=50, seed=i, windows=windows, hold_max_s=0.01)
                for i in range(3)
            )
        )
        violations = _verdict(cluster, windows)
        journal = cluster.read_journals()

    assert len(windows) == 150 and all(w.acquired and w.yielded for w in windows)
    assert violations == [], "\n".join(map(str, violations))
    # Not vacuous: jobs really were moved off and back onto the devices, on every node.
    frees = {(e.node, e.job) for e in journal if e.event == "free"}
    assert {node for node, _ in frees} == {n for nodes in GROUPS.values() for n in nodes}
    assert sum(w.context_restored for w in windows) >= 10


async def test_orchestrator_sigkill_mid_switch_loses_nothing() -> None:
    """SIGKILL the orchestrator while a switch is in flight, restart it on the same port and
    state: every job finishes (the client re-acquires transparently) and exclusion held."""
    windows: list[Window] = []
    # 50 GiB at 250 GB/s: each snapshot or restore takes ~0.2 s, so a switch is long enough
    # to be caught in the middle.
    with _cluster(latency_s=0.01, bandwidth=250 * 10**9) as cluster:
        address = cluster.orchestrator_address
        jobs = [
            asyncio.create_task(
                _run_job(
                    address, f"job-{i}", cycles=12, seed=10 + i, windows=windows, hold_max_s=0.05
                )
            )
            for i in range(3)
        ]
        kills = 0
        async with AsyncClient(address, job_id="watcher") as watcher:
            events = watcher.watch_events()
            try:
                async for event in events:
                    if event.kind is EventKind.SWITCH_STARTED and event.from_job:
                        # A resident job is being snapshotted right now.
                        cluster.kill("orchestrator")
                        kills += 1
                        break
            finally:
                await events.aclose()  # type: ignore[attr-defined]
        await asyncio.to_thread(cluster.restart, "orchestrator")
        await asyncio.wait_for(asyncio.gather(*jobs), timeout=90)
        violations = _verdict(cluster, windows)

    assert kills == 1
    assert len(windows) == 36 and all(w.acquired and w.yielded for w in windows), [
        w for w in windows if not (w.acquired and w.yielded)
    ]
    assert violations == [], "\n".join(map(str, violations))
