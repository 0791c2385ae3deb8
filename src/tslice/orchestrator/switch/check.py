"""Is every agent of the topology reachable, and does its TLS match ``agent_client``?

The orchestrator asks each agent once at start (and ``tslice doctor --orchestrator-config``
does the same from its config): an agent that does not answer is one warning line naming
the node, the address and the fix, instead of a group that stays UNKNOWN with "Socket
closed". Where gRPC's message leaves TLS in doubt (a server that closes the connection at
once), a TLS handshake with the agent's port settles it: it serves TLS or it does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
from collections.abc import Iterable

from tslice.orchestrator import config
from tslice.orchestrator.switch import pool as agents
from tslice.security import tls

log = logging.getLogger(__name__)

#: How long one agent may take to answer the check, seconds.
CHECK_TIMEOUT_S = 3.0


@dataclasses.dataclass(frozen=True)
class Finding:
    """One agent's answer to the check."""

    node: str
    address: str
    #: "" when it answered.
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem


async def serves_tls(address: str, timeout_s: float = CHECK_TIMEOUT_S) -> bool | None:
    """Whether the server at ``host:port`` completes a TLS handshake (None: no answer, or
    a Unix socket)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or address.startswith("unix"):
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port), ssl=context), timeout_s
        )
    except ssl.SSLError:
        return False
    except (OSError, asyncio.TimeoutError):
        return None
    writer.close()
    return True


def _settled(hint: str, served: bool | None, security: tls.ClientSecurity) -> str:
    """The hint, certain where the handshake told whether the agent serves TLS."""
    if served is True and security.tls is None:
        return (
            "TLS mismatch: the agent serves TLS and the orchestrator connects in plaintext: "
            "give agent_client its ca (and cert/key if it requires client certificates)"
        )
    if served is True and security.tls is not None and security.tls.cert is None:
        return (
            "TLS mismatch: the agent serves TLS and closed the connection: it requires a "
            "client certificate; give agent_client cert and key"
        )
    if served is False and "socket closed" in hint.lower():
        return "the agent closed the connection; it does not serve TLS (check its logs)"
    return hint


async def check(
    nodes: Iterable[config.NodeRef],
    pool: agents.AgentPool,
    security: tls.ClientSecurity,
    *,
    timeout_s: float = CHECK_TIMEOUT_S,
) -> list[Finding]:
    """Ask every distinct agent once (side by side); a finding per agent, by node name."""
    unique = {n.address: n for n in nodes}
    replies = await asyncio.gather(
        *(pool.get(address).status(timeout_s=timeout_s) for address in unique),
        return_exceptions=True,
    )
    findings = []
    for (address, node), reply in zip(unique.items(), replies, strict=True):
        if not isinstance(reply, BaseException):
            findings.append(Finding(node.name, address))
            continue
        detail = getattr(reply, "detail", "") or str(reply)
        if "TLS mismatch?" in detail:
            guess = detail[detail.index("TLS mismatch?") :].rstrip("]")
            detail = detail.replace(
                guess, _settled(guess, await serves_tls(address, timeout_s), security)
            )
        findings.append(Finding(node.name, address, detail))
    return sorted(findings, key=lambda f: f.node)


async def warn_at_start(cfg: config.OrchestratorConfig, pool: agents.AgentPool) -> None:
    """One warning per agent of the topology that does not answer (or one info line)."""
    topo = cfg.topology
    nodes = [*topo.local_nodes, *(n for ns in topo.groups.values() for n in ns)]
    if not nodes:
        return
    findings = await check(nodes, pool, cfg.agent_client)
    bad = [f for f in findings if not f.ok]
    for finding in bad:
        log.warning(
            "agent of node %s at %s does not answer: %s",
            finding.node,
            finding.address,
            finding.problem,
            extra={"node": finding.node, "address": finding.address},
        )
    if not bad:
        log.info("all %d agent(s) of the topology answer", len(findings))
