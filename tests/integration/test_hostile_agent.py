"""A real agent process fed hostile input stays responsive: health and SIGTERM answered.

The agent runs as ``python -m tslice agent`` on loopback; readiness is its own
"serving on" log line (no sleeps). :class:`Server` is shared with the lost-state tests.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

_SERVING = re.compile(r"serving on (127\.0\.0\.1:\d+)")
START_TIMEOUT_S = 60.0
#: A server given SIGTERM with nothing left to finish stops well within this.
STOP_TIMEOUT_S = 15.0


class Server:
    """One ``python -m tslice KIND ...`` process; its output goes to ``log_path``."""

    def __init__(self, kind: str, args: Sequence[str], log_path: pathlib.Path) -> None:
        self.kind = kind
        self.address = ""
        self.log_path = log_path
        self._ready = threading.Event()
        self._log = log_path.open("a", encoding="utf-8", buffering=1)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tslice", kind, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            match = _SERVING.search(line)
            if match and not self.address:
                self.address = match.group(1)
                self._ready.set()
        self._ready.set()

    def wait_serving(self) -> str:
        if not self._ready.wait(START_TIMEOUT_S) or not self.address:
            self.stop()
            raise AssertionError(f"{self.kind} did not start:\n{self.logs()}")
        return self.address

    def logs(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def terminate(self) -> int:
        """SIGTERM; the exit code (the test fails if it does not stop in time)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(
                f"{self.kind} ignored SIGTERM for {STOP_TIMEOUT_S:g} s:\n{self.logs()}"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=STOP_TIMEOUT_S)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        server.wait_serving()
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
