"""A real agent process fed hostile input stays responsive: health and SIGTERM answered.

The agent runs as ``python -m tslice agent`` on loopback (tests.harness.servers).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.ports import closed_port
from tests.harness.servers import Server
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

#: The closed port every endpoint of the list names (on as many loopback addresses: an
#: endpoint is a base URL without a path), allowed by the agent's config.
PORT = closed_port()


@pytest.fixture
def agent(tmp_path: pathlib.Path) -> Iterator[Server]:
    config = tmp_path / "agent.yaml"
    config.write_text(
        f'backend_settings: {{app-endpoint: {{allowed_hosts: ["127.0.0.0/8:{PORT}"]}}}}\n'
    )
    server = Server(
        "agent",
        [
            "--config", str(config),
            "--node-name", "node-a",
            "--host", "127.0.0.1",
            "--port", "0",
            "--state-dir", str(tmp_path / "agent"),
            "--register-socket", str(tmp_path / "r.sock"),
            "--backend", "app-endpoint",
            "--operation-timeout", "5",
        ],
        tmp_path / "agent.log",
    )  # fmt: skip
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _snapshot(count: int) -> pb.SnapshotRequest:
    endpoints = [f"http://127.0.{i // 250}.{i % 250 + 1}:{PORT}" for i in range(count)]
    config = pb.AppEndpointConfig(app=pb.APP_VLLM, endpoints=endpoints)
    return pb.SnapshotRequest(
        job_id="j", group="g", backend_config=pb.BackendConfig(app_endpoint=config)
    )


@pytest.mark.parametrize("count", [1024, 10_000])
def test_a_long_endpoint_list_leaves_health_and_sigterm_answered(agent: Server, count: int) -> None:
    with grpc.insecure_channel(agent.address) as channel:
        snapshot = pb_grpc.SnapshotAgentServiceStub(channel).Snapshot.future(
            _snapshot(count), timeout=60
        )
        health = health_pb2_grpc.HealthStub(channel)
        # While the agent works on the list (or once it refused it), it answers at once.
        for _ in range(3):
            reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        if count > 1024:
            with pytest.raises(grpc.RpcError) as info:
                snapshot.result()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 1024" in (info.value.details() or "")
        else:
            assert snapshot.result().operation_id
    # The operation is still retrying engines that refuse connections: SIGTERM stops it.
    assert agent.terminate() == 0, agent.logs()
