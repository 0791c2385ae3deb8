"""A workload that leaves takes its device state with it (real agent, real workload side).

The agent (``tslice.agent.app.serve``) runs in this event loop with the app-channel
backend; workloads are the real ``register_workload`` (threads), or a separate process
for the kill. The agent's view is read over its own RPCs (Status, Snapshot, Restore).

- a clean close (``WorkloadHandle.close()``: the stream half-closes) leaves at once: a
  Snapshot completes with nothing moved, the job is IDLE, a Restore is refused
  (FAILED_PRECONDITION) until the workload registers again;
- a channel lost without a clean end (a killed process, a network drop) gets
  ``lost_grace_s``: registered again within it, the job keeps its state and the
  waiting Snapshot is delivered to the workload; not back in time, it has left.

:class:`tests.harness.proxy.CuttableProxy` is a
loopback TCP forwarder that cuts every connection at once, as a network drop would,
while both processes live on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest

from tests.agent.conftest import Agent, AgentRunner
from tests.harness.proxy import CuttableProxy
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.workload import WorkloadHandle, register_workload

GROUP = "g"
#: Longer than any WaitOperation below: a Snapshot that waited for it would not finish.
LONG_GRACE_S = 120.0
SHORT_GRACE_S = 0.5
#: What the workload reports moving, so that a real move is told from "nothing moved".
MOVED = 4096


class Recorder:
    """Callbacks of a workload: what it was told to do."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_snapshot(self, mode: str, tags: list[str]) -> dict[str, int]:
        self.calls.append("snapshot")
        return {"device_bytes": MOVED, "host_bytes": MOVED}

    def on_restore(self, tags: list[str]) -> dict[str, int]:
        self.calls.append("restore")
        return {"device_bytes": MOVED}


Register = Callable[..., WorkloadHandle]


@pytest.fixture
def register() -> Iterator[Register]:
    handles: list[WorkloadHandle] = []

    def make(address: str, job_id: str, recorder: Recorder) -> WorkloadHandle:
        handle = register_workload(
            address,
            job_id,
            GROUP,
            on_snapshot=recorder.on_snapshot,
            on_restore=recorder.on_restore,
            backoff_initial_s=0.05,
            backoff_max_s=0.2,
        )
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        handle.close()


@pytest.fixture
async def proxies() -> AsyncIterator[list[CuttableProxy]]:
    made: list[CuttableProxy] = []
    yield made
    for proxy in made:
        await asyncio.to_thread(proxy.close)


async def start_agent(agents: AgentRunner, *, grace_s: float) -> Agent:
    return await agents.start(
        default_backend="app-channel",
        backend_settings={"app-channel": {"lost_grace_s": grace_s, "command_timeout_s": 30}},
    )


async def registered(handle: WorkloadHandle) -> None:
    assert await asyncio.to_thread(handle.wait_registered, 20), handle.error


async def running(
    agent: Agent, address: str, job_id: str, register: Register
) -> tuple[WorkloadHandle, Recorder]:
    """A workload of ``job_id`` registered through ``address`` and granted the group."""
    recorder = Recorder()
    handle = register(address, job_id, recorder)
    await registered(handle)
    assert await agent.grant(job_id, group=GROUP, epoch=1) == pb.JOB_STATE_RUNNING
    return handle, recorder


async def refused_restore(agent: Agent, job_id: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent.stub.Restore(pb.RestoreRequest(job_id=job_id, group=GROUP))
    return info.value


def assert_left(snap: pb.GetOperationResponse) -> None:
    """A snapshot of a workload that left: complete at once, nothing moved."""
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap
    assert (snap.storage_bytes, snap.snapshot_device_bytes) == (0, 0), snap


# ---- a clean close ----------------------------------------------------------------------


async def test_a_closed_workload_leaves_at_once_with_its_state(
    agents: AgentRunner, register: Register
) -> None:
    agent = await start_agent(agents, grace_s=LONG_GRACE_S)
    recorder = Recorder()
    handle = register(agent.address, "job-a", recorder)
    await registered(handle)
    assert await agent.grant("job-a", group=GROUP, epoch=1) == pb.JOB_STATE_RUNNING

    await asyncio.to_thread(handle.close)

    # Within one WaitOperation (far shorter than the grace): nothing is waited for.
    assert_left(await agent.snapshot("job-a", group=GROUP))
    assert recorder.calls == []  # nothing was sent to a workload that left
    job = (await agent.jobs())["job-a"]
    assert (job.state, job.backend) == (pb.JOB_STATE_IDLE, "app-channel")

    err = await refused_restore(agent, "job-a")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "left node node-a" in (err.details() or "")
    assert "must register again" in (err.details() or "")

    # The next job takes the group: nothing of job-a is in the way.
    assert await agent.grant("job-b", group=GROUP, epoch=2) == pb.JOB_STATE_RUNNING
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_IDLE


async def test_a_snapshot_of_a_job_whose_workload_left_is_complete_again(
    agents: AgentRunner, register: Register
) -> None:
    agent = await start_agent(agents, grace_s=LONG_GRACE_S)
    handle = register(agent.address, "job-a", Recorder())
    await registered(handle)
    await agent.grant("job-a", group=GROUP, epoch=1)
    await asyncio.to_thread(handle.close)
    assert_left(await agent.snapshot("job-a", group=GROUP))
    # IDLE because its workload left (not "IDLE, never granted"): a snapshot is complete,
    # as often as it is asked for (an orchestrator retrying a switch must get through).
    assert_left(await agent.snapshot("job-a", group=GROUP))
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_IDLE


async def test_a_workload_that_registers_again_after_leaving_is_resident_again(
    agents: AgentRunner, register: Register
) -> None:
    agent = await start_agent(agents, grace_s=LONG_GRACE_S)
    first = register(agent.address, "job-a", Recorder())
    await registered(first)
    await agent.grant("job-a", group=GROUP, epoch=1)
    await asyncio.to_thread(first.close)
    assert_left(await agent.snapshot("job-a", group=GROUP))

    again = Recorder()
    # A new process of the job. The agent records a registration before it acknowledges
    # it, so once acknowledged the job is RUNNING again: a restore of it is a no-op.
    await registered(register(agent.address, "job-a", again))
    restored = await agent.restore("job-a", group=GROUP)
    assert restored.status == pb.OPERATION_STATUS_COMPLETE, restored
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_RUNNING
    snap = await agent.snapshot("job-a", group=GROUP)
    assert snap.status == pb.OPERATION_STATUS_COMPLETE and snap.snapshot_device_bytes == MOVED
    assert again.calls == ["snapshot"]
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_SAVED


# ---- a lost channel: the grace ----------------------------------------------------------


async def test_a_lost_channel_registered_again_within_the_grace_keeps_the_state(
    agents: AgentRunner, register: Register, proxies: list[CuttableProxy]
) -> None:
    agent = await start_agent(agents, grace_s=LONG_GRACE_S)
    proxy = CuttableProxy(agent.address)
    proxies.append(proxy)
    _handle, recorder = await running(agent, proxy.address, "job-a", register)

    proxy.refuse()
    proxy.cut()  # both processes live on; the workload cannot get back yet
    started = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group=GROUP))
    waiting = await agent.stub.GetOperation(
        pb.GetOperationRequest(operation_id=started.operation_id)
    )
    assert waiting.status == pb.OPERATION_STATUS_PENDING  # waits for the workload
    proxy.reopen()

    snap = await agent.wait(started.operation_id, timeout_ms=30_000)
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap
    assert snap.snapshot_device_bytes == MOVED  # the workload really moved its state
    assert recorder.calls == ["snapshot"]
    assert proxy.connections >= 2  # it reconnected
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_SAVED

    back = await agent.restore("job-a", group=GROUP)
    assert back.status == pb.OPERATION_STATUS_COMPLETE and back.snapshot_device_bytes == MOVED
    assert recorder.calls == ["snapshot", "restore"]


async def test_a_lost_channel_not_back_within_the_grace_has_left(
    agents: AgentRunner, register: Register, proxies: list[CuttableProxy]
) -> None:
    agent = await start_agent(agents, grace_s=SHORT_GRACE_S)
    proxy = CuttableProxy(agent.address)
    proxies.append(proxy)
    handle, recorder = await running(agent, proxy.address, "job-a", register)

    proxy.refuse()
    proxy.cut()
    # The snapshot waits at most the grace, then finds nothing resident.
    assert_left(await agent.snapshot("job-a", group=GROUP))
    assert recorder.calls == []
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_IDLE
    err = await refused_restore(agent, "job-a")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "did not register again within 0.5 s" in (err.details() or "")

    # Coming back later (its own reconnect), it is taken at its word: it still holds
    # its model, so it is resident again.
    proxy.reopen()
    assert await asyncio.to_thread(proxy.wait_connections, 2, 20)
    await registered(handle)
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_RUNNING
    assert recorder.calls == []


async def test_a_killed_workload_process_has_left_after_the_grace(agents: AgentRunner) -> None:
    agent = await start_agent(agents, grace_s=SHORT_GRACE_S)
    script = textwrap.dedent(
        f"""
        import time
        from tslice.workload import register_workload
        handle = register_workload({agent.address!r}, "job-a", {GROUP!r},
                                   on_snapshot=lambda mode, tags: None,
                                   on_restore=lambda tags: None)
        assert handle.wait_registered(20), handle.error
        print("registered", flush=True)
        time.sleep(600)
        """
    )
    workload = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, env=dict(os.environ)
    )
    try:
        assert workload.stdout is not None
        assert (await workload.stdout.readline()).strip() == b"registered"
        assert await agent.grant("job-a", group=GROUP, epoch=1) == pb.JOB_STATE_RUNNING
        workload.send_signal(signal.SIGKILL)
        await workload.wait()

        assert_left(await agent.snapshot("job-a", group=GROUP))
        assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_IDLE
        assert await agent.grant("job-b", group=GROUP, epoch=2) == pb.JOB_STATE_RUNNING
    finally:
        if workload.returncode is None:
            workload.kill()
            await workload.wait()


async def test_a_restore_waiting_for_a_lost_workload_fails_once_it_has_left(
    agents: AgentRunner, register: Register, proxies: list[CuttableProxy]
) -> None:
    agent = await start_agent(agents, grace_s=SHORT_GRACE_S)
    proxy = CuttableProxy(agent.address)
    proxies.append(proxy)
    _handle, recorder = await running(agent, proxy.address, "job-a", register)
    snap = await agent.snapshot("job-a", group=GROUP)
    assert snap.snapshot_device_bytes == MOVED  # its state is off the device, in its process

    proxy.refuse()
    proxy.cut()
    back = await agent.restore("job-a", group=GROUP)  # waits at most the grace
    assert back.status == pb.OPERATION_STATUS_FAILED, back
    assert "left this node" in back.error and "must register again" in back.error
    assert recorder.calls == ["snapshot"]
    # Its offloaded state lived in the process that left: nothing is saved any more.
    assert (await agent.jobs())["job-a"].state == pb.JOB_STATE_IDLE
    err = await refused_restore(agent, "job-a")
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
