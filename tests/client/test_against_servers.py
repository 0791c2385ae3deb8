"""Acceptance: our REAL orchestrator and agents, driven through the drop-in llm-d
client classes (and the native clients).

Two sim agents and a local-mode orchestrator run with their own ``serve()`` on an
event loop in a background thread (servers.Servers), bound to 127.0.0.1:0, so that the
blocking drop-in clients can call them from the test thread.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import pytest

import tslice
from tests.client.servers import QUEUED, Servers, wait_for_event, watching
from tslice.client import compat


@pytest.fixture
def servers(tmp_path: pathlib.Path) -> Iterator[Servers]:
    cluster = Servers(tmp_path)
    try:
        cluster.start_agent("node-a")
        cluster.start_agent("node-b")
        cluster.start_orchestrator()
        yield cluster
    finally:
        cluster.close()


def drop_in(servers: Servers, job: str) -> compat.TimeSliceOrchestratorClient:
    return compat.TimeSliceOrchestratorClient(servers.orchestrator, job_id=job, group_id="trainer")


def agent_states(servers: Servers, job: str) -> dict[str, str]:
    states = {}
    for node, address in servers.agents.items():
        with compat.SnapshotAgentClient(address) as agent:
            jobs = {s.job_id: s.state for s in agent.status().job_statuses}
        states[node] = jobs.get(job, "absent")
    return states


def test_two_jobs_take_turns_through_the_drop_in_client(
    servers: Servers, executor: futures.ThreadPoolExecutor
) -> None:
    with drop_in(servers, "job-a") as a, drop_in(servers, "job-b") as b:
        first = a.acquire()
        assert first.success and not first.context_restored  # nothing to restore yet
        status = a.get_status()
        assert status.group.group_state is compat.GroupLockState.LOCKED
        assert status.group.locking_job == "job-a"
        assert sorted(s.agent for s in status.agent_job_states) == ["node-a", "node-b"]
        assert agent_states(servers, "job-a") == {
            "node-a": "JOB_STATE_RUNNING",
            "node-b": "JOB_STATE_RUNNING",
        }
        assert a.list_groups() == ["trainer"]

        with watching(servers.orchestrator, "trainer") as events:
            waiting = executor.submit(b.acquire)
            wait_for_event(events, QUEUED, "job-b")
        assert a.get_status().group.waiter_queue_depth == 1
        released = a.release()
        assert (released.pending_waiters, released.snapshot_deferred) == (1, False)
        granted = waiting.result(30)
        assert granted.success
        # The switch happened on both nodes before the grant.
        assert agent_states(servers, "job-a") == {
            "node-a": "JOB_STATE_SAVED",
            "node-b": "JOB_STATE_SAVED",
        }

        # job-b yields with nobody waiting: deferred, it stays resident...
        assert b.release().snapshot_deferred
        # ...until job-a comes back, which really restores job-a's state.
        again = a.acquire()
        assert again.context_restored
        assert agent_states(servers, "job-b")["node-a"] == "JOB_STATE_SAVED"
        a.release()


def test_on_accelerators_block_and_decorator_on_real_servers(servers: Servers) -> None:
    with drop_in(servers, "job-a") as a:
        with a.on_accelerators() as result:
            assert result.success
            assert a.get_status().group.locking_job == "job-a"
        assert a.get_status().group.locking_job == ""

        @a.on_accelerators()
        def step() -> str:
            return a.get_status().group.locking_job

        assert step() == "job-a"
        assert a.get_status().group.group_state is compat.GroupLockState.IDLE_YIELDED


def _until(condition: Callable[[], bool], *, within_s: float = 30.0) -> bool:
    """Whether ``condition`` became true within ``within_s`` (read again and again)."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            return False
    return True


def test_errors_from_real_servers_keep_llm_d_types(servers: Servers) -> None:
    with drop_in(servers, "job-a") as a, drop_in(servers, "job-b") as b:
        a.acquire()
        with pytest.raises(compat.OrchestratorPermissionDeniedError):
            b.release()  # job-a holds the lock
        with pytest.raises(compat.OrchestratorTimeoutError):
            b.acquire(timeout_sec=0.3)
        # The departed waiter is not left in the queue (the server learns of the timed-out
        # call's end on its own, just after the client: read until it has).
        assert _until(lambda: a.get_status().group.waiter_queue_depth == 0)
        with pytest.raises(compat.OrchestratorNotFoundError):
            a.get_status(group_id="never-used")
        with pytest.raises(compat.OrchestratorInvalidArgumentError):
            a.acquire(job_id="white space")
        assert a.release().success


def test_snapshot_agent_client_against_a_real_agent(servers: Servers) -> None:
    with compat.SnapshotAgentClient(servers.agents["node-a"]) as agent:
        assert agent.check_health().status == "SERVING"
        assert agent.check_health("sim").status == "SERVING"
        assert agent.grant("solo", "own-group", grant_epoch=1) == "JOB_STATE_RUNNING"

        saved = agent.snapshot_and_wait("solo", "own-group", poll_interval_sec=60.0)
        assert saved.status == "OPERATION_STATUS_COMPLETE"
        assert saved.error is None and saved.kind == "snapshot"
        states = {s.job_id: s for s in agent.status().job_statuses}
        assert states["solo"].state == "JOB_STATE_SAVED"

        restored = agent.restore_and_wait("solo", "own-group", poll_interval_sec=60.0)
        assert restored.status == "OPERATION_STATUS_COMPLETE"
        assert {s.job_id: s.state for s in agent.status().job_statuses}["solo"] == (
            "JOB_STATE_RUNNING"
        )
        # A 60 s poll interval would have stalled: the client long-polled WaitOperation.
        assert agent._long_poll is True

        with pytest.raises(compat.SnapshotAgentError) as caught:
            agent.get_operation("no-such-operation")
        assert caught.value.code is not None and caught.value.code.name == "NOT_FOUND"


def test_native_client_rides_out_an_orchestrator_restart(
    servers: Servers, executor: futures.ThreadPoolExecutor, caplog: pytest.LogCaptureFixture
) -> None:
    """job-b waits; the orchestrator stops and comes back on the same port and state;
    job-b's acquire is re-issued transparently and granted when job-a yields."""
    with (
        tslice.Client(servers.orchestrator, job_id="job-a") as a,
        tslice.Client(servers.orchestrator, job_id="job-b") as b,
    ):
        a.acquire("trainer")
        with watching(servers.orchestrator, "trainer") as events:
            waiting = executor.submit(b.acquire, "trainer")
            wait_for_event(events, QUEUED, "job-b")
        servers.stop_orchestrator()
        servers.start_orchestrator(port=servers.orchestrator_port)
        assert not waiting.done()
        # job-a still holds the group after the restart; its yield hands it to job-b.
        assert a.yield_("trainer").success
        assert waiting.result(30).success
        assert b.status("trainer").locking_job == "job-b"
    assert "Acquire to" in caplog.text and "retrying" in caplog.text


async def test_async_client_slices_two_groups_on_real_servers(servers: Servers) -> None:
    async with tslice.AsyncClient(servers.orchestrator, job_id="job-a") as client:
        async with client.slice("trainer", "sampler") as held:
            assert set(held) == {"sampler", "trainer"}
            assert (await client.status("sampler")).locking_job == "job-a"
            assert (await client.status("trainer")).locking_job == "job-a"
        assert (await client.status("trainer")).locking_job == ""
        assert sorted(await client.list_groups()) == ["sampler", "trainer"]


@pytest.fixture
def wedged(tmp_path: pathlib.Path) -> Iterator[Servers]:
    """One agent that refuses every grant of group "g" as stale (a grant mark the
    orchestrator cannot pass), and an orchestrator that marks it degraded at once."""
    cluster = Servers(tmp_path)
    try:
        cluster.start_agent("node-a")
        cluster.start_orchestrator(max_refusals=1)
        with compat.SnapshotAgentClient(cluster.agents["node-a"]) as agent:
            agent.grant("stray", "g", grant_epoch=2**62)
        yield cluster
    finally:
        cluster.close()


def test_degraded_nodes_are_shown_and_cleared_by_the_client(wedged: Servers) -> None:
    with tslice.Client(wedged.orchestrator, job_id="job-a", retry=tslice.client.NO_RETRY) as client:
        with pytest.raises(tslice.Unavailable, match="node node-a is degraded"):
            client.acquire("g", timeout=30)
        status = client.status("g")
        assert [d.node for d in status.degraded] == ["node-a"]
        assert "stale grant" in status.degraded[0].reason
        assert isinstance(status.degraded[0], tslice.client.DegradedNode)
        with pytest.raises(tslice.InvalidArgument, match="node 'nope' is not in group 'g'"):
            client.clear_degraded("g", node="nope")
        with pytest.raises(tslice.UnknownGroup):
            client.clear_degraded("never-used")
        assert client.clear_degraded("g", node="node-a") == ("node-a",)
        assert client.status("g").degraded == ()
        assert client.clear_degraded("g") == ()


async def test_the_async_client_clears_degraded_nodes(wedged: Servers) -> None:
    async with tslice.AsyncClient(
        wedged.orchestrator, job_id="job-a", retry=tslice.client.NO_RETRY
    ) as client:
        with pytest.raises(tslice.Unavailable, match="node node-a is degraded"):
            await client.acquire("g", timeout=30)
        assert [d.node for d in (await client.status("g")).degraded] == ["node-a"]
        assert await client.clear_degraded("g") == ("node-a",)
        assert (await client.status("g")).degraded == ()
