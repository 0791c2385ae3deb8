"""End to end: the emulated API server, a real ``tslice orchestrator --kubernetes`` and real
agents. A group appears when its node is labelled and a job acquires it; when every pod
of the holder is deleted, the holder loses the lock (with an event) and the next waiter
is granted; a node cordoned in the middle of a switch leaves the group, which carries on
over the node left, exclusive throughout (the device journals are checked). Waits are on
the servers' log lines, the orchestrator's event stream and the Acquire replies."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("lightkube")

from tests.harness.servers import frozen
from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.stack import WAIT_S, Cluster, events_of, exclusive_sim, next_event
from tslice.client import NO_RETRY, AsyncClient, EventKind, GroupState
from tslice.common import errors
from tslice.sim import checker


async def test_a_labelled_group_is_acquired_and_a_gone_holder_loses_it(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    api.apply(objects.node("gpu-a"))  # not in a group yet
    for job in ("job-a", "job-b", "job-c"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    address = cluster.start({"gpu-a": ["--backend", "noop"]})
    api.apply(objects.node("gpu-a", "trainer"))
    cluster.logged(r"group trainer appeared with 1 node\(s\): gpu-a")
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
        AsyncClient(address, job_id="job-c", lease_s=None) as c,
        events_of(b, "trainer") as events,
    ):
        assert "trainer" in await a.list_groups()
        # A labelled node without an agent pod: its group waits for it instead of guessing.
        api.apply(objects.node("gpu-z", "sampler"))
        cluster.logged(r"group sampler appeared with 1 node\(s\): gpu-z")
        # The answer is what is tested: not retried (a retry sent with the last 0.2 s
        # left met DEADLINE_EXCEEDED when the orchestrator was slow, and the reason was lost).
        once = AsyncClient(address, job_id="job-a", lease_s=None, retry=NO_RETRY)
        async with once:
            with pytest.raises(errors.Unavailable, match=r"gpu-z\.no-agent-pod\.invalid"):
                await once.acquire("sampler", timeout=1)
        assert (await a.status("sampler")).group_state is GroupState.UNKNOWN
        await a.acquire("trainer", timeout=WAIT_S)
        waiting = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
        await next_event(events, EventKind.QUEUED, "job-b")
        queued_c = asyncio.create_task(c.acquire("trainer", timeout=WAIT_S))
        await next_event(events, EventKind.QUEUED, "job-c")
        # A waiter whose pods went leaves the queue; its Acquire says why.
        api.apply(objects.job_pod("job-c-trainer-0", "job-c", "trainer", phase="Failed"))
        with pytest.raises(
            errors.Aborted, match="by Kubernetes mode: every pod of job job-c is gone"
        ):
            await asyncio.wait_for(queued_c, WAIT_S)
        # A holder whose pods went loses the lock; the next waiter is granted.
        api.store.delete("pods", "rl", "job-a-trainer-0")
        yielded = await next_event(events, EventKind.YIELDED, "job-a")
        assert "by Kubernetes mode: every pod of job job-a is gone" in yielded.detail
        assert (await asyncio.wait_for(waiting, WAIT_S)).success
        # Unlabelled, the node leaves: the group is gone, and an Acquire says how to fix it.
        api.apply(objects.node("gpu-a"))
        cluster.logged(r"group trainer is gone \(.*\); it stops")
        with pytest.raises(errors.NotFound, match=r"label its nodes group\.timeslice\.io/trainer"):
            await c.acquire("trainer", timeout=WAIT_S)


async def test_a_node_cordoned_mid_switch_leaves_the_group_which_stays_exclusive(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    sim = exclusive_sim()
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    # No grace: the switch in flight is cut when the group restarts, and recovery on the
    # node left finishes the hand-over (the harder of the two ways it can go).
    address = cluster.start({"gpu-a": sim.flags(), "gpu-b": sim.flags()}, shutdown_grace_s=0)
    for node in ("gpu-a", "gpu-b"):
        api.apply(objects.node(node, "trainer"))
    # The two labels may be seen apart (a group of one node, then of two) or together.
    both = r"gpu-a@\S+, gpu-b@\S+"
    appeared = r" appeared with 2 node\(s\): gpu-a, gpu-b"
    cluster.logged(rf"group trainer({appeared}|: nodes changed \(gpu-a@\S+ -> {both}\))")
    windows: list[checker.Window] = []
    async with (
        AsyncClient(address, job_id="job-a", lease_s=None) as a,
        AsyncClient(address, job_id="job-b", lease_s=None) as b,
        events_of(b, "trainer") as events,
    ):
        first = checker.Window(job="job-a", group="trainer", requested=time.time())
        windows.append(first)
        await a.acquire("trainer", timeout=WAIT_S)
        first.acquired = time.time()
        second = checker.Window(job="job-b", group="trainer", requested=time.time())
        windows.append(second)
        waiting = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
        await next_event(events, EventKind.QUEUED, "job-b")
        # The agents are frozen from before the switch until the group has restarted: the
        # cordon lands in the middle of the switch however slow the machine is.
        with frozen(cluster.agents.values()):
            first.yielded = time.time()
            await a.yield_("trainer")
            await next_event(events, EventKind.SWITCH_STARTED, "job-b")
            api.apply(objects.node("gpu-b", "trainer", unschedulable=True))
            cluster.logged(rf"group trainer: nodes changed \({both} -> gpu-a@[^,]+\)")
        # The client re-issues its Acquire across the group's restart (UNAVAILABLE).
        assert (await asyncio.wait_for(waiting, WAIT_S)).success
        second.acquired = time.time()
        # Asked again, the restarted group answers once it has verified the grant itself.
        await b.acquire("trainer", timeout=WAIT_S)
        status = await b.status("trainer")
        assert (status.locking_job, status.nodes) == ("job-b", ("gpu-a",))
        second.yielded = time.time()
    assert (
        checker.check(
            journal=cluster.journal(), windows=windows, group_nodes={"trainer": ["gpu-a"]}
        )
        == []
    )


async def test_a_job_that_finished_while_no_orchestrator_watched_is_evicted_at_start(
    api: ApiServerEmulator, cluster: Cluster
) -> None:
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    api.apply(objects.node("gpu-a", "trainer"))
    address = cluster.start({"gpu-a": ["--backend", "noop"]})
    async with AsyncClient(address, job_id="job-a", lease_s=None) as a:
        await a.acquire("trainer", timeout=WAIT_S)
    # The orchestrator dies; meanwhile the holder's pod fails (no watcher sees it go).
    api.apply(objects.job_pod("job-a-trainer-0", "job-a", "trainer", phase="Failed"))
    address = cluster.restart_orchestrator()
    cluster.logged(r"job job-a evicted from group trainer \(it was holder\)")
    async with AsyncClient(address, job_id="job-b", lease_s=None) as b:
        assert (await b.acquire("trainer", timeout=WAIT_S)).success
        assert (await b.status("trainer")).locking_job == "job-b"
