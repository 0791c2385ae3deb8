"""A node leaving a group does not strand that group's state there (issue 22 §4).

gpu-c carries the trainer and the sampler labels (their devices are the same). job-d
acquires and yields the trainer: nobody waits, so its state stays resident there. The
trainer label is then taken off gpu-c, and job-f acquires the sampler. The trainer's
state on gpu-c is nobody's business any more: it gives way, as a deferred resident of
an overlapping group does, instead of making every restore of job-f fail for want of
memory (and gpu-c degraded for the sampler, with nothing ``clear-degraded`` could do).
The device journals are checked."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lightkube")

from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.stack import WAIT_S, Cluster, exclusive_sim
from tslice.client import AsyncClient
from tslice.sim import checker


async def test_a_groups_state_left_on_a_node_that_left_it_gives_way(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    api.apply(objects.job_pod("job-d-trainer-0", "job-d", "trainer"))
    api.apply(objects.job_pod("job-f-sampler-0", "job-f", "sampler"))
    api.apply(objects.node("gpu-c", "trainer", "sampler"))
    address = cluster.start({"gpu-c": exclusive_sim().flags()})
    win_d = checker.Window(job="job-d", group="trainer", requested=time.time())
    async with AsyncClient(address, job_id="job-d", lease_s=None) as d:
        await d.acquire("trainer", timeout=WAIT_S)
        win_d.acquired = time.time()
        win_d.yielded = time.time()
        assert (await d.yield_("trainer")).snapshot_deferred  # job-d stays resident
    api.apply(objects.node("gpu-c", "sampler"))
    cluster.logged(r"group trainer is gone \(.*\); it stops")
    win_f = checker.Window(job="job-f", group="sampler", requested=time.time())
    async with AsyncClient(address, job_id="job-f", lease_s=None) as f:
        assert (await f.acquire("sampler", timeout=WAIT_S)).success
        win_f.acquired = time.time()
        status = await f.status("sampler")
        assert status.locking_job == "job-f" and not status.degraded
        win_f.yielded = time.time()
        await f.yield_("sampler")
    violations = checker.check(
        journal=cluster.journal(),
        windows=[win_d, win_f],
        group_nodes={"trainer": ["gpu-c"], "sampler": ["gpu-c"]},
        conflicts={"trainer": ["sampler"], "sampler": ["trainer"]},
    )
    assert violations == []
