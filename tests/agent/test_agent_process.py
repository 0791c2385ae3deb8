"""A real ``tslice agent`` process, SIGKILLed mid-operation and restarted on its state dir."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

# Fallback while `python -m tslice` cannot start (the CLI is assembled by another module).
_LAUNCHER = (
    "import sys, typer\n"
    "from tslice.cli import agent_cmd\n"
    "app = typer.Typer()\n"
    "agent_cmd.register(app)\n"
    "app.command('version')(lambda: None)\n"
    "app(sys.argv[1:])\n"
)


def _command() -> list[str]:
    try:
        import tslice.cli.main  # noqa: F401
    except ImportError:
        return [sys.executable, "-c", _LAUNCHER]
    return [sys.executable, "-m", "tslice"]


class AgentProcess:
    def __init__(self, state_dir: Path, *extra: str) -> None:
        self.state_dir = state_dir
        self.extra = extra
        self.ready_file = state_dir.parent / "agent.ready"
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: grpc.aio.Channel | None = None

    async def start(self) -> pb_grpc.SnapshotAgentServiceStub:
        self.ready_file.unlink(missing_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            *_command(),
            "agent",
            "--node-name=node-p",
            "--port=0",
            f"--state-dir={self.state_dir}",
            f"--ready-file={self.ready_file}",
            "--backend=sim",
            "--sim-capacity=10GiB",
            "--sim-bandwidth=2TB/s",
            "--sim-latency=0.001",
            "--log-level=warning",
            *self.extra,
            stderr=asyncio.subprocess.PIPE,
        )
        address = await self._wait_ready()
        self.channel = grpc.aio.insecure_channel(address)
        return pb_grpc.SnapshotAgentServiceStub(self.channel)

    async def _wait_ready(self) -> str:
        assert self.proc is not None
        # The ready file is the process's only signal; poll it, bounded, and fail fast
        # with the agent's stderr if the process dies first.
        for _ in range(600):
            if self.ready_file.exists():
                ready = json.loads(self.ready_file.read_text())
                assert ready["pid"] == self.proc.pid
                return str(ready["address"])
            if self.proc.returncode is not None:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), timeout=0.05)
        stderr = await self.proc.stderr.read() if self.proc.stderr else b""
        raise AssertionError(f"agent did not become ready: {stderr.decode()[-2000:]}")

    async def kill(self) -> None:
        assert self.proc is not None
        if self.channel is not None:
            await self.channel.close()
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        assert self.proc.returncode == -signal.SIGKILL

    async def terminate(self) -> int:
        assert self.proc is not None
        if self.channel is not None:
            await self.channel.close()
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), timeout=20)


@pytest.fixture
async def processes(tmp_path: Path) -> AsyncIterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for proc in started:
        if proc.proc is not None and proc.proc.returncode is None:
            proc.proc.kill()
            await proc.proc.wait()


async def _wait(stub: pb_grpc.SnapshotAgentServiceStub, op_id: str) -> pb.GetOperationResponse:
    return await stub.WaitOperation(pb.WaitOperationRequest(operation_id=op_id, timeout_ms=20_000))


async def _jobs(stub: pb_grpc.SnapshotAgentServiceStub) -> dict[str, pb.JobStatus]:
    return {j.job_id: j for j in (await stub.Status(pb.StatusRequest())).job_statuses}


def _never_two_resident(events: list[device.Event]) -> None:
    resident: dict[tuple[str, str], set[str]] = {}
    for event in events:
        holders = resident.setdefault((event.group, event.device), set())
        if event.event == "alloc":
            holders.add(event.job)
            assert len(holders) == 1, f"two jobs resident on {event.device}: {holders}"
        else:
            holders.discard(event.job)


async def test_sigkill_mid_operation_loses_nothing(
    tmp_path: Path, processes: list[AgentProcess]
) -> None:
    state_dir = tmp_path / "state"
    slow = ("--sim-extra-latency=60",)

    # 1. Killed during a snapshot: nothing moved, the job is still resident.
    first = AgentProcess(state_dir, *slow)
    processes.append(first)
    stub = await first.start()
    assert (await stub.Grant(pb.GrantRequest(job_id="job-a", group="g", grant_epoch=1))).state == (
        pb.JOB_STATE_RUNNING
    )
    cut = await stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert (await _jobs(stub))["job-a"].state == pb.JOB_STATE_TRANSITIONING
    await first.kill()

    second = AgentProcess(state_dir)
    processes.append(second)
    stub = await second.start()
    job = (await _jobs(stub))["job-a"]
    assert job.state == pb.JOB_STATE_RUNNING
    op = await stub.GetOperation(pb.GetOperationRequest(operation_id=cut.operation_id))
    assert op.status == pb.OPERATION_STATUS_FAILED
    assert "agent restarted during operation" in op.error
    snap = await stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group="g"))
    assert (await _wait(stub, snap.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
    await stub.Grant(pb.GrantRequest(job_id="job-b", group="g", grant_epoch=2))
    snap_b = await stub.Snapshot(pb.SnapshotRequest(job_id="job-b", group="g"))
    assert (await _wait(stub, snap_b.operation_id)).storage_bytes > 0
    await second.kill()  # idle kill: everything was written before each reply

    # 2. Killed during a restore: the bytes that landed are given back, the job is SAVED.
    third = AgentProcess(state_dir, *slow)
    processes.append(third)
    stub = await third.start()
    jobs = await _jobs(stub)
    assert (jobs["job-a"].state, jobs["job-b"].state) == (pb.JOB_STATE_SAVED, pb.JOB_STATE_SAVED)
    cut = await stub.Restore(pb.RestoreRequest(job_id="job-a", group="g"))
    assert (await _jobs(stub))["job-a"].state == pb.JOB_STATE_TRANSITIONING
    await third.kill()

    fourth = AgentProcess(state_dir)
    processes.append(fourth)
    stub = await fourth.start()
    jobs = await _jobs(stub)
    assert jobs["job-a"].state == pb.JOB_STATE_SAVED
    status = await stub.Status(pb.StatusRequest())
    assert status.accelerator_statuses[0].memory_used_bytes == 0
    again = await stub.Restore(pb.RestoreRequest(job_id="job-a", group="g"))
    assert (await _wait(stub, again.operation_id)).status == pb.OPERATION_STATUS_COMPLETE
    # The fencing epoch survived every crash.
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Grant(pb.GrantRequest(job_id="job-c", group="g", grant_epoch=1))
    assert "stale" in info.value.details()
    assert await fourth.terminate() == 0

    events = device.read_journal(state_dir / device.JOURNAL_FILE)
    assert [(e.job, e.event) for e in events] == [
        ("job-a", "alloc"),
        ("job-a", "free"),  # the snapshot starts (the state is no longer usable)...
        ("job-a", "alloc"),  # ...and was cut by the crash: resident again after the restart
        ("job-a", "free"),
        ("job-b", "alloc"),
        ("job-b", "free"),
        ("job-a", "alloc"),  # the interrupted restore...
        ("job-a", "free"),  # ...given back on recovery
        ("job-a", "alloc"),
    ]
    _never_two_resident(events)
