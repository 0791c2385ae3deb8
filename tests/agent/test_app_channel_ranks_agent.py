"""Several rank processes of one job through the real agent (tslice.agent.app.serve).

Each rank is its own process registered over the agent's Unix socket with its rank.
The Snapshot RPC reaches every rank before any answers (each holds its answer until
the test has seen all three asked), and one rank failing leaves the job RUNNING with
every rank's bytes back on its device.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

from .channel_ranks import RANK_PROCESS, real_agent

GROUP = "trainer"


async def _line(process: asyncio.subprocess.Process) -> str:
    assert process.stdout is not None
    return (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()


async def _tell(process: asyncio.subprocess.Process, line: str) -> None:
    assert process.stdin is not None
    process.stdin.write(f"{line}\n".encode())
    await process.stdin.drain()


@pytest.fixture
async def tmp() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tsl-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def _ranks(
    socket: Path, job_id: str, fails: dict[int, str]
) -> list[asyncio.subprocess.Process]:
    ranks = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            RANK_PROCESS,
            str(socket),
            job_id,
            GROUP,
            str(rank),
            fails.get(rank, ""),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        for rank in range(3)
    ]
    for process in ranks:
        assert await _line(process) == "registered True"
    return ranks


async def _state(stub: object, job_id: str) -> int:
    status = await stub.Status(pb.StatusRequest())  # type: ignore[attr-defined]
    (job,) = [j for j in status.job_statuses if j.job_id == job_id]
    return int(job.state)


async def test_one_failing_rank_leaves_the_job_running_with_every_rank_intact(
    tmp: Path,
) -> None:
    async with real_agent(tmp) as (stub, socket):
        ranks = await _ranks(socket, "job-r", {1: "snapshot"})
        try:
            await stub.Grant(pb.GrantRequest(job_id="job-r", group=GROUP, grant_epoch=1))
            started = await stub.Snapshot(pb.SnapshotRequest(job_id="job-r", group=GROUP))
            # Every rank is asked before any of them answers.
            assert [await _line(p) for p in ranks] == ["asked snapshot"] * 3
            for process in ranks:
                await _tell(process, "go")
            done = await stub.WaitOperation(
                pb.WaitOperationRequest(operation_id=started.operation_id, timeout_ms=30_000)
            )
            assert done.status == pb.OPERATION_STATUS_FAILED
            assert "failed on rank 1 of 3" in done.error, done.error
            assert "ranks 0, 1, 2, sent the snapshot, were brought back" in done.error
            assert [await _line(p) for p in ranks] == ["asked restore"] * 3
            assert await _state(stub, "job-r") == pb.JOB_STATE_RUNNING
        finally:
            outs = []
            for process in ranks:
                await _tell(process, "quit")
                out, _ = await asyncio.wait_for(process.communicate(), 30)
                outs.append(out.decode().strip())
        assert outs == ["intact True"] * 3


async def test_ranks_that_left_have_nothing_to_move_and_the_last_one_leaves_it_idle(
    tmp: Path,
) -> None:
    async with real_agent(tmp) as (stub, socket):
        ranks = await _ranks(socket, "job-l", {})
        await stub.Grant(pb.GrantRequest(job_id="job-l", group=GROUP, grant_epoch=1))
        outs = []
        for process in ranks[:2]:
            await _tell(process, "quit")  # the rank closes its channel and its process ends
            out, _ = await asyncio.wait_for(process.communicate(), 30)
            outs.append(out.decode().strip())
        # Rank 2 still holds its part of the job: only it is asked to move.
        started = await stub.Snapshot(pb.SnapshotRequest(job_id="job-l", group=GROUP))
        assert await _line(ranks[2]) == "asked snapshot"
        await _tell(ranks[2], "go")
        done = await _wait(stub, started.operation_id)
        assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error
        assert await _state(stub, "job-l") == pb.JOB_STATE_SAVED
        # Ranks 0 and 1 took their state with them: nothing to restore the job from.
        started = await stub.Restore(pb.RestoreRequest(job_id="job-l", group=GROUP))
        done = await _wait(stub, started.operation_id)
        assert done.status == pb.OPERATION_STATUS_FAILED
        assert "ranks 0, 1 of job 'job-l' (group 'trainer') left this node" in done.error
        await _tell(ranks[2], "quit")
        out, _ = await asyncio.wait_for(ranks[2].communicate(), 30)
        # Rank 2 ended while its bytes were parked on the host.
        assert outs == ["intact True"] * 2 and out.decode().strip() == "intact False"
        # The last rank left: the job holds nothing anywhere; a snapshot completes at once.
        started = await stub.Snapshot(pb.SnapshotRequest(job_id="job-l", group=GROUP))
        done = await _wait(stub, started.operation_id)
        assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error
        assert await _state(stub, "job-l") == pb.JOB_STATE_IDLE


async def _wait(stub: Any, operation_id: str) -> pb.GetOperationResponse:
    return await stub.WaitOperation(
        pb.WaitOperationRequest(operation_id=operation_id, timeout_ms=30_000)
    )
