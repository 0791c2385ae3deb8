"""Agent configuration (file + flags), the backend registry, the CLI command, metrics, sockets."""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path

import grpc
import httpx
import pytest
import typer
from typer.testing import CliRunner

from tests.agent.conftest import AgentRunner
from tslice.agent import config, metrics
from tslice.agent.backends import noop, registry, sim
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.cli import agent_cmd
from tslice.common import errors
from tslice.server import serving

GiB = 1024**3


def test_defaults() -> None:
    cfg = config.load(overrides={"node_name": "n1"})
    assert (cfg.port, cfg.host, cfg.default_backend, cfg.metrics_port) == (
        9001,
        "127.0.0.1",
        "noop",
        0,
    )
    assert cfg.operation_timeout_s == 600
    assert cfg.sim.capacity_bytes == 80 * GiB
    assert cfg.sim.bandwidth_bytes_per_s == 25 * 10**9
    assert cfg.sim.restore_bandwidth_bytes_per_s is None
    assert cfg.sim.default_footprint_bytes is None
    assert cfg.enabled_backends == ("noop",)


def test_file_and_flags_merge_with_sizes(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "node_name: gpu-1\n"
        "default_backend: sim\n"
        "backends: [noop, sim]\n"
        "sim: {devices: 2, capacity: 40GiB, bandwidth: 50GB/s, restore_bandwidth: 150GB/s,\n"
        "      default_footprint: 30GiB}\n"
        "backend_settings: {noop: {delay_s: 0.5}}\n"
    )
    cfg = config.load(path=path, overrides={"port": 0, "sim": {"devices": 4}})
    assert cfg.node_name == "gpu-1"
    assert cfg.port == 0
    assert (cfg.sim.devices, cfg.sim.capacity_bytes) == (4, 40 * GiB)
    assert cfg.sim.bandwidth_bytes_per_s == 50 * 10**9
    assert cfg.sim.restore_bandwidth_bytes_per_s == 150 * 10**9
    assert cfg.sim.default_footprint_bytes == 30 * GiB
    # The frozen section is exactly the keyword arguments of the sim backend.
    backend = sim.SimBackend.create({**cfg.sim.settings(), "state_dir": None})
    assert backend.speed.rate("restore") == 150 * 10**9
    assert cfg.enabled_backends == ("sim", "noop")
    assert cfg.settings_for("noop") == {"delay_s": 0.5}
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"sim": {"capacity": "80XB"}}, "sim.capacity"),
        ({"sim": {"capacity": "80XB"}}, "write a size such as 80GiB"),
        ({"sim": {"restore_bandwidth": "fast"}}, "sim.restore_bandwidth"),
        ({"sim": {"restore_bandwidth": "0GB/s"}}, "sim.restore_bandwidth"),
        ({"port": 70000}, "port"),
        ({"prot": 1}, "prot: unknown key"),
        ({"node_name": "bad name"}, "node_name"),
        ({"log_level": "loud"}, "log_level: use one of"),
        ({"sim": {"fail_probability": 2}}, "sim.fail_probability"),
        ({"sim": {"capacity": "1GiB", "default_footprint": "2GiB"}}, "raise sim.capacity"),
    ],
)
def test_errors_name_the_field_and_the_fix(overrides: dict[str, object], words: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        config.load(overrides={"node_name": "n1", **overrides})
    assert words in str(info.value)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match="cannot read agent config"):
        config.load(path=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(errors.ConfigError, match="not valid YAML"):
        config.load(path=bad)
    bad.write_text("- a list\n")
    with pytest.raises(errors.ConfigError, match="must be a mapping"):
        config.load(path=bad)


# ---- registry -----------------------------------------------------------------------------------


def test_registry_resolves_lazily_and_explains_failures() -> None:
    assert registry.load_class("noop") is noop.NoopBackend
    with pytest.raises(errors.ConfigError, match="unknown backend 'nope'; choose one of"):
        registry.load_class("nope")
    broken = {"cuda": "tslice.no_such_module:CudaBackend"}
    with pytest.raises(errors.ConfigError, match=r"pip install 'tslice\[gpu\]'"):
        registry.load_class("cuda", registry=broken)
    with pytest.raises(errors.ConfigError, match="not a Backend subclass"):
        registry.load_class("x", registry={"x": "tslice.agent.config:AgentConfig"})
    with pytest.raises(errors.ConfigError, match="invalid settings for backend 'noop'"):
        registry.create("noop", settings={"delay": 1})


async def test_unknown_default_backend_stops_startup(agents: AgentRunner) -> None:
    with pytest.raises(errors.ConfigError, match="unknown backend 'gpu'"):
        await agents.start(default_backend="gpu")


# ---- CLI ---------------------------------------------------------------------------------------


def _cli() -> typer.Typer:
    cli = typer.Typer()
    agent_cmd.register(cli)
    cli.command("version")(lambda: None)
    return cli


def test_cli_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        _cli(), ["agent", "--state-dir", str(tmp_path), "--sim-capacity", "lots"]
    )
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("error: invalid agent config")
    assert "sim.capacity" in lines[0]
    assert "Traceback" not in result.output


def test_cli_restore_bandwidth_flag_reaches_the_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        _cli(), ["agent", "--state-dir", str(tmp_path), "--sim-restore-bandwidth", "quick"]
    )
    assert result.exit_code == 2
    assert "sim.restore_bandwidth" in result.output


def test_cli_unknown_backend_is_exit_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        _cli(), ["agent", "--state-dir", str(tmp_path), "--port", "0", "--backend", "gpu"]
    )
    assert result.exit_code == 2
    assert "unknown backend 'gpu'" in result.output


async def test_unusable_state_dir_is_a_config_error(agents: AgentRunner, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(errors.ConfigError, match="choose another --state-dir"):
        await agents.start(state_dir=str(blocker / "agent"))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "agent.sqlite3").write_text("this is not a database" * 100)
    with pytest.raises(errors.ConfigError, match="is corrupt or not a tslice database"):
        await agents.start(state_dir=str(corrupt), default_backend="noop")


def test_ready_file_is_written_atomically(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "ready.json"
    serving.write_ready_file(target, "127.0.0.1:1234")
    assert json.loads(target.read_text())["address"] == "127.0.0.1:1234"
    assert [p.name for p in target.parent.iterdir()] == ["ready.json"]


# ---- unix socket, metrics -----------------------------------------------------------------------


async def test_unix_socket_serves_the_same_agent(agents: AgentRunner, tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    agent = await agents.start(unix_socket=str(sock))
    # The node's job users (the socket's group) may connect, whatever the umask; the
    # register socket is next to it, where the workload library looks for it.
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    assert stat.S_ISSOCK((tmp_path / "register.sock").stat().st_mode)
    await agent.grant("job-a")
    async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
        stub = pb_grpc.SnapshotAgentServiceStub(channel)
        status = await stub.Status(pb.StatusRequest())
    assert [j.job_id for j in status.job_statuses] == ["job-a"]
    await agents.stop(agent)
    assert not sock.exists()


async def test_metrics_count_operations_and_bytes() -> None:
    agent_metrics = metrics.AgentMetrics()
    agent_metrics.observe(
        backend="sim", kind="snapshot", outcome="complete", seconds=0.1, device_bytes=5
    )
    agent_metrics.observe(
        backend="sim", kind="snapshot", outcome="complete", seconds=2.0, device_bytes=8 * 10**9
    )
    # A failed operation's bytes (what moved before it failed) are no throughput.
    agent_metrics.observe(
        backend="sim", kind="snapshot", outcome="failed", seconds=1.0, device_bytes=10**9
    )
    agent_metrics.count_jobs(lambda: {"RUNNING": 2, "SAVED": 0})
    port = agent_metrics.serve(port=0, host="127.0.0.1")
    try:
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    finally:
        agent_metrics.stop()
    assert (
        'tslice_agent_operations_total{backend="sim",kind="snapshot",outcome="complete"} 2.0'
        in text
    )
    assert 'tslice_agent_bytes_moved_total{backend="sim",kind="snapshot"} 9.000000005e+09' in text
    # GB/s per completed operation, per backend: 5e-8 and 4.0.
    assert 'tslice_agent_operation_throughput_gbps_count{backend="sim",kind="snapshot"} 2.0' in text
    assert (
        'tslice_agent_operation_throughput_gbps_bucket{backend="sim",kind="snapshot",le="4.0"} 2.0'
        in text
    )
    assert (
        'tslice_agent_operation_throughput_gbps_bucket{backend="sim",kind="snapshot",le="2.0"} 1.0'
        in text
    )
    assert 'tslice_agent_jobs{state="RUNNING"} 2.0' in text
    assert 'tslice_agent_jobs{state="SAVED"} 0.0' in text
    assert "tslice_agent_operation_duration_seconds_bucket" in text


async def test_agent_serves_its_metrics(agents: AgentRunner) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = await agents.start(metrics_port=port)
    await agent.grant("job-a")
    await agent.snapshot("job-a")
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    assert (
        'tslice_agent_operations_total{backend="sim",kind="snapshot",outcome="complete"} 1.0'
        in text
    )
    assert 'tslice_agent_jobs{state="SAVED"} 1.0' in text
