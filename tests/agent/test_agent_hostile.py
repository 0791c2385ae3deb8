"""Hostile input at the agent's edge: each field is refused before it costs anything.

Real in-process agents on 127.0.0.1:0 (see conftest.py). Every refusal is
INVALID_ARGUMENT with a short message that names the field (and, for enums, the
valid values), and nothing was created on the node.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.agent.agent_doubles import GatedBackend
from tests.agent.conftest import AgentRunner
from tests.harness.ports import closed_port
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


# ---- 2. ids, counts and bounded messages -----------------------------------------------------

HUGE = "x" * 3_000_000  # a 3 MB id: gRPC's metadata limit is 16 KiB
SHORT = 1000  # an error message longer than this echoes the input


@pytest.mark.parametrize("rpc", ["GetOperation", "WaitOperation"])
async def test_huge_operation_id_is_refused_with_a_short_message(
    agents: AgentRunner, rpc: str
) -> None:
    agent = await agents.start()
    request = getattr(pb, f"{rpc}Request")(operation_id=HUGE)
    err = await _refused(getattr(agent.stub, rpc)(request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "operation_id" in err.details() and len(err.details()) < SHORT


@pytest.mark.parametrize("field", ["job_id", "group"])
@pytest.mark.parametrize("rpc", ["Snapshot", "Grant", "ResetJob"])
async def test_huge_or_malformed_ids_are_refused_with_a_short_message(
    agents: AgentRunner, rpc: str, field: str
) -> None:
    agent = await agents.start()
    for bad in (HUGE, "white space " * 20, "x" * 254, "-leading-dash"):
        fields = {"job_id": "j", "group": "g", field: bad}
        err = await _refused(getattr(agent.stub, rpc)(getattr(pb, f"{rpc}Request")(**fields)))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert field in err.details() and len(err.details()) < SHORT
    assert await agent.jobs() == {}


@pytest.mark.parametrize(
    ("what", "request_"),
    [
        ("evict", pb.GrantRequest(job_id="j", group="g", evict=[f"e{i}" for i in range(5000)])),
        # Malformed entries too: the count is refused before any entry is looked at.
        ("evict", pb.GrantRequest(job_id="j", group="g", evict=["not an id!"] * 5000)),
        (
            "give_way",
            pb.GrantRequest(
                job_id="j", group="g", give_way=[pb.JobRef(job_id="e", group="o")] * 5000
            ),
        ),
        ("devices", pb.GrantRequest(job_id="j", group="g", devices=[-1] * 5000)),
        (
            "backend_config.app_channel.tags",
            pb.GrantRequest(
                job_id="j",
                group="g",
                backend_config=pb.BackendConfig(
                    app_channel=pb.AppChannelConfig(tags=[f"t{i}" for i in range(5000)])
                ),
            ),
        ),
    ],
)
async def test_repeated_fields_are_bounded(
    agents: AgentRunner, what: str, request_: pb.GrantRequest
) -> None:
    agent = await agents.start(**BACKENDS)
    err = await _refused(agent.stub.Grant(request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert f"{what} has 5000 entries; at most 1024" in err.details()
    assert len(err.details()) < SHORT
    assert await agent.jobs() == {}


async def test_snapshot_tags_are_bounded(agents: AgentRunner) -> None:
    agent = await agents.start(**BACKENDS)
    config = pb.BackendConfig(app_channel=pb.AppChannelConfig(tags=["t"] * 2000))
    err = await _refused(
        agent.stub.Snapshot(pb.SnapshotRequest(job_id="j", group="g", backend_config=config))
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tags has 2000 entries" in err.details()
    assert await agent.jobs() == {}


async def test_a_registration_with_too_many_tags_is_refused(agents: AgentRunner) -> None:
    agent = await agents.start(**BACKENDS)
    register = pb.RegisterWorkload(
        job_id="j",
        group="g",
        capabilities=pb.WorkloadCapabilities(tags=[f"t{i}" for i in range(5000)]),
    )
    call = agent.stub.WorkloadChannel()
    await call.write(pb.WorkloadMessage(register=register))
    err = await _refused(call.read())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tags has 5000 entries" in err.details() and len(err.details()) < SHORT


@pytest.mark.parametrize(
    "job_id", ["verl-grpo-7b", "ns/job-1.a_b", "slime_run.3", "a:b@c+d=e", "x" * 253, "7"]
)
async def test_well_formed_ids_are_accepted(agents: AgentRunner, job_id: str) -> None:
    agent = await agents.start()
    assert await agent.grant(job_id, group="pool.a_1", epoch=1) == pb.JOB_STATE_RUNNING


# ---- 4. duplicate request ids on a GrantStream -----------------------------------------------


async def test_a_duplicate_grant_stream_request_id_is_refused(agents: AgentRunner) -> None:
    # The first Grant's eviction waits on the gate: it is still in flight when the second
    # arrives, however slow the machine (a copy's length was the margin once).
    gated = GatedBackend()
    agent = await agents.start(default_backend="gated", instances={"gated": gated})
    assert await agent.grant("a", epoch=1) == pb.JOB_STATE_RUNNING
    call = agent.stub.GrantStream()
    first = pb.GrantRequest(job_id="b", group="g", grant_epoch=2, evict=["a"], wait_ms=60_000)
    await call.write(pb.GrantStreamRequest(request_id=1, grant=first))
    await gated.started.wait()
    await call.write(pb.GrantStreamRequest(request_id=1, grant=first))
    refused = await call.read()
    assert refused.request_id == 1
    assert refused.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0], refused
    assert "already in flight" in refused.status_message
    assert gated.calls == ["snapshot"]
    gated.release()
    granted = await call.read()  # the first one goes on
    assert granted.request_id == 1 and granted.status_code == 0 and granted.grant.granted
    await call.done_writing()


# ---- 5. long app-endpoint lists --------------------------------------------------------------


def _endpoints(count: int, port: int) -> list[str]:
    # One closed port on as many loopback addresses (an endpoint is a base URL, no path).
    return [f"http://127.0.{i // 250}.{i % 250 + 1}:{port}" for i in range(count)]


def _allowing(port: int) -> dict[str, Any]:
    """Agent settings that allow ``port`` on every loopback address (the list's engines)."""
    return {"backend_settings": {"app-endpoint": {"allowed_hosts": [f"127.0.0.0/8:{port}"]}}}


async def test_too_many_endpoints_are_refused_at_once(agents: AgentRunner) -> None:
    port = closed_port()
    agent = await agents.start(**BACKENDS, **_allowing(port))
    config = _endpoint(endpoints=_endpoints(10_000, port))
    request = pb.SnapshotRequest(job_id="j", group="g", backend_config=config)
    err = await _refused(agent.stub.Snapshot(request, timeout=30))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "endpoints has 10000 entries; at most 1024" in err.details()
    assert await agent.jobs() == {}


async def test_a_long_endpoint_list_leaves_the_agent_responsive(agents: AgentRunner) -> None:
    # The longest list accepted, to engines that refuse connections: the operation retries
    # until its (short) deadline, then fails; health is answered throughout, each check
    # within half the operation's deadline (so at least two while it runs: an event loop
    # held by the operation misses one). Not within a second: on 2 busy cores (the suite
    # on pytest-xdist beside it) a responsive agent can take that long.
    port = closed_port()
    operation_timeout_s = 5.0
    agent = await agents.start(
        operation_timeout_s=operation_timeout_s, **BACKENDS, **_allowing(port)
    )
    config = _endpoint(endpoints=_endpoints(1024, port))
    request = pb.SnapshotRequest(job_id="j", group="g", backend_config=config)
    started = asyncio.ensure_future(agent.stub.Snapshot(request, timeout=30))
    checks = 0
    op: pb.GetOperationResponse | None = None
    while op is None or op.status == pb.OPERATION_STATUS_PENDING:
        reply = await agent.health.Check(
            health_pb2.HealthCheckRequest(), timeout=operation_timeout_s / 2
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        checks += 1
        if started.done():
            operation_id = started.result().operation_id
            op = await agent.stub.GetOperation(pb.GetOperationRequest(operation_id=operation_id))
    assert op.status == pb.OPERATION_STATUS_FAILED and len(op.error) < 4096, op.error
    assert checks > 1
