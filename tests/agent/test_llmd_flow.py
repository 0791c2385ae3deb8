"""llm-d's documented agent flow against a real agent, through real sockets.

The workload is a raw stub that speaks only what WIRE.md lists, as llm-d's Python
workload library does: it registers with job_id, group and capabilities, and
answers each SnapshotCommand/RestoreCommand with a CommandResult. The callers are
llm-d's ``SnapshotAgentClient`` (our drop-in ``tslice.SnapshotAgentClient``) and
raw requests shaped like the ones llm-d's Go orchestrator sends
(``/work/shared/reference/llm-d-orchestrator.md``: Snapshot/Restore with job_id and
group, then GetOperation polled until it finishes, then Status).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import pytest

import tslice
from tests.agent.conftest import Agent, AgentRunner
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

JOB = "llmd-job"
GROUP = "pool"
COMPLETE = pb.OperationStatus.Name(pb.OPERATION_STATUS_COMPLETE)
_T = TypeVar("_T")

# DESIGN invariant 5: a workload that registers over the channel with its model loaded
# is resident (RUNNING) from registration, so llm-d's first Snapshot finds it RUNNING.
RESIDENT_FROM_REGISTRATION = (
    "a workload registered on the channel must be RUNNING (resident) from registration"
)


@dataclasses.dataclass
class LlmdWorkload:
    """llm-d's workload library, by hand: WIRE.md messages only, every command answered ok.

    ``reported_bytes`` adds tslice's byte counts to each result (fields >= 100 that
    llm-d's library leaves unset); ``None`` sends exactly llm-d's CommandResult.
    """

    channel: grpc.aio.Channel
    call: Any
    reported_bytes: int | None
    commands: list[pb.AgentCommand] = dataclasses.field(default_factory=list)
    received: asyncio.Queue[pb.AgentCommand] = dataclasses.field(default_factory=asyncio.Queue)
    _reader: asyncio.Task[None] | None = None

    @classmethod
    async def register(
        cls, address: str, *, default_mode: int, reported_bytes: int | None = None
    ) -> LlmdWorkload:
        channel = grpc.aio.insecure_channel(address)
        call = pb_grpc.SnapshotAgentServiceStub(channel).WorkloadChannel()
        await call.write(
            pb.WorkloadMessage(
                register=pb.RegisterWorkload(
                    job_id=JOB,
                    group=GROUP,
                    capabilities=pb.WorkloadCapabilities(
                        supported_modes=[pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD],
                        default_mode=default_mode,  # type: ignore[arg-type]
                    ),
                )
            )
        )
        workload = cls(channel=channel, call=call, reported_bytes=reported_bytes)
        workload._reader = asyncio.create_task(workload._serve())
        return workload

    async def _serve(self) -> None:
        while (command := await self.call.read()) is not grpc.aio.EOF:
            self.commands.append(command)
            result = pb.CommandResult(command_id=command.command_id, ok=True)
            if self.reported_bytes is not None:
                result.device_bytes = self.reported_bytes
                result.host_bytes = self.reported_bytes
            await self.call.write(pb.WorkloadMessage(result=result))
            await self.received.put(command)

    async def next_command(self) -> pb.AgentCommand:
        return await asyncio.wait_for(self.received.get(), 10)

    def kinds(self) -> list[str | None]:
        return [command.WhichOneof("command") for command in self.commands]

    async def close(self) -> None:
        self.call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        await self.channel.close()


async def _eventually(probe: Callable[[], Awaitable[_T | None]], what: str) -> _T:
    """Poll ``probe`` (the wire offers llm-d's workload no acknowledgement to wait on)."""
    for _ in range(500):
        value = await probe()
        if value is not None:
            return value
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def _job(agent: Agent) -> pb.JobStatus | None:
    return (await agent.jobs()).get(JOB)


async def _registered(agent: Agent) -> pb.JobStatus:
    return await _eventually(lambda: _job(agent), f"{JOB} to show in Status")


@pytest.fixture
async def channel_agent(agents: AgentRunner) -> Agent:
    return await agents.start(
        backends=["app-channel"],
        backend_settings={"app-channel": {"register_wait_s": 0, "command_timeout_s": 10}},
    )


@pytest.fixture
async def workloads() -> AsyncIterator[list[LlmdWorkload]]:
    running: list[LlmdWorkload] = []
    yield running
    for workload in running:
        await workload.close()


def _present_bytes(operation: Any, expected: int) -> None:
    assert operation.storage_bytes is not None and operation.snapshot_device_bytes is not None
    assert (operation.storage_bytes, operation.snapshot_device_bytes) == (expected, expected)


@pytest.mark.parametrize("reported_bytes", [None, 4096], ids=["llmd-result", "with-bytes"])
async def test_snapshot_agent_client_flow(
    channel_agent: Agent, workloads: list[LlmdWorkload], reported_bytes: int | None
) -> None:
    workload = await LlmdWorkload.register(
        channel_agent.address, default_mode=pb.SUSPEND_MODE_DISCARD, reported_bytes=reported_bytes
    )
    workloads.append(workload)
    job = await _registered(channel_agent)
    assert job.state == pb.JOB_STATE_RUNNING, RESIDENT_FROM_REGISTRATION
    expected_bytes = reported_bytes or 0
    no_mode = pb.BackendConfig(app_channel=pb.AppChannelConfig())

    with tslice.SnapshotAgentClient(channel_agent.address) as client:
        started = await asyncio.to_thread(client.snapshot, JOB, GROUP, backend_config=no_mode)
        command = await workload.next_command()
        # No mode in the request: the workload's declared default goes on the wire.
        assert command.WhichOneof("command") == "snapshot"
        assert command.snapshot.mode == pb.SUSPEND_MODE_DISCARD
        assert list(command.snapshot.tags) == []
        done = await asyncio.to_thread(client.wait_for_operation, started.operation_id, 0.05, 10.0)
        assert done.status == COMPLETE, done.error
        _present_bytes(done, expected_bytes)
        assert (await channel_agent.state(JOB)) == pb.JOB_STATE_SAVED
        saved = await asyncio.to_thread(client.status)
        assert {j.job_id: j.state for j in saved.job_statuses}[JOB] == "JOB_STATE_SAVED"

        started = await asyncio.to_thread(client.restore, JOB, GROUP, backend_config=no_mode)
        command = await workload.next_command()
        assert command.WhichOneof("command") == "restore"
        done = await asyncio.to_thread(client.wait_for_operation, started.operation_id, 0.05, 10.0)
        assert done.status == COMPLETE, done.error
        _present_bytes(done, expected_bytes)
        assert (await channel_agent.state(JOB)) == pb.JOB_STATE_RUNNING

    # tslice's own Grant flow keeps working for the channel job.
    grant = await channel_agent.stub.Grant(
        pb.GrantRequest(job_id=JOB, group=GROUP, grant_epoch=1, wait_ms=10_000)
    )
    assert grant.granted and grant.state == pb.JOB_STATE_RUNNING
    assert list(grant.operations) == []  # already resident: nothing to move
    # Another job is granted the group: the channel job is evicted through its workload.
    grant = await channel_agent.stub.Grant(
        pb.GrantRequest(job_id="other", group=GROUP, grant_epoch=2, evict=[JOB], wait_ms=10_000)
    )
    assert grant.granted, grant
    assert (await workload.next_command()).snapshot.mode == pb.SUSPEND_MODE_DISCARD
    assert (await channel_agent.state(JOB)) == pb.JOB_STATE_SAVED
    # And granted back: restored through its workload.
    grant = await channel_agent.stub.Grant(
        pb.GrantRequest(
            job_id=JOB, group=GROUP, grant_epoch=3, evict=["other"], restore=True, wait_ms=10_000
        )
    )
    assert grant.granted and grant.restored and grant.state == pb.JOB_STATE_RUNNING, grant
    assert (await workload.next_command()).WhichOneof("command") == "restore"

    # Nothing but snapshot and restore ever reached the llm-d workload (no ping, no pong).
    assert workload.kinds() == ["snapshot", "restore", "snapshot", "restore"]


async def _orchestrator_poll(agent: Agent, operation_id: str) -> pb.GetOperationResponse:
    """llm-d's orchestrator polls GetOperation until the operation finishes."""

    async def finished() -> pb.GetOperationResponse | None:
        operation = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=operation_id))
        return None if operation.status == pb.OPERATION_STATUS_PENDING else operation

    return await _eventually(finished, f"operation {operation_id}")


@pytest.mark.parametrize(
    "backend_config",
    [pb.BackendConfig(app_channel=pb.AppChannelConfig()), None],
    ids=["app-channel-config", "no-config"],
)
async def test_orchestrator_flow(
    channel_agent: Agent, workloads: list[LlmdWorkload], backend_config: pb.BackendConfig | None
) -> None:
    workload = await LlmdWorkload.register(
        channel_agent.address, default_mode=pb.SUSPEND_MODE_OFFLOAD
    )
    workloads.append(workload)
    await _registered(channel_agent)

    # Reconcile, as llm-d's controller does: Status, snapshot the RUNNING job, poll,
    # Status again; later restore the SAVED job, poll, Status.
    assert (await channel_agent.state(JOB)) == pb.JOB_STATE_RUNNING, RESIDENT_FROM_REGISTRATION
    started = await channel_agent.stub.Snapshot(
        pb.SnapshotRequest(job_id=JOB, group=GROUP, backend_config=backend_config)
    )
    done = await _orchestrator_poll(channel_agent, started.operation_id)
    assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error
    assert done.HasField("storage_bytes") and done.HasField("snapshot_device_bytes")
    assert (await workload.next_command()).snapshot.mode == pb.SUSPEND_MODE_OFFLOAD
    assert (await channel_agent.state(JOB)) == pb.JOB_STATE_SAVED

    started = await channel_agent.stub.Restore(
        pb.RestoreRequest(job_id=JOB, group=GROUP, backend_config=backend_config)
    )
    done = await _orchestrator_poll(channel_agent, started.operation_id)
    assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error
    assert done.HasField("storage_bytes") and done.HasField("snapshot_device_bytes")
    assert (await workload.next_command()).WhichOneof("command") == "restore"
    assert (await channel_agent.state(JOB)) == pb.JOB_STATE_RUNNING
    assert workload.kinds() == ["snapshot", "restore"]
