"""One server per port and one process per state directory, with real server processes.

gRPC would let a second server share a busy port (SO_REUSEPORT) and two servers could
share a state directory; both must be refused with one clear line, while the first
server keeps serving. The state directory's lock dies with its process (SIGKILL too).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.harness.ports import closed_port
from tests.harness.servers import Server
from tslice.server import serving

KINDS = ("orchestrator", "agent")
# Local mode over an agent that is never called (groups are created lazily); a noop agent.
BASE_ARGS = {
    "orchestrator": ["--local-agent", "node-a=127.0.0.1:9"],
    "agent": ["--backend", "noop", "--node-name", "node-a"],
}


def command(kind: str, state_dir: Path) -> list[str]:
    return [sys.executable, "-m", "tslice", kind, *BASE_ARGS[kind], "--state-dir", str(state_dir)]


def start(kind: str, state_dir: Path, *args: str) -> Server:
    """A ``python -m tslice orchestrator|agent`` process on ``state_dir``, once ready."""
    server = Server(
        kind,
        [*BASE_ARGS[kind], "--state-dir", str(state_dir), *args],
        state_dir.parent / f"{state_dir.name}-{kind}.log",
    )
    server.wait_ready()
    return server


def health_serving(server: Server) -> bool:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.stop()


def refused(kind: str, state_dir: Path, *args: str) -> str:
    """Run a server that must refuse to start; its one stderr line."""
    proc = subprocess.Popen(
        [*command(kind, state_dir), "--log-level", "warning", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"a second {kind} started ({args}) where it had to be refused")
    assert proc.returncode == 2, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_second_server_on_a_port_in_use_is_refused(
    kind: str, tmp_path: Path, servers: list[Server]
) -> None:
    first = start(kind, tmp_path / "first", "--port", "0", "--metrics-port", "0")
    servers.append(first)
    line = refused(kind, tmp_path / "second", "--port", str(first.port), "--metrics-port", "0")
    assert f"port {first.port} is in use" in line
    assert "stop the process that holds it or choose another --port" in line
    assert first.proc.poll() is None and health_serving(first)


@pytest.mark.parametrize("kind", KINDS)
def test_a_metrics_port_in_use_is_refused(kind: str, tmp_path: Path, servers: list[Server]) -> None:
    metrics_port = closed_port()
    first = start(kind, tmp_path / "first", "--port", "0", "--metrics-port", str(metrics_port))
    servers.append(first)
    line = refused(kind, tmp_path / "second", "--port", "0", "--metrics-port", str(metrics_port))
    assert f"port {metrics_port} is in use" in line
    assert "choose another --metrics-port (--metrics-port 0 = off)" in line
    assert first.proc.poll() is None and health_serving(first)


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_dir_serves_one_process_and_is_free_again_after_sigkill(
    kind: str, tmp_path: Path, servers: list[Server]
) -> None:
    state_dir = tmp_path / "state"
    first = start(kind, state_dir, "--port", "0", "--metrics-port", "0")
    servers.append(first)
    line = refused(kind, state_dir, "--port", "0", "--metrics-port", "0")
    assert f"state directory {state_dir} is in use by another {kind} (pid {first.proc.pid})" in line
    assert "--state-dir" in line
    assert health_serving(first)

    first.kill()  # SIGKILL: no clean-up ran, the kernel drops the lock
    again = start(kind, state_dir, "--port", str(first.port), "--metrics-port", "0")
    servers.append(again)
    assert health_serving(again)


def test_the_lock_is_released_when_the_block_ends(tmp_path: Path) -> None:
    with serving.locked_state_dir(tmp_path, what="orchestrator"):
        assert (tmp_path / serving.LOCK_FILE).read_text().strip() == str(os.getpid())
        with (
            pytest.raises(serving.InUseError, match=f"pid {os.getpid()}"),
            serving.locked_state_dir(tmp_path, what="orchestrator"),
        ):
            pass
    with serving.locked_state_dir(tmp_path, what="orchestrator"):
        pass


def test_default_state_dirs_are_absolute(monkeypatch: pytest.MonkeyPatch) -> None:
    from tslice.agent import config as agent_config
    from tslice.orchestrator import config as orch_config

    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    for path in (orch_config.default_state_dir(), agent_config.default_state_dir()):
        assert path.is_absolute()
    root = os.geteuid() == 0
    base = Path("/var/lib/tslice") if root else Path.home() / ".local/state/tslice"
    assert orch_config.default_state_dir() == base / "orchestrator"
    assert agent_config.default_state_dir() == base / "agent"
    monkeypatch.setenv("XDG_STATE_HOME", "/srv/state")
    assert orch_config.default_state_dir() == Path("/srv/state/tslice/orchestrator")
    assert agent_config.default_state_dir() == Path("/srv/state/tslice/agent")
    monkeypatch.setenv("XDG_STATE_HOME", "relative/dir")  # ignored, as the XDG spec says
    assert orch_config.default_state_dir() == base / "orchestrator"
    assert orch_config.OrchestratorModel().state_dir == base / "orchestrator"
