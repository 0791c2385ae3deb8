"""AcquireSet in local mode (the shipped LocalCluster): every group spans every device of
every agent, so all groups share devices and a set's groups take the device claim
together. Random jobs take sets of 2-3 groups and single groups, named in random
orders; 25 GiB states on 80 GiB devices: one job's three fit together, a fourth state
makes one give way.
"""

from __future__ import annotations

import pytest

from tests.integration.acquire_set_stack import no_violations, random_jobs
from tslice.sim import checker
from tslice.sim.cluster import LocalCluster, SimAgent

pytestmark = pytest.mark.slow

GiB = 1024**3
GROUPS = ("g1", "g2", "g3")


async def test_random_jobs_taking_sets_in_local_mode_never_deadlock_nor_overlap() -> None:
    agents = [
        SimAgent(name=name, devices=2, capacity_bytes=80 * GiB, footprint_bytes=25 * GiB,
                 bandwidth_bytes_per_s=4000 * 10**9, latency_s=0.002)
        for name in ("node-1", "node-2")
    ]  # fmt: skip
    async with LocalCluster(agents=agents) as cluster:
        windows = await random_jobs(cluster.orchestrator_address, GROUPS)
        violations = checker.check(
            journal=cluster.read_journals(),
            windows=windows.seen,
            group_nodes={g: ("node-1", "node-2") for g in GROUPS},
            conflicts={g: set(GROUPS) - {g} for g in GROUPS},
        )
    assert violations == [], no_violations(violations)
