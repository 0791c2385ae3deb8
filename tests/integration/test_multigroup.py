"""End to end on real processes: residency per (job, group) when groups share devices.

Each job takes random groups, sometimes two at once (a weight sync holds a sampler and
a trainer pool), in local mode (every group spans every device of every node, so all
groups share devices) and in a topology whose groups overlap on some nodes. A job's
state for each group is a separate allocation on the simulated devices; three of them
never fit on a device, so idle groups' deferred residents must give way. The checker
replays every device journal against the windows the jobs saw: per (job, group) a
job's state was resident for the whole of each window, no two jobs of a group were
ever resident together, and no two jobs held groups that share devices at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence

import pytest

from tslice.client import AsyncClient
from tslice.sim import checker
from tslice.sim.checker import Window
from tslice.sim.cluster import LocalCluster, SimAgent

pytestmark = pytest.mark.slow

GiB = 1024**3
GROUPS = ("g1", "g2", "g3")
# g1 and g2 share node-2, g2 and g3 share node-3; g1 and g3 share nothing.
OVERLAPPING = {"g1": ("node-1", "node-2"), "g2": ("node-2", "node-3"), "g3": ("node-3",)}


def _cluster(nodes: Sequence[str], groups: Mapping[str, Sequence[str]] | None) -> LocalCluster:
    # 30 GiB of 80: two states of a device's groups fit, a third makes one give way.
    agents = [
        SimAgent(
            name=name,
            capacity_bytes=80 * GiB,
            footprint_bytes=30 * GiB,
            bandwidth_bytes_per_s=4000 * 10**9,
            latency_s=0.002,
        )
        for name in nodes
    ]
    return LocalCluster(agents=agents, groups=groups)


async def _run_job(
    address: str, job: str, *, cycles: int, seed: int, windows: list[Window]
) -> None:
    rng = random.Random(seed)
    async with AsyncClient(address, job_id=job, lease_s=None) as client:
        for _ in range(cycles):
            # Sometimes two groups at once, always taken in one global (sorted) order.
            count = 2 if rng.random() < 0.3 else 1
            groups = sorted(rng.sample(GROUPS, count))
            held: list[Window] = []
            for group in groups:
                window = Window(job=job, group=group, requested=time.time())
                windows.append(window)
                await client.acquire(group, timeout=60)
                window.acquired = time.time()
                held.append(window)
            await asyncio.sleep(rng.uniform(0, 0.01))
            for window in reversed(held):
                # The window closes before the Yield RPC (the state may move right after).
                window.yielded = time.time()
                await client.yield_(window.group)
            await asyncio.sleep(rng.uniform(0, 0.01))


async def _run(cluster: LocalCluster, *, jobs: int, cycles: int) -> list[Window]:
    windows: list[Window] = []
    await asyncio.gather(
        *(
            _run_job(
                cluster.orchestrator_address, f"job-{i}", cycles=cycles, seed=i, windows=windows
            )
            for i in range(jobs)
        )
    )
    return windows


async def test_local_mode_random_multi_group_runs_keep_residency_per_job_and_group() -> None:
    with _cluster(["node-1", "node-2"], None) as cluster:
        windows = await _run(cluster, jobs=3, cycles=25)
        journal = cluster.read_journals()
        # Local mode: every group spans every node and shares its devices.
        conflicts = {g: set(GROUPS) - {g} for g in GROUPS}
        violations = checker.check(journal=journal, windows=windows, conflicts=conflicts)

    assert all(w.acquired and w.yielded for w in windows)
    assert violations == [], "\n".join(map(str, violations))
    # Not vacuous: every group was used, states moved off and back, by more than one job.
    assert {w.group for w in windows} == set(GROUPS)
    assert len({(e.job, e.group) for e in journal if e.event == "free"}) >= 4
    # One job held two groups at once somewhere (the nested case).
    nested = [
        (a, b)
        for a in windows
        for b in windows
        if a.job == b.job
        and a.group < b.group
        and a.acquired
        and b.acquired
        and a.acquired <= b.acquired <= (a.yielded or 0)
    ]
    assert nested


async def test_overlapping_topology_random_multi_group_runs_keep_residency() -> None:
    nodes = sorted({n for ns in OVERLAPPING.values() for n in ns})
    with _cluster(nodes, OVERLAPPING) as cluster:
        windows = await _run(cluster, jobs=3, cycles=25)
        journal = cluster.read_journals()
        violations = checker.check(
            journal=journal, windows=windows, group_nodes=cluster.group_nodes()
        )

    assert all(w.acquired and w.yielded for w in windows)
    assert violations == [], "\n".join(map(str, violations))
    assert {w.group for w in windows} == set(GROUPS)
    # g1 and g3 share no device: they were held by different jobs at the same time.
    together = [
        (a, b)
        for a in windows
        for b in windows
        if a.group == "g1"
        and b.group == "g3"
        and a.job != b.job
        and a.acquired
        and b.acquired
        and a.yielded
        and b.yielded
        and a.acquired < b.yielded
        and b.acquired < a.yielded
    ]
    assert together, "disjoint groups never ran concurrently"
