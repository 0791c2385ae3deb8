"""HA mode end to end: real orchestrator replicas (``--kubernetes --ha``) and real agents
against the API-server emulator. A follower redirects to the leader; a leader killed with
SIGKILL in the middle of a switch is replaced once its Lease expires, and the new leader
finishes the switch and grants the queued jobs from the state in the ConfigMaps (the
device journals are checked: exclusive throughout); a leader whose state write meets a
newer term's write steps down instead of overwriting it; a leader stopped with SIGTERM
hands the Lease over at once. Waits are on the servers' log lines, the event stream and
the replies."""

from __future__ import annotations

import asyncio
import datetime
import json
import time

import grpc
import pytest

pytest.importorskip("lightkube")

from tests.harness.servers import frozen
from tests.kube import objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import NAMESPACE, HaStack
from tests.kube.stack import WAIT_S, events_of, exclusive_sim, next_event
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import AsyncClient, EventKind, StoredEvents
from tslice.sim import checker

STATE = "timeslice.io/orchestrator-state=group"


def _group_state(api: ApiServerEmulator) -> dict[str, object]:
    _, found = api.store.list("configmaps", NAMESPACE, _selector(STATE))
    (cm,) = found
    return cm


def _selector(selector: str):  # type: ignore[no-untyped-def]
    from tests.kube import apistore

    return apistore.label_selector(selector)


def _violations(stack: HaStack, windows: dict[str, checker.Window]) -> list[checker.Violation]:
    """What the device-journal checker finds wrong with the trainer group's turns."""
    return checker.check(
        journal=stack.journal(),
        windows=list(windows.values()),
        group_nodes={"trainer": ["gpu-a", "gpu-b"]},
    )


async def test_a_follower_redirects_and_takes_over_a_leader_killed_mid_switch(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    sim = exclusive_sim()
    for job in ("job-a", "job-b", "job-c"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    for node in ("gpu-a", "gpu-b"):
        api.apply(objects.node(node, "trainer"))
    old = stack.start_ha({"gpu-a": sim.flags(), "gpu-b": sim.flags()}, ["orch-a", "orch-b"])
    new = stack.follower(old)
    first, second = stack.addresses[old], stack.addresses[new]
    stack.replicas[new].wait_for(rf"leader election: {old} leads \(term 1\) at {first}")
    # A follower answers UNAVAILABLE, naming the leader, its address in the trailers.
    async with grpc.aio.insecure_channel(second) as channel:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Acquire(opb.AcquireRequest(group_id="trainer", job_id="job-a"))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert f"the leader is {old} at {first}" in str(refused.value.details())
    assert dict(refused.value.trailing_metadata() or ())["x-tslice-leader"] == first

    windows = {
        j: checker.Window(job=f"job-{j}", group="trainer", requested=0.0) for j in ("a", "b", "c")
    }
    # The clients know both replicas: they follow the redirect and the failover themselves.
    both = [first, second]
    async with (
        AsyncClient(both, job_id="job-a", lease_s=None) as a,
        AsyncClient(both, job_id="job-b", lease_s=None) as b,
        AsyncClient(both, job_id="job-c", lease_s=None) as c,
    ):
        async with events_of(b, "trainer") as events:
            windows["a"].requested = time.time()
            await a.acquire("trainer", timeout=WAIT_S)
            windows["a"].acquired = time.time()
            windows["b"].requested = windows["c"].requested = time.time()
            waiting_b = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
            await next_event(events, EventKind.QUEUED, "job-b")
            waiting_c = asyncio.create_task(c.acquire("trainer", timeout=WAIT_S))
            await next_event(events, EventKind.QUEUED, "job-c")
            # The agents are frozen from before the switch until the leader is dead: it
            # dies in the middle of the switch however slow the machine is.
            with frozen(stack.agents.values()):
                windows["a"].yielded = time.time()
                await a.yield_("trainer")
                await next_event(events, EventKind.SWITCH_STARTED, "job-b")
                stack.kill(old)  # in the middle of the switch
        # Lease expired, the follower leads in term 2 from the ConfigMaps' state: it
        # finishes the switch (rolled forward), and job-b's Acquire, re-issued there by the
        # client, gets its grant; job-c's waits on, in its place.
        assert (await asyncio.wait_for(waiting_b, WAIT_S)).success
        windows["b"].acquired = time.time()
        assert stack.replicas[new].wait_for(r"leading as \S+ \(leader term (\d+),").group(1) == "2"
        assert not waiting_c.done()
        windows["b"].yielded = time.time()
        await b.yield_("trainer")
        assert (await asyncio.wait_for(waiting_c, WAIT_S)).success
        windows["c"].acquired = time.time()
        status = await c.status("trainer")
        assert status.locking_job == "job-c"
        windows["c"].yielded = time.time()
    state = _group_state(api)
    assert state["metadata"]["annotations"]["timeslice.io/leader-term"] == "2"  # type: ignore[index]
    assert _violations(stack, windows) == []


async def test_a_leader_whose_write_meets_a_newer_terms_steps_down(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    for job in ("job-a", "job-b"):
        api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
    api.apply(objects.node("gpu-a", "trainer"))
    stack.start_ha({"gpu-a": ["--backend", "noop"]}, ["orch-a"])
    leader = stack.replicas["orch-a"]
    address = stack.addresses["orch-a"]
    async with AsyncClient(address, job_id="job-a", lease_s=None) as a:
        await a.acquire("trainer", timeout=WAIT_S)
        # A newer leader (term 7) writes the group's state: it drained the group.
        cm = _group_state(api)
        record = json.loads(cm["data"]["record"])  # type: ignore[index]
        assert record["holder"] == "job-a"
        cm["metadata"]["annotations"]["timeslice.io/leader-term"] = "7"  # type: ignore[index]
        cm["data"]["record"] = json.dumps({**record, "draining": True})  # type: ignore[index]
        api.store.update("configmaps", NAMESPACE, cm["metadata"]["name"], cm)  # type: ignore[index]
        # The next write of term 1 (the yield's) conflicts: it steps down, overwriting nothing.
        yielding = asyncio.create_task(a.yield_("trainer"))
        # (in a thread: the event loop must go on sending the yield meanwhile)
        await asyncio.to_thread(
            leader.wait_for,
            r"stepping down as leader \(term 1\): leader term 7 wrote state ConfigMap "
            r"timeslice-system/tslice-group-trainer-\w+ after this replica's term 1",
        )
        # Campaigning again, it leads above term 7 at once (no wasted election in between),
        # from that state.
        await asyncio.to_thread(stack.leads, "orch-a", 8)
        assert "leader term 2" not in leader.logs()
        await asyncio.wait_for(yielding, WAIT_S)  # retried against the leader of term 8
        assert (await a.status("trainer")).draining


async def test_a_leader_stopped_gracefully_hands_the_lease_over_at_once(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    api.apply(objects.job_pod("job-a-trainer-0", "job-a", "trainer"))
    api.apply(objects.node("gpu-a", "trainer"))
    # A Lease of 30 s: a follower that took it on expiry would not be here in time.
    agents = {"gpu-a": ["--backend", "noop"]}
    first = stack.start_ha(agents, ["orch-a", "orch-b"], lease_duration_s=30)
    second = stack.follower(first)
    old, new = stack.replicas[first], stack.replicas[second]
    new.wait_for(rf"leader election: {first} leads \(term 1\)")
    async with AsyncClient(stack.addresses[first], job_id="job-a", lease_s=None) as a:
        await a.acquire("trainer", timeout=WAIT_S)
    old.terminate()
    old.wait_for(r"released Lease timeslice-system/tslice-orchestrator")
    new.wait_for(r"took Lease timeslice-system/tslice-orchestrator \(free\); leader term 2")
    stack.leads(second, 2)
    async with AsyncClient(stack.addresses[second], job_id="job-a", lease_s=None) as a:
        # The holder is still the holder under the new leader.
        assert (await a.status("trainer")).locking_job == "job-a"
        await a.yield_("trainer")
        # The event history is each replica's own (docs/observability.md): the new
        # leader's holds what it published (the yield), not the old leader's grant.
        since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=10)
        stored = StoredEvents(since=since, follow=False)
        kinds = [e.kind async for e in a.watch_events("trainer", stored=stored)]
    assert EventKind.YIELDED in kinds and EventKind.GRANTED not in kinds, kinds


async def test_a_partitioned_old_leader_is_fenced(api: ApiServerEmulator, stack: HaStack) -> None:
    old, new = stack.start_trainers(["job-a", "job-b"], ["gpu-a", "gpu-b"])
    windows = {j: checker.Window(job=f"job-{j}", group="trainer", requested=0.0) for j in "ab"}
    async with (
        AsyncClient(stack.addresses[old], job_id="job-a", lease_s=None) as a,
        AsyncClient(stack.addresses[old], job_id="job-b", lease_s=None) as b,
        events_of(b, "trainer") as events,
    ):
        windows["a"].requested = time.time()
        await a.acquire("trainer", timeout=WAIT_S)
        windows["a"].acquired = windows["b"].requested = time.time()
        waiting = asyncio.create_task(b.acquire("trainer", timeout=WAIT_S))
        await next_event(events, EventKind.QUEUED, "job-b")
        windows["a"].yielded = time.time()
        await a.yield_("trainer")
        await next_event(events, EventKind.SWITCH_STARTED, "job-b")
        # Partitioned in the middle of its switch: it cannot renew, nor tell anyone.
        stack.replicas[old].freeze()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.to_thread(stack.leads, new, 2)
    async with AsyncClient(stack.addresses[new], job_id="job-b", lease_s=None) as b:
        assert (await b.acquire("trainer", timeout=WAIT_S)).success
        windows["b"].acquired = time.time()
        # Back, the old leader of term 1 goes on with its switch: the agents, which have
        # seen term 2, refuse it, or its own renew deadline stops it first. Either way it
        # steps down without moving device state.
        stack.replicas[old].thaw()
        await asyncio.to_thread(stack.replicas[old].wait_for, r"stepping down as leader \(term 1\)")
        status = await b.status("trainer")
        assert status.locking_job == "job-b"
        windows["b"].yielded = time.time()
        await b.yield_("trainer")
    assert _violations(stack, windows) == []


async def test_a_leader_cut_off_from_the_api_server_says_it_stepped_down(
    api: ApiServerEmulator, stack: HaStack
) -> None:
    api.apply(objects.node("gpu-a", "trainer"))
    stack.start_ha({"gpu-a": ["--backend", "noop"]}, ["orch-a"])
    api.refuse(10**9)  # an outage: nothing gets through, the Lease still names orch-a
    await asyncio.to_thread(
        stack.replicas["orch-a"].wait_for, r"stepping down as leader \(term 1\)"
    )
    async with grpc.aio.insecure_channel(stack.addresses["orch-a"]) as channel:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Acquire(opb.AcquireRequest(group_id="trainer", job_id="job-a"))
    api.refuse(0)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    details = str(refused.value.details())
    assert "just elected" not in details
    assert "it stopped leading (could not renew Lease" in details
    assert "no new leader is known yet" in details
