"""HA mode's processes for the tests: agents with their pods, and orchestrator replicas
(``tslice orchestrator --kubernetes --ha``) against the API-server emulator.

Leases are short here (2 s, renewed every 0.1 s: a loaded machine's slow renewals still
leave the leader its 1.3 s renew deadline): a follower takes over a dead leader within
about two seconds. Every wait is on a server's log line or on a reply, never a sleep.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from tests.harness.servers import WAIT_S, Server
from tests.kube import objects, stack
from tests.kube.apistore import ApiFailure
from tests.kube.emulator import ApiServerEmulator

NAMESPACE = "timeslice-system"
LEASE = "tslice-orchestrator"


class HaStack(stack.Cluster):
    def __init__(self, api: ApiServerEmulator, tmp_path: pathlib.Path, short: pathlib.Path):
        super().__init__(api, tmp_path, short)
        self.replicas: dict[str, Server] = {}
        self.addresses: dict[str, str] = {}

    def start_ha(
        self,
        nodes: dict[str, list[str]],
        replicas: Sequence[str],
        *,
        lease_duration_s: int = 2,
        shutdown_grace_s: float = 1.0,
    ) -> str:
        """An agent per node and the ``replicas``, all started at once; the replica that
        took the Lease, once it leads."""
        agents = self.launch_agents(nodes)
        for name in replicas:
            kubeconfig = self.api.write_kubeconfig(self.tmp_path / f"kubeconfig-{name}", user=name)
            self.replicas[name] = self.launch(name, [
                "orchestrator", "--kubernetes", "--kubeconfig", str(kubeconfig),
                "--ha", "--identity", name, "--lease-namespace", NAMESPACE,
                "--lease-duration", str(lease_duration_s), "--renew-interval", "0.1",
                "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                "--state-dir", str(self.tmp_path / name),
                "--shutdown-grace", str(shutdown_grace_s),
            ])  # fmt: skip
        self.register(agents)
        for name, server in self.replicas.items():
            self.addresses[name] = server.wait_ready()
        leader = self.holder()
        self.leads(leader, 1)
        return leader

    def start_trainers(
        self, jobs: Sequence[str], nodes: Sequence[str], *, lease_duration_s: int = 2
    ) -> tuple[str, str]:
        """``jobs``' pods in group trainer, on ``nodes`` with exclusive simulated devices,
        and replicas orch-a and orch-b: the leader and the follower, once it leads."""
        for job in jobs:
            self.api.apply(objects.job_pod(f"{job}-trainer-0", job, "trainer"))
        for node in nodes:
            self.api.apply(objects.node(node, "trainer"))
        sim = stack.exclusive_sim()
        leader = self.start_ha(
            {node: sim.flags() for node in nodes},
            ["orch-a", "orch-b"],
            lease_duration_s=lease_duration_s,
        )
        return leader, self.follower(leader)

    def holder(self, *, other_than: str = "") -> str:
        """Until the Lease has a holder (other than ``other_than``): its name."""
        store = self.api.store

        def held() -> str:
            try:
                lease = store.get("leases", NAMESPACE, LEASE)
            except ApiFailure:
                return ""
            holder = str(lease.get("spec", {}).get("holderIdentity") or "")
            return holder if holder != other_than else ""

        with store.changed:
            if not store.changed.wait_for(held, WAIT_S):
                raise AssertionError(f"nobody took Lease {LEASE}:\n{self.logs()}")
        return held()

    def follower(self, leader: str) -> str:
        (other,) = (name for name in self.replicas if name != leader)
        return other

    def leads(self, name: str, term: int) -> None:
        """Until replica ``name`` logs that it leads in ``term``."""
        self.replicas[name].wait_for(rf"leading as {name} \(leader term {term},")

    def kill(self, name: str) -> None:
        self.replicas[name].kill()
