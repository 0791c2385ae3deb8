"""``tslice doctor``: on a node (a real agent's sockets; the GPU checks blocking only for the
cuda backend; the driver and memory checks on fixture files) and from an orchestrator's
config (a real agent that answers, an address where nothing listens)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.harness.ports import closed_port
from tests.harness.servers import Server
from tslice.agent import doctor


def row(output: str, check: str, result: str) -> str:
    """The line of ``check`` if its result is ``result`` (the table's spacing aside)."""
    found = re.search(rf"^ *{re.escape(check)} +{result} +(.*)$", output, re.MULTILINE)
    assert found is not None, f"no {check!r} row with {result!r}:\n{output}"
    return found.group(1).strip()


def run_doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tslice", "doctor", *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.fixture
def agent(short_tmp: pathlib.Path) -> Iterator[tuple[pathlib.Path, str]]:
    """A running sim agent with a Unix socket: its config file and TCP address."""
    config = short_tmp / "agent.yaml"
    config.write_text(
        f"unix_socket: {short_tmp / 'agent.sock'}\nstate_dir: {short_tmp / 'state'}\n"
        "default_backend: sim\n"
    )
    server = Server(
        "agent",
        ["--config", str(config), "--node-name", "node-a", "--port", "0"],
        short_tmp / "agent.log",
    )
    try:
        address = server.wait_ready()
        yield config, address
    finally:
        server.stop()


def test_a_sim_node_with_its_agent_running_passes(agent: tuple[pathlib.Path, str]) -> None:
    config, _ = agent
    done = run_doctor("--agent-config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "backends sim" in done.stdout
    assert "agent.sock" not in row(done.stdout, "register socket", "(ok|warn)")
    # No GPU here: said, but it blocks nothing on simulated devices.
    assert row(done.stdout, "NVIDIA driver", "info").startswith("not loaded")


def test_a_cuda_node_without_a_gpu_or_an_agent_is_told_what_to_fix(
    short_tmp: pathlib.Path,
) -> None:
    config = short_tmp / "agent.yaml"
    config.write_text(f"unix_socket: {short_tmp / 'none.sock'}\ndefault_backend: cuda\n")
    done = run_doctor("--agent-config", str(config))
    assert done.returncode == 1
    assert row(done.stdout, "NVIDIA driver", "FAIL").startswith("not loaded")
    assert row(done.stdout, "register socket", "FAIL").startswith(
        f"{short_tmp / 'register.sock'} is missing: is the agent running"
    )
    assert "problem(s) block: fix them and run tslice doctor again" in done.stderr


def test_the_driver_and_host_memory_checks_read_what_the_kernel_says(
    tmp_path: pathlib.Path,
) -> None:
    version = tmp_path / "driver" / "nvidia" / "version"
    version.parent.mkdir(parents=True)
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug\n")
    old = doctor.driver(True, proc=tmp_path)
    assert (old.level, old.detail.split(":")[0]) == (doctor.Level.FAIL, "535.104.05")
    version.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15\n")
    assert doctor.driver(True, proc=tmp_path) == doctor.Check(
        "NVIDIA driver", doctor.Level.OK, "570.86.15"
    )
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   32768000 kB\n")
    assert doctor.host_memory(0, meminfo).level is doctor.Level.OK
    assert doctor.host_memory(80 * 1024**3, meminfo).level is doctor.Level.WARN
    meminfo.write_text("MemTotal:       65536000 kB\nMemAvailable:   512000 kB\n")
    assert doctor.host_memory(0, meminfo).level is doctor.Level.FAIL


def test_from_the_orchestrators_config_every_agent_is_asked(
    agent: tuple[pathlib.Path, str], tmp_path: pathlib.Path
) -> None:
    _, address = agent
    gone = f"127.0.0.1:{closed_port()}"
    topology = tmp_path / "topology.yaml"
    topology.write_text(
        "groups:\n"
        f"  a: {{nodes: [{{name: node-a, agent: '{address}'}}]}}\n"
        f"  b: {{nodes: [{{name: node-b, agent: '{gone}'}}]}}\n"
    )
    config = tmp_path / "orchestrator.yaml"
    config.write_text(f"topology_file: {topology}\n")
    done = run_doctor("--orchestrator-config", str(config))
    assert done.returncode == 1
    assert row(done.stdout, f"agent node-a ({address})", "ok") == "answers"
    assert "Connection refused" in row(done.stdout, f"agent node-b ({gone})", "FAIL")
