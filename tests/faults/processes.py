"""Real server processes for the fault tests: agents (one optionally in its own network
namespace) and an orchestrator over a topology of their groups.

``tslice.sim.cluster.LocalCluster`` is the shipped double, but it can put neither an agent
behind a network link the test can cut nor a group on a subset of a node's devices, which
these tests need (groups on one agent that never contend, so that one process stack serves
every case). tests.harness.servers starts each server (ready once it wrote its ready file).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from tests.harness.servers import Server


class Netns:
    """A network namespace joined to the host by a veth pair (host 10.231.N.1, inside .2).

    :meth:`cut` takes the inside end down: packets on established connections are dropped
    silently and new connections fail once ARP gives up, as across a real partition; it
    is not a process signal, so the agent inside keeps running and finishes its work.
    """

    def __init__(self, tag: int) -> None:
        self.name = f"tsf-{tag}"
        self.host_if, self.inner_if = f"tsfh{tag}", f"tsfa{tag}"
        self.host_ip, self.inner_ip = f"10.231.{tag % 250}.1", f"10.231.{tag % 250}.2"

    @staticmethod
    def usable() -> str:
        """ "" when namespaces can be made here, else why not."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        probe = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True)
        return "" if probe.returncode == 0 else f"`ip netns` fails: {probe.stderr.strip()}"

    def create(self) -> None:
        self.delete()
        for command in (
            f"ip netns add {self.name}",
            f"ip link add {self.host_if} type veth peer name {self.inner_if}",
            f"ip link set {self.inner_if} netns {self.name}",
            f"ip addr add {self.host_ip}/30 dev {self.host_if}",
            f"ip link set {self.host_if} up",
            f"ip -n {self.name} addr add {self.inner_ip}/30 dev {self.inner_if}",
            f"ip -n {self.name} link set {self.inner_if} up",
            f"ip -n {self.name} link set lo up",
        ):
            subprocess.run(command.split(), check=True, capture_output=True)

    def cut(self) -> None:
        self._link("down")

    def heal(self) -> None:
        self._link("up")

    def _link(self, updown: str) -> None:
        command = ["ip", "-n", self.name, "link", "set", self.inner_if, updown]
        subprocess.run(command, check=True, capture_output=True)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], check=False, capture_output=True)


@dataclasses.dataclass
class Process:
    """One ``python -m tslice KIND`` server (tests.harness.servers), restartable on its
    port and state directory."""

    name: str
    kind: str
    args: list[str]
    base: Path
    host: str = "127.0.0.1"
    prefix: list[str] = dataclasses.field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.server = Server(self.kind, [], self.log_path, prefix=self.prefix, start=False)

    @property
    def state_dir(self) -> Path:
        return self.base / self.name

    @property
    def log_path(self) -> Path:
        return self.base / f"{self.name}.log"

    @property
    def ready_file(self) -> Path:
        return self.server.ready_file

    @property
    def address(self) -> str:
        return self.server.address

    def spawn(self, *extra: str) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.server.args = [
            *self.args, *extra,
            "--host", self.host, "--port", str(self.port), "--state-dir", str(self.state_dir),
            "--metrics-port", "0", "--log-level", "info",
        ]  # fmt: skip
        self.server.start()

    def wait_ready(self) -> str:
        address = self.server.wait_ready()
        self.port = self.server.port
        return address

    def signal(self, signum: int) -> None:
        self.server.signal(signum)

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        self.server.kill()

    def restart(self) -> str:
        self.kill()
        self.spawn()
        return self.wait_ready()

    def restart_as(self, *extra: str) -> str:
        """Restart on the same port and state with ``extra`` flags after its own (the
        last of a repeated flag wins), for this start only."""
        self.kill()
        self.spawn(*extra)
        return self.wait_ready()

    def make_whole(self) -> bool:
        """Running and not stopped again (restarted if it died); True if it had to be."""
        if self.server.running:
            self.server.thaw()
            return False
        self.restart()
        return True

    def stop(self) -> None:
        self.server.stop()

    def logs(self, last: int | None = None) -> str:
        """The server's log (its ``last`` lines only, if given)."""
        lines = self.server.logs().splitlines()
        return "\n".join([f"----- {self.name} -----", *lines[-(last or 0) :]])


#: A group's nodes: node name -> the device indices it uses there (None: all).
GroupNodes = Mapping[str, Sequence[int] | None]


class Stack:
    """Agents, then an orchestrator whose topology gives each group its nodes (and devices)."""

    def __init__(
        self,
        base: Path,
        agents: Mapping[str, Sequence[str]],
        groups: Mapping[str, GroupNodes],
        *,
        orchestrator_settings: Mapping[str, object],
        netns: Mapping[str, Netns] = {},
    ) -> None:
        self.base = base
        self.groups = groups
        self.netns = dict(netns)
        self.agents: dict[str, Process] = {}
        for name, flags in agents.items():
            ns = netns.get(name)
            self.agents[name] = Process(
                name, "agent", ["--node-name", name, *flags, *(["--insecure"] if ns else [])],
                base, host=ns.inner_ip if ns else "127.0.0.1", prefix=ns.prefix() if ns else [],
            )  # fmt: skip
        config = base / "orchestrator.yaml"
        config.write_text(yaml.safe_dump(dict(orchestrator_settings)))
        topology = ["--topology", str(base / "topology.yaml")]
        self.orchestrator = Process(
            "orchestrator", "orchestrator", ["--config", str(config), *topology], base
        )

    def start(self) -> Stack:
        try:
            for agent in self.agents.values():
                agent.spawn()
            addresses = {name: agent.wait_ready() for name, agent in self.agents.items()}
            topology = {
                "groups": {
                    group: {"nodes": [_node(n, addresses[n], d) for n, d in nodes.items()]}
                    for group, nodes in self.groups.items()
                }
            }
            (self.base / "topology.yaml").write_text(yaml.safe_dump(topology))
            self.orchestrator.spawn()
            self.orchestrator.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def make_whole(self) -> list[str]:
        """Every link up and every server running (agents before the orchestrator), so
        that a test which failed before it brought back what it broke fails alone; the
        names of the servers that had to be restarted."""
        for netns in self.netns.values():
            netns.heal()
        return [p.name for p in (*self.agents.values(), self.orchestrator) if p.make_whole()]

    def stop(self) -> None:
        for process in (self.orchestrator, *self.agents.values()):
            process.stop()

    def logs(self, last: int | None = None) -> str:
        return "\n".join(p.logs(last) for p in (self.orchestrator, *self.agents.values()))


def _node(name: str, address: str, devices: Sequence[int] | None) -> dict[str, object]:
    node: dict[str, object] = {"name": name, "agent": address}
    if devices is not None:
        node["devices"] = list(devices)
    return node
