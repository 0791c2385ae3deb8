"""One real Slurm cluster per module, with an agent per node and ``tslice orchestrator
--slurm`` (Slurm identity on: the Prolog writes each job's credential), all started as the
other suites start their servers. Skipped only where Slurm and munge are not installed
(`.ci/run` installs them) or where the tests do not run as root (the daemons need it)."""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import yaml

from tests.harness.servers import Server
from tests.slurm.cluster import SlurmCluster, missing
from tslice.agent.backends import simdevice as device
from tslice.sim.cluster import SimAgent

GiB = 1024**3
#: The token of the tests' own clients: admin (reads, drains) and jobs named test-*.
TESTER_TOKEN = "tester-" + "0" * 32


def sim_node() -> SimAgent:
    """Two simulated GPUs (as the nodes' GRES) where two jobs' states never fit at once:
    every hand-over is a real snapshot and restore."""
    return SimAgent(
        name="",
        devices=2,
        capacity_bytes=80 * GiB,
        footprint_bytes=50 * GiB,
        bandwidth_bytes_per_s=200 * GiB,
        latency_s=0.01,
    )


class Stack:
    """The Slurm cluster, its agents and the orchestrator."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.slurm = SlurmCluster(root / "slurm")
        self.servers: list[Server] = []
        self.agents: dict[str, Server] = {}
        self.orchestrator: Server | None = None
        self.address = ""

    def start(self) -> None:
        self.root.joinpath("slurm").mkdir()
        ports: dict[str, int] = {}
        for node in self.slurm.nodes:
            agent = Server(
                "agent",
                ["--node-name", node, "--host", "127.0.0.1", "--port", "0",
                 "--metrics-port", "0", "--state-dir", str(self.root / node),
                 *sim_node().flags()],
                self.root / f"agent-{node}.log",
            )  # fmt: skip
            self.servers.append(agent)
            self.agents[node] = agent
        for node, agent in self.agents.items():
            agent.wait_ready()
            ports[node] = agent.port
        config = {
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": 0,
            "state_dir": str(self.root / "orchestrator"),
            "shutdown_grace_s": 1,
            "slurm": {
                "poll_s": 0.5,
                "groups": {"*": {}, "pair": {"nodes": ",".join(self.slurm.nodes)}},
                "agents": {node: f"127.0.0.1:{port}" for node, port in ports.items()},
            },
            "auth": {
                "verifier": "tslice.orchestrator.slurm.identity:verifier",
                "verifier_settings": {"key_file": str(self.slurm.key_file)},
                "tokens": [
                    {
                        "name": "tester",
                        "roles": ["admin", "job"],
                        "job_prefixes": ["test-"],
                        "sha256": hashlib.sha256(TESTER_TOKEN.encode()).hexdigest(),
                    }
                ],
            },
        }
        config_file = self.root / "orchestrator.yaml"
        config_file.write_text(yaml.safe_dump(config))
        # The key must exist before the orchestrator starts: the cluster writes it.
        self.slurm.start(job_env={})
        self.orchestrator = Server(
            "orchestrator",
            ["--slurm", "--config", str(config_file)],
            self.root / "orchestrator.log",
            env={"SLURM_CONF": str(self.slurm.conf)},
        )
        self.servers.append(self.orchestrator)
        self.address = self.orchestrator.wait_ready()
        # What the TaskProlog gives every job (a site's tslice-slurm.env).
        env_file = self.slurm.scripts / "tslice-slurm.env"
        env_file.write_text(env_file.read_text() + f"JOB_TSLICE_ORCHESTRATOR={self.address}\n")

    def mark(self) -> int:
        """Where the orchestrator's log is now (``logged(since=...)`` looks after it)."""
        assert self.orchestrator is not None
        return self.orchestrator.mark()

    def logged(self, pattern: str, *, since: int) -> str:
        """The first line of the orchestrator's log after ``since`` matching ``pattern``."""
        assert self.orchestrator is not None
        return self.orchestrator.wait_for(pattern, since=since).group(0)

    def journal(self) -> list[device.Event]:
        paths = [self.root / node / "sim-journal.jsonl" for node in self.slurm.nodes]
        events = [e for p in paths if p.exists() for e in device.read_journal(p)]
        return sorted(events, key=lambda e: e.t)

    def orchestrator_logs(self) -> str:
        assert self.orchestrator is not None
        return self.orchestrator.logs()

    def logs(self) -> str:
        servers = "\n".join(f"----- {s.log_path.name} -----\n{s.logs()}" for s in self.servers)
        return f"{servers}\n{self.slurm.logs()}"

    def stop(self) -> None:
        self.slurm.stop()
        for server in self.servers:
            server.terminate()
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    absent = missing()
    if absent:
        pytest.fail(
            f"Slurm is not installed here ({', '.join(absent)}): `make test` installs it "
            "(scripts/test_tools.sh)"
        )
    if os.geteuid() != 0:
        pytest.skip("a test Slurm cluster runs its daemons as root")
    # Short: Unix socket paths (munge's, the agents') are limited to 107 bytes.
    root = pathlib.Path(tempfile.mkdtemp(prefix="tslice-slurm-"))
    root.chmod(0o755)
    started = Stack(root)
    try:
        started.start()
        yield started
    except BaseException:
        print(started.logs())
        raise
    finally:
        started.stop()
        shutil.rmtree(root, ignore_errors=True)
