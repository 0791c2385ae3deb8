"""Grant calls on an in-process agent, shared by the agent's grant tests: a one-step
Grant request, the error a call ends with, the state before a hand-over."""

from __future__ import annotations

import grpc
import pytest

from tests.agent.conftest import Agent
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

COMPLETE = pb.OPERATION_STATUS_COMPLETE
RUNNING = pb.JOB_STATE_RUNNING


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


def step(job_id: str, *, epoch: int, evict: list[str], wait_ms: int = 10_000) -> pb.GrantRequest:
    return pb.GrantRequest(
        job_id=job_id, group="g", grant_epoch=epoch, evict=evict, restore=True, wait_ms=wait_ms
    )


async def a_running_b_saved(agent: Agent) -> None:
    """job-a resident, job-b saved (both of group g), the state before a hand-over to b."""
    assert await agent.grant("job-b", epoch=1) == RUNNING
    assert (await agent.snapshot("job-b")).status == COMPLETE
    assert await agent.grant("job-a", epoch=2) == RUNNING
