"""The app-endpoint backend wired into a real in-process agent (gRPC), against local engines."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.sim import engine_server

GiB = 1 << 30


@pytest.fixture
def vllm_pair() -> Iterator[list[engine_server.EngineServer]]:
    servers = [
        engine_server.EngineServer(dialect="vllm", tags={"weights": 3 * GiB, "kv_cache": GiB})
        for _ in range(2)
    ]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def endpoint_config(*urls: str, tags: tuple[str, ...] = ()) -> pb.BackendConfig:
    return pb.BackendConfig(
        app_endpoint=pb.AppEndpointConfig(
            app=pb.APP_VLLM, endpoints=list(urls), mode=pb.SUSPEND_MODE_OFFLOAD, tags=list(tags)
        )
    )


async def start_agent(agents: Any, **overrides: Any) -> Any:
    """An agent (conftest ``AgentRunner``) with the app-endpoint backend enabled."""
    config = agents.make_config(
        backends=["app-endpoint"],
        backend_settings={
            "app-endpoint": {
                # The engine servers listen on ports the system picks: allowed explicitly.
                "allowed_hosts": ["127.0.0.1:1024-65535"],
                "timeout_s": 5,
                "connect_timeout_s": 2,
            }
        },
        **overrides,
    )
    return await agents.start_config(config)


async def test_snapshot_and_restore_through_the_agent(
    agents: Any, vllm_pair: list[engine_server.EngineServer]
) -> None:
    agent = await start_agent(agents)
    config = endpoint_config(*(s.url for s in vllm_pair))
    snap = await agent.snapshot("job-a", backend_config=config)
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap.error
    assert snap.snapshot_device_bytes == 2 * 4 * GiB and snap.storage_bytes == 2 * 3 * GiB
    assert all(s.device_bytes == 0 for s in vllm_pair)
    job = (await agent.jobs())["job-a"]
    assert job.state == pb.JOB_STATE_SAVED and job.backend == "app-endpoint"

    restore = await agent.restore("job-a")  # no config: the recorded one is reused
    assert restore.status == pb.OPERATION_STATUS_COMPLETE, restore.error
    assert all(not s.is_sleeping for s in vllm_pair)
    assert [r.target for r in vllm_pair[0].requests] == ["/sleep?level=1", "/wake_up"]
    assert await agent.state("job-a") == pb.JOB_STATE_RUNNING


async def test_partial_failure_leaves_the_job_running(
    agents: Any, vllm_pair: list[engine_server.EngineServer]
) -> None:
    agent = await start_agent(agents, operation_timeout_s=1.0)
    good, bad = vllm_pair
    bad.inject_fault(status=503, path="/sleep", count=1000)  # refuses every attempt
    snap = await agent.snapshot("job-a", backend_config=endpoint_config(good.url, bad.url))
    assert snap.status == pb.OPERATION_STATUS_FAILED
    assert f"{bad.url}: POST /sleep?level=1 returned HTTP 503" in snap.error
    assert await agent.state("job-a") == pb.JOB_STATE_RUNNING  # compensated: nothing moved
    assert not good.is_sleeping and not bad.is_sleeping


async def test_refused_host_reaches_no_engine(
    agents: Any, vllm_pair: list[engine_server.EngineServer]
) -> None:
    agent = await start_agent(agents)
    local = vllm_pair[0]
    config = endpoint_config(local.url, "http://10.0.0.1:8000")
    try:
        op = await agent.snapshot("job-a", backend_config=config)
    except grpc.aio.AioRpcError as err:
        # Refused up front (the agent validated the config before creating an operation).
        assert err.code() in (
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        assert "allowed_hosts" in (err.details() or "")
    else:
        assert op.status == pb.OPERATION_STATUS_FAILED
        assert "allowed_hosts" in op.error
    assert local.requests == [] and local.connections == 0
