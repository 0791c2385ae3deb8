"""Hostile input at the agent's edge: each field is refused before it costs anything.

Real in-process agents on 127.0.0.1:0 (see conftest.py). Every refusal is
INVALID_ARGUMENT with a short message that names the field (and, for enums, the
valid values), and nothing was created on the node.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from tests.agent.conftest import AgentRunner
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

BACKENDS = {"backends": ["sim", "app-channel", "app-endpoint"]}


def _channel(mode: int) -> pb.BackendConfig:
    return pb.BackendConfig(app_channel=pb.AppChannelConfig(mode=mode))  # type: ignore[arg-type]


def _endpoint(**kw: Any) -> pb.BackendConfig:
    fields: dict[str, Any] = {"app": pb.APP_VLLM, "endpoints": ["http://127.0.0.1:9"], **kw}
    return pb.BackendConfig(app_endpoint=pb.AppEndpointConfig(**fields))


async def _refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


# ---- 1. unknown enum values ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "config", "valid"),
    [
        ("backend_config.app_channel.mode", _channel(7), "SUSPEND_MODE_OFFLOAD (1)"),
        ("backend_config.app_endpoint.mode", _endpoint(mode=9), "SUSPEND_MODE_DISCARD (2)"),
        ("backend_config.app_endpoint.app", _endpoint(app=5), "APP_SGLANG (2)"),
    ],
)
@pytest.mark.parametrize("kind", ["Snapshot", "Restore", "Grant"])
async def test_unknown_enum_value_is_refused_naming_the_valid_ones(
    agents: AgentRunner, kind: str, field: str, config: pb.BackendConfig, valid: str
) -> None:
    agent = await agents.start(**BACKENDS)
    if kind == "Grant":
        call = agent.stub.Grant(
            pb.GrantRequest(job_id="j", group="g", grant_epoch=1, backend_config=config)
        )
    else:
        request = getattr(pb, f"{kind}Request")(job_id="j", group="g", backend_config=config)
        call = getattr(agent.stub, kind)(request)
    err = await _refused(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details() and valid in err.details()
    assert await agent.jobs() == {}  # no job, no operation left PENDING


async def test_unknown_deprecated_backend_is_refused(agents: AgentRunner) -> None:
    agent = await agents.start()
    request = pb.SnapshotRequest(job_id="j", group="g", backend=3)  # type: ignore[arg-type]
    err = await _refused(agent.stub.Snapshot(request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "BACKEND_CUDA (1)" in err.details()
    assert await agent.jobs() == {}
