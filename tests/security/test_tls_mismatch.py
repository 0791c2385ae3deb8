"""An agent the orchestrator cannot reach is one warning at start, per agent, naming the
node, the address and the fix; where TLS does not match ``agent_client`` the warning and
the group's status say so (they said "Socket closed"). Real agents and orchestrators, one
agent serving mutual TLS, one plaintext, one address where nothing listens."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.harness.ports import closed_port
from tests.harness.servers import Server
from tests.security.conftest import Certs, tls_args
from tslice.client import AsyncClient, GroupState
from tslice.common import errors
from tslice.security import tls


def start(name: str, args: list[str], tmp: pathlib.Path) -> Server:
    return Server(args[0], args[1:], tmp / f"{name}.log")


@pytest.fixture
def agents(certs: Certs, tmp_path: pathlib.Path) -> Iterator[dict[str, str]]:
    """node-a serving mutual TLS, node-b plaintext, node-c nowhere: their addresses."""
    common = ["--host", "127.0.0.1", "--port", "0", "--backend", "noop"]
    a = ["agent", "--node-name", "node-a", *common, "--state-dir", str(tmp_path / "a")]
    b = ["agent", "--node-name", "node-b", *common, "--state-dir", str(tmp_path / "b")]
    servers = {
        "node-a": start("node-a", [*a, *tls_args(certs, mutual=True)], tmp_path),
        "node-b": start("node-b", b, tmp_path),
    }
    try:
        found = {node: server.wait_ready() for node, server in servers.items()}
        yield {**found, "node-c": f"127.0.0.1:{closed_port()}"}
    finally:
        for server in servers.values():
            server.stop()


def orchestrator(
    tmp_path: pathlib.Path, name: str, agents: dict[str, str], agent_client: str
) -> Server:
    topology = tmp_path / f"{name}-topology.yaml"
    topology.write_text(
        "groups:\n"
        + "".join(f"  g-{n}: {{nodes: [{{name: {n}, agent: '{a}'}}]}}\n" for n, a in agents.items())
    )
    config = tmp_path / f"{name}.yaml"
    config.write_text(f"agent_client: {agent_client}\n")
    return start(
        name,
        ["orchestrator", "--config", str(config), "--topology", str(topology),
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--state-dir", str(tmp_path / name), "--shutdown-grace", "0"],
        tmp_path,
    )  # fmt: skip


async def test_a_plaintext_orchestrator_warns_per_agent_and_its_status_says_tls(
    agents: dict[str, str], tmp_path: pathlib.Path
) -> None:
    orch = orchestrator(tmp_path, "plain", agents, "{}")
    try:
        address = orch.wait_ready()
        orch.wait_for(
            r"agent of node node-a at \S+ does not answer: .*TLS mismatch: the agent serves "
            r"TLS and the orchestrator connects in plaintext: give agent_client its ca"
        )
        orch.wait_for(r"agent of node node-c at \S+ does not answer: .*Connection refused")
        assert "agent of node node-b" not in orch.logs()
        async with AsyncClient(address, job_id="j", lease_s=None) as client:
            status = await client.status("g-node-a")
            assert status.group_state is GroupState.UNKNOWN
            assert "TLS mismatch? the server closed the connection at once" in status.detail
    finally:
        orch.stop()


async def test_a_tls_orchestrator_is_told_which_side_lacks_what(
    certs: Certs, agents: dict[str, str], tmp_path: pathlib.Path
) -> None:
    orch = orchestrator(tmp_path, "tls", agents, f"{{ca: {certs.ca.cert}}}")  # no client cert
    try:
        orch.wait_ready()
        orch.wait_for(
            r"agent of node node-a at \S+ does not answer: .*TLS mismatch: the agent serves TLS "
            r"and closed the connection: it requires a client certificate; give agent_client "
            r"cert and key"
        )
        orch.wait_for(
            r"agent of node node-b at \S+ does not answer: .*TLS mismatch: the server does not "
            r"serve TLS, but agent_client connects with TLS"
        )
    finally:
        orch.stop()


async def test_a_job_whose_tls_does_not_match_the_orchestrators_is_told_so(
    certs: Certs, rogue_certs: Certs, tmp_path: pathlib.Path
) -> None:
    orch = start(
        "orch",
        ["orchestrator", "--local-agent", f"node-a=127.0.0.1:{closed_port()}",
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
         "--state-dir", str(tmp_path / "orch"), *tls_args(certs, mutual=False)],
        tmp_path,
    )  # fmt: skip
    try:
        address = orch.wait_ready()
        plain = AsyncClient(address, job_id="j", lease_s=None, connect_timeout=3)
        async with plain:
            with pytest.raises(errors.Unavailable, match=r"TLS mismatch\? the server closed"):
                await plain.list_groups()
        rogue = tls.ClientSecurity.from_env(rogue_certs.env(None))
        untrusting = AsyncClient(
            address, job_id="j", lease_s=None, connect_timeout=3, security=rogue
        )
        async with untrusting:
            with pytest.raises(errors.Unavailable, match="TLS mismatch: the server's certificate"):
                await untrusting.list_groups()
    finally:
        orch.stop()
