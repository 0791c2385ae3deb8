"""What comes for a group while it is stopped is kept until it is back (issue 22 §3).

A group whose only node is cordoned stops (its state stays persisted). Meanwhile its
holder's pods all go, or its holder yields: when the node is uncordoned the group comes
back from its record, and the eviction (or the yield) is applied first, as a restarted
orchestrator would have done, instead of leaving the lock with a job that is gone (with
leaseless clients, for ever). Waits are on log lines, events and replies; the device
journals are checked."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("lightkube")

from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.stack import WAIT_S, Cluster, events_of, exclusive_sim, next_event
from tslice.client import AsyncClient, EventKind
from tslice.sim import checker


def _cordon(api: ApiServerEmulator, cluster: Cluster, *, cordoned: bool) -> None:
    api.apply(objects.node("gpu-a", "trainer", unschedulable=cordoned))
    cluster.logged(
        r"group trainer is gone \(.*\); it stops"
        if cordoned
        else r"group trainer appeared with 1 node\(s\): gpu-a"
    )


async def test_a_holder_whose_pods_go_while_its_group_is_stopped_is_evicted_when_it_is_back(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    api.apply(objects.node("gpu-a", "trainer"))
    address = cluster.start({"gpu-a": exclusive_sim().flags()})
    win_a = checker.Window(job="job-a", group="trainer", requested=time.time())
    async with AsyncClient(address, job_id="job-a", lease_s=None) as a:
        await a.acquire("trainer", timeout=WAIT_S)
        win_a.acquired = time.time()
    _cordon(api, cluster, cordoned=True)
    api.store.delete("pods", "rl", "job-a-trainer-0")
    win_a.yielded = time.time()  # job-a is gone: it uses nothing from now on
    cluster.logged(r"Kubernetes: job job-a is gone")
    async with (
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
        events_of(b, None) as events,  # every group's: trainer has none while stopped
    ):
        _cordon(api, cluster, cordoned=False)
        yielded = await next_event(events, EventKind.YIELDED, "job-a")
        assert "every pod of job job-a is gone" in yielded.detail
        win_b = checker.Window(job="job-b", group="trainer", requested=time.time())
        assert (await b.acquire("trainer", timeout=WAIT_S)).success
        win_b.acquired = time.time()
        assert (await b.status("trainer")).locking_job == "job-b"
        win_b.yielded = time.time()
        await b.yield_("trainer")
    journal, group_nodes = cluster.journal(), {"trainer": ["gpu-a"]}
    assert checker.check(journal=journal, windows=[win_a, win_b], group_nodes=group_nodes) == []


async def test_a_yield_sent_while_its_group_is_stopped_is_applied_when_it_is_back(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    api.apply(objects.node("gpu-a", "trainer"))
    address = cluster.start({"gpu-a": ["--backend", "noop"]})
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
    ):
        await a.acquire("trainer", timeout=WAIT_S)
        _cordon(api, cluster, cordoned=True)
        assert (await a.yield_("trainer")).success  # kept: nothing moves while stopped
        _cordon(api, cluster, cordoned=False)
        assert (await b.acquire("trainer", timeout=WAIT_S)).success
        assert (await b.status("trainer")).locking_job == "job-b"
