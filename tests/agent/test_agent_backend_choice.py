"""Per-job backend choice: a workload registered on the channel gets app-channel ops.

The orchestrator sends Snapshot/Restore with no backend_config; the agent must route
them to the workload channel for jobs that registered there, and to its default
backend for the others.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.agent.conftest import Agent, AgentRunner
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


async def _channel_agent(agents: AgentRunner) -> Agent:
    return await agents.start(
        backends=["app-channel"],
        backend_settings={"app-channel": {"register_wait_s": 0, "command_timeout_s": 10}},
    )


async def _register(agent: Agent, job_id: str) -> Any:
    call = agent.stub.WorkloadChannel()
    await call.write(
        pb.WorkloadMessage(
            register=pb.RegisterWorkload(
                job_id=job_id,
                group="g",
                capabilities=pb.WorkloadCapabilities(
                    supported_modes=[pb.SUSPEND_MODE_OFFLOAD],
                    default_mode=pb.SUSPEND_MODE_OFFLOAD,
                ),
                # Declared so that the hub's first ping acknowledges the registration.
                features=pb.WorkloadFeatures(keepalive=True),
            )
        )
    )
    return call


async def _next_command(call: Any) -> pb.AgentCommand:
    while True:
        command: pb.AgentCommand = await call.read()
        if command.WhichOneof("command") in ("snapshot", "restore"):
            return command


async def _answer(call: Any, command: pb.AgentCommand, *, moved: int) -> None:
    host = moved if command.WhichOneof("command") == "snapshot" else 0
    await call.write(
        pb.WorkloadMessage(
            result=pb.CommandResult(
                command_id=command.command_id, ok=True, device_bytes=moved, host_bytes=host
            )
        )
    )


async def test_registered_workload_gets_the_orchestrator_commands(agents: AgentRunner) -> None:
    agent = await _channel_agent(agents)
    call = await _register(agent, "worker")
    await call.read()  # the hub acknowledges the registration with a ping

    job = (await agent.jobs())["worker"]
    # Registered with its model loaded: resident until told to offload (DESIGN invariant 5).
    assert (job.state, job.backend, job.group) == (pb.JOB_STATE_RUNNING, "app-channel", "g")
    assert await agent.grant("worker", epoch=1) == pb.JOB_STATE_RUNNING

    snap = await agent.stub.Snapshot(pb.SnapshotRequest(job_id="worker", group="g"))
    command = await _next_command(call)
    assert command.snapshot.mode == pb.SUSPEND_MODE_OFFLOAD
    await _answer(call, command, moved=5)
    done = await agent.wait(snap.operation_id)
    assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error
    assert (done.snapshot_device_bytes, done.storage_bytes) == (5, 5)
    assert (await agent.jobs())["worker"].backend == "app-channel"

    back = await agent.stub.Restore(pb.RestoreRequest(job_id="worker", group="g"))
    command = await _next_command(call)
    assert command.WhichOneof("command") == "restore"
    await _answer(call, command, moved=5)
    assert (await agent.wait(back.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
    call.cancel()

    # A job that never registered stays on the node default.
    assert await agent.grant("plain", group="h") == pb.JOB_STATE_RUNNING
    await agent.snapshot("plain", group="h")
    assert (await agent.jobs())["plain"].backend == "sim"


async def test_recorded_choice_survives_a_disconnect_and_a_restart(agents: AgentRunner) -> None:
    agent = await _channel_agent(agents)
    call = await _register(agent, "worker")
    await call.read()
    await agent.grant("worker")
    call.cancel()
    agent = await agents.restart(agent)

    # No workload is connected: the snapshot goes to app-channel and fails there, it is
    # never silently handled by the default (sim) backend.
    snap = await agent.snapshot("worker")
    assert snap.status == pb.OPERATION_STATUS_FAILED
    assert "no workload channel registered for job 'worker'" in snap.error


async def test_explicit_config_wins_over_the_channel(agents: AgentRunner) -> None:
    agent = await _channel_agent(agents)
    sim_config = pb.BackendConfig(sim=pb.SimBackendConfig(footprint_bytes=1024))
    await agent.grant("worker", backend_config=sim_config)
    call = await _register(agent, "worker")
    await call.read()
    snap = await agent.snapshot("worker")
    assert snap.status == pb.OPERATION_STATUS_COMPLETE
    assert snap.snapshot_device_bytes == 1024
    assert (await agent.jobs())["worker"].backend == "sim"
    call.cancel()


async def test_channel_registration_is_ignored_when_app_channel_is_disabled(
    agents: AgentRunner,
) -> None:
    agent = await agents.start()
    call = await _register(agent, "worker")
    await call.read()
    assert "worker" not in await agent.jobs()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await agent.stub.Snapshot(pb.SnapshotRequest(job_id="worker"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    call.cancel()
