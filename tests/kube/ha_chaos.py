"""HA mode's chaos run (issue 22, acceptance): the chaos run of ``tslice.chaos.runner`` against
two orchestrator replicas (``--kubernetes --ha``) and three simulated agents, all real
processes, with the API-server emulator as the cluster.

Job processes (each with a pod in the emulator, Running while the process lives,
Succeeded or Failed once it exits) take one or two random groups at a time with a holder
lease, following the leader across both replicas' addresses. At random moments drawn
from the seed the run:

- SIGKILLs the leader, or a follower, and starts it again on its port;
- SIGSTOPs the leader, or a follower, for longer than the Lease (the leader is replaced;
  woken, it finds itself fenced), then SIGCONTs it;
- deletes the Lease, or a group's state ConfigMap, as an operator might;
- SIGKILLs a job while it holds a group.

The verdict is the chaos run's: the device journals of every agent against the windows
the jobs saw (no violation), every live job completed (no lost queued job), every group
acquired at the end. ``bench/soak_kubernetes.py`` runs the long form; the short form is
``tests/kube/test_ha_chaos.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import signal
import socket
import tempfile
from collections.abc import Sequence
from typing import Any

from tests.harness.servers import Server
from tests.kube import apistore, objects
from tests.kube.emulator import ApiServerEmulator
from tests.kube.ha_stack import LEASE, NAMESPACE
from tslice.agent.backends import simdevice as device
from tslice.chaos import runner
from tslice.sim.cluster import SimAgent

REPLICAS = ("orch-a", "orch-b")
LEADER_KILL, FOLLOWER_KILL = "leader killed", "follower killed"
LEADER_STOP, FOLLOWER_STOP = "leader stopped", "follower stopped"
LEASE_DELETED, STATE_DELETED = "Lease deleted", "state ConfigMap deleted"
KINDS = (
    LEADER_KILL,
    FOLLOWER_KILL,
    LEADER_STOP,
    FOLLOWER_STOP,
    LEASE_DELETED,
    STATE_DELETED,
    runner.HOLDER_KILL,
)
_STATE = apistore.label_selector("timeslice.io/orchestrator-state=group")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HaServers:
    """The replicas and the agents of a chaos run (:class:`tslice.chaos.runner.Servers`)."""

    def __init__(
        self,
        api: ApiServerEmulator,
        base_dir: pathlib.Path,
        agents: Sequence[SimAgent],
        *,
        lease_duration_s: int = 2,
    ) -> None:
        """(The servers log at info: the run waits on their log lines.)"""
        self.api = api
        self.base_dir = base_dir
        self.lease_duration_s = lease_duration_s
        self._agents = list(agents)
        # Unix socket paths (the agents' register sockets) must be short.
        self._short = pathlib.Path(tempfile.mkdtemp(prefix="tslice-hachaos-"))
        self._args: dict[str, list[str]] = {}
        self._ports = {name: _free_port() for name in REPLICAS}
        self.servers: dict[str, Server] = {}
        self._restarts = 0

    @property
    def orchestrator_address(self) -> str:
        return ",".join(f"127.0.0.1:{self._ports[name]}" for name in REPLICAS)

    def start(self) -> HaServers:
        """Everything up; on a failure what was started is stopped (the run's own cleanup
        comes only after a start that succeeded)."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> HaServers:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        for agent in self._agents:
            groups = [g for g, nodes in runner.TOPOLOGY.items() if agent.name in nodes]
            self.api.apply(objects.node(agent.name, *groups))
            self._args[agent.name] = [
                "agent", "--node-name", agent.name, "--host", "127.0.0.1", "--port", "0",
                "--metrics-port", "0", "--state-dir", str(self.state_dir(agent.name)),
                *agent.flags(),
            ]  # fmt: skip
            self._launch(agent.name)
        for agent in self._agents:
            server = self.servers[agent.name]
            server.wait_ready()
            self.api.apply(objects.agent_pod(agent.name, "127.0.0.1", server.port))
        for name in REPLICAS:
            kubeconfig = self.api.write_kubeconfig(self.base_dir / f"kubeconfig-{name}", user=name)
            self._args[name] = [
                "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig),
                "--ha", "--identity", name, "--lease-namespace", NAMESPACE,
                "--lease-duration", str(self.lease_duration_s), "--renew-interval", "0.1",
                "--host", "127.0.0.1", "--port", str(self._ports[name]), "--metrics-port", "0",
                "--state-dir", str(self.base_dir / name), "--shutdown-grace", "1",
                "--operation-timeout", "60", "--reattach-grace", "30",
            ]  # fmt: skip
            self._launch(name)
        for name in REPLICAS:
            self.servers[name].wait_ready()
        return self

    def _launch(self, name: str) -> None:
        log = self.base_dir / f"{name}.{self._restarts}.log"
        self._restarts += 1
        self.servers[name] = Server(self._args[name][0], self._args[name][1:], log)

    def leader(self) -> str:
        """The Lease's holder now ("" if none)."""
        try:
            lease = self.api.store.get("leases", NAMESPACE, LEASE)
        except apistore.ApiFailure:
            return ""
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    def kill(self, name: str) -> None:
        self.servers[name].kill()  # a stopped (SIGSTOP) process dies as well

    def restart(self, name: str) -> None:
        self.kill(name)
        self._launch(name)
        self.servers[name].wait_ready()

    def signal(self, name: str, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.servers[name].proc.send_signal(sig)

    def delete_lease(self) -> None:
        with contextlib.suppress(apistore.ApiFailure):
            self.api.store.delete("leases", NAMESPACE, LEASE)

    def state_configmaps(self) -> list[str]:
        _, found = self.api.store.list("configmaps", NAMESPACE, _STATE)
        return sorted(str(cm["metadata"]["name"]) for cm in found)

    def delete_state(self, name: str) -> None:
        with contextlib.suppress(apistore.ApiFailure):
            self.api.store.delete("configmaps", NAMESPACE, name)

    def state_dir(self, name: str) -> pathlib.Path:
        return self._short / name

    def read_journals(self) -> list[device.Event]:
        paths = [self.state_dir(a.name) / device.JOURNAL_FILE for a in self._agents]
        return sorted((e for p in paths for e in device.read_journal(p)), key=lambda e: e.t)

    def stop(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(ProcessLookupError):
                server.proc.send_signal(signal.SIGCONT)
            server.terminate()
        for server in self.servers.values():
            server.stop()
        shutil.rmtree(self._short, ignore_errors=True)


class HaChaosRun(runner.ChaosRun):
    """A chaos run whose disruptions are HA mode's (see the module docstring)."""

    kinds = KINDS
    first_kinds = KINDS

    def __init__(self, config: runner.ChaosConfig, api: ApiServerEmulator, base_dir: pathlib.Path):
        self.api = api
        self.ha = HaServers(
            api,
            base_dir,
            [self.sim_agent(name, i) for i, name in enumerate(runner.NODES)],
        )
        super().__init__(config, servers=self.ha)

    def sim_agent(self, name: str, index: int) -> SimAgent:
        # Before super().__init__: only the config is needed (set here for it).
        return SimAgent(
            name=name,
            capacity_bytes=80 * runner.GiB,
            footprint_bytes=30 * runner.GiB,
            bandwidth_bytes_per_s=1000 * 10**9,
            latency_s=0.005,
        )

    async def _spawn(self, job_id: str) -> Any:
        job = await super()._spawn(job_id)
        self.api.apply(objects.job_pod(f"{job.job_id}-0", job.job_id, "g1"))
        return job

    async def _ended(self, job: Any) -> None:
        phase = "Failed" if job.killed_at is not None else "Succeeded"
        self.api.apply(objects.job_pod(f"{job.job_id}-0", job.job_id, "g1", phase=phase))

    async def _disrupt(self, kind: str) -> None:
        ha, rng = self.ha, self.rng
        leader = ha.leader()
        others = [r for r in REPLICAS if r != leader]
        target = leader if kind in (LEADER_KILL, LEADER_STOP) and leader else rng.choice(others)
        if kind in (LEADER_KILL, FOLLOWER_KILL):
            await asyncio.to_thread(ha.kill, target)
            await asyncio.sleep(rng.uniform(*self.config.down_s))
            await asyncio.to_thread(ha.restart, target)
        elif kind in (LEADER_STOP, FOLLOWER_STOP):
            ha.signal(target, signal.SIGSTOP)
            # Longer than the Lease: a stopped leader is replaced before it wakes.
            await asyncio.sleep(ha.lease_duration_s + rng.uniform(0.2, 1.0))
            ha.signal(target, signal.SIGCONT)
        elif kind == LEASE_DELETED:
            ha.delete_lease()
        elif kind == STATE_DELETED:
            names = ha.state_configmaps()
            if names:
                ha.delete_state(rng.choice(names))
        else:
            await super()._disrupt(kind)


async def run(
    config: runner.ChaosConfig, api: ApiServerEmulator, base_dir: pathlib.Path
) -> runner.ChaosResult:
    return await HaChaosRun(config, api, base_dir).run()
