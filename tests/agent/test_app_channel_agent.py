"""The workload channel through the real agent (tslice.agent.app.serve), over its Unix socket.

Covers what only the whole agent shows: a channel-registered job is routed to the
app-channel backend with no config, staged restore is *sent* (not short-circuited),
a mode or tag the workload did not declare is refused at the RPC
(FAILED_PRECONDITION) without touching the engine or the job, and another process
registering the job's workload never takes its channel over.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.workload import WorkloadHandle, register_workload

from .channel_ranks import real_agent

GROUP = "sampler"


class Agent:
    def __init__(self, stub: Any, socket: Path) -> None:
        self.stub = stub
        self.socket = socket

    async def run(self, call: Any) -> pb.GetOperationResponse:
        started = await call
        return await self.stub.WaitOperation(
            pb.WaitOperationRequest(operation_id=started.operation_id, timeout_ms=20_000)
        )

    async def state(self, job_id: str) -> int:
        status = await self.stub.Status(pb.StatusRequest())
        (job,) = [j for j in status.job_statuses if j.job_id == job_id]
        return int(job.state)


@pytest.fixture
async def agent() -> AsyncIterator[Agent]:
    # Unix socket paths are limited to ~100 bytes: keep the directory short.
    tmp = Path(tempfile.mkdtemp(prefix="tsl-"))
    try:
        # Default backend noop: a job reaches app-channel only because its workload registered.
        async with real_agent(tmp) as (stub, socket):
            yield Agent(stub, socket)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class FakeVllm:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))


class FakeSglang:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("resume", tags))


async def _register(agent: Agent, job_id: str, engine: object) -> WorkloadHandle:
    handle = register_workload(f"unix:{agent.socket}", job_id, GROUP, workload=engine)
    assert await asyncio.to_thread(handle.wait_registered, 20), handle.error
    await agent.stub.Grant(pb.GrantRequest(job_id=job_id, group=GROUP, grant_epoch=1))
    return handle


def _channel_config(*, tags: tuple[str, ...] = (), mode: int = 0) -> pb.BackendConfig:
    return pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=mode, tags=tags))


async def test_agent_routes_a_registered_job_to_its_workload(agent: Agent) -> None:
    engine = FakeVllm()
    handle = await _register(agent, "job-v", engine)
    try:
        saved = await agent.run(
            agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-v", group=GROUP))
        )
        assert saved.status == pb.OPERATION_STATUS_COMPLETE, saved.error
        assert await agent.state("job-v") == pb.JOB_STATE_SAVED
        back = await agent.run(agent.stub.Restore(pb.RestoreRequest(job_id="job-v", group=GROUP)))
        assert back.status == pb.OPERATION_STATUS_COMPLETE, back.error
        assert await agent.state("job-v") == pb.JOB_STATE_RUNNING
        assert engine.calls == [("sleep", 1), ("wake_up", None)]
    finally:
        await asyncio.to_thread(handle.close)


# Another process of the node registering a workload as the job (issue 10: it took over
# the job's channel and answered its snapshot). It prints the agent's refusal, stays while
# the job is snapshotted, then prints the commands it was sent.
_INTRUDER = """
import sys
from tslice.workload import register_workload
calls = []
handle = register_workload("unix:" + sys.argv[1], sys.argv[2], sys.argv[3],
                           on_snapshot=lambda mode, tags: calls.append(mode),
                           on_restore=lambda tags: calls.append("restore"))
print(handle.wait_refused(20), flush=True)
sys.stdin.readline()
handle.close()
print(calls, flush=True)
"""


async def test_another_process_never_takes_over_a_jobs_workload_channel(agent: Agent) -> None:
    engine = FakeVllm()
    handle = await _register(agent, "job-v", engine)
    intruder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _INTRUDER,
        str(agent.socket),
        "job-v",
        GROUP,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert intruder.stdout is not None
        refusal = (await asyncio.wait_for(intruder.stdout.readline(), 30)).decode()
        assert "job 'job-v' (group 'sampler') already has a live workload" in refusal, refusal
        saved = await agent.run(
            agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-v", group=GROUP))
        )
        out, _ = await asyncio.wait_for(intruder.communicate(b"done\n"), 30)
        assert saved.status == pb.OPERATION_STATUS_COMPLETE, saved.error
        # The job's own workload was snapshotted; the intruder was sent nothing.
        assert engine.calls == [("sleep", 1)] and out.decode().strip() == "[]"
        assert handle.registered and handle.error is None
    finally:
        if intruder.returncode is None:
            intruder.kill()
            await intruder.wait()
        await asyncio.to_thread(handle.close)


async def test_a_job_s_sampler_and_trainer_workloads_move_with_their_own_group(
    agent: Agent,
) -> None:
    sampler, trainer = FakeVllm(), FakeSglang()
    handles = [
        register_workload(f"unix:{agent.socket}", "job-2g", group, workload=engine)
        for group, engine in (("sampler", sampler), ("trainer", trainer))
    ]
    try:
        for handle in handles:
            assert await asyncio.to_thread(handle.wait_registered, 20), handle.error
        saved = await agent.run(
            agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-2g", group="trainer"))
        )
        assert saved.status == pb.OPERATION_STATUS_COMPLETE, saved.error
        assert trainer.calls == [("release", None)] and sampler.calls == []
        status = await agent.stub.Status(pb.StatusRequest())
        states = {j.group: j.state for j in status.job_statuses if j.job_id == "job-2g"}
        assert states == {"sampler": pb.JOB_STATE_RUNNING, "trainer": pb.JOB_STATE_SAVED}
        assert all(h.registered and h.error is None for h in handles)
    finally:
        for handle in handles:
            await asyncio.to_thread(handle.close)


async def test_agent_sends_the_second_stage_of_a_staged_restore(agent: Agent) -> None:
    engine = FakeVllm()
    handle = await _register(agent, "job-st", engine)
    try:
        saved = await agent.run(
            agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-st", group=GROUP))
        )
        assert saved.status == pb.OPERATION_STATUS_COMPLETE, saved.error
        weights = await agent.run(
            agent.stub.Restore(
                pb.RestoreRequest(
                    job_id="job-st", group=GROUP, backend_config=_channel_config(tags=("weights",))
                )
            )
        )
        assert weights.status == pb.OPERATION_STATUS_COMPLETE, weights.error
        assert await agent.state("job-st") == pb.JOB_STATE_RUNNING
        # RUNNING, but the KV cache is still off the device: this restore must reach the engine.
        kv = await agent.run(
            agent.stub.Restore(
                pb.RestoreRequest(
                    job_id="job-st", group=GROUP, backend_config=_channel_config(tags=("kv_cache",))
                )
            )
        )
        assert kv.status == pb.OPERATION_STATUS_COMPLETE, kv.error
        assert engine.calls == [("sleep", 1), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
        # Everything is back: a further restore of the KV cache is a no-op.
        again = await agent.run(
            agent.stub.Restore(
                pb.RestoreRequest(
                    job_id="job-st", group=GROUP, backend_config=_channel_config(tags=("kv_cache",))
                )
            )
        )
        assert again.status == pb.OPERATION_STATUS_COMPLETE, again.error
        assert len(engine.calls) == 3
    finally:
        await asyncio.to_thread(handle.close)


async def test_agent_refuses_an_undeclared_mode_or_tag_at_the_rpc(agent: Agent) -> None:
    engine = FakeSglang()  # started for OFFLOAD: DISCARD is not declared
    handle = await _register(agent, "job-sg", engine)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.stub.Snapshot(
                pb.SnapshotRequest(
                    job_id="job-sg",
                    group=GROUP,
                    backend_config=_channel_config(mode=pb.SUSPEND_MODE_DISCARD),
                )
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "does not support suspend mode SUSPEND_MODE_DISCARD" in (info.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await agent.stub.Snapshot(
                pb.SnapshotRequest(
                    job_id="job-sg", group=GROUP, backend_config=_channel_config(tags=("lora",))
                )
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "unknown tags ['lora']" in (info.value.details() or "")
        # Nothing reached the engine and the job is untouched.
        assert engine.calls == [] and handle.commands_executed == 0
        assert await agent.state("job-sg") == pb.JOB_STATE_RUNNING
        ok = await agent.run(agent.stub.Snapshot(pb.SnapshotRequest(job_id="job-sg", group=GROUP)))
        assert ok.status == pb.OPERATION_STATUS_COMPLETE, ok.error
        assert engine.calls == [("release", None)]
    finally:
        await asyncio.to_thread(handle.close)
