"""Certificates made by ``tslice certs``'s own code, and real servers started with them.

The servers run as ``python -m tslice orchestrator|agent`` on loopback (tests.harness.servers:
ready once each has written its ready file); the CA and certificates are made once per session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import pathlib
import tempfile
from collections.abc import Iterator, Sequence

import pytest

from tests.harness.ports import closed_port
from tests.harness.servers import Server
from tslice.security import certs as pki
from tslice.security import tls

#: The client identities every test may use.
IDENTITIES = ("orchestrator", "admin", "job:job-a", "job:job-b")


@dataclasses.dataclass(frozen=True)
class Certs:
    """A development CA, a server certificate and one client certificate per identity."""

    directory: pathlib.Path
    ca: pki.Pair
    server: pki.Pair

    def client(self, identity: str) -> pki.Pair:
        stem = pki.file_stem(identity)
        return pki.Pair(self.directory / f"{stem}.pem", self.directory / f"{stem}.key")

    def env(self, identity: str | None) -> dict[str, str]:
        """The job-side variables: this CA, and ``identity``'s certificate if given."""
        env = {"TSLICE_TLS_CA": str(self.ca.cert)}
        if identity is not None:
            pair = self.client(identity)
            env.update(TSLICE_TLS_CERT=str(pair.cert), TSLICE_TLS_KEY=str(pair.key))
        return env


def make_certs(directory: pathlib.Path, identities: Sequence[str] = IDENTITIES) -> Certs:
    ca = pki.make_ca(directory)
    server = pki.make_server(ca, pki.Pair(directory / "server.pem", directory / "server.key"))
    made = Certs(directory, ca, server)
    for identity in identities:
        pki.make_client(ca, made.client(identity), identity=identity)
    return made


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="session")
def rogue_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """Another CA's certificates: the same names, not trusted by the servers."""
    return make_certs(tmp_path_factory.mktemp("rogue"))


def tls_args(certs: Certs, *, mutual: bool) -> list[str]:
    args = ["--tls-cert", str(certs.server.cert), "--tls-key", str(certs.server.key)]
    return [*args, "--tls-client-ca", str(certs.ca.cert)] if mutual else args


def agent_args(state: pathlib.Path, *extra: str) -> list[str]:
    return [
        "--node-name", "node-a",
        "--host", "127.0.0.1",
        "--port", "0",
        "--state-dir", str(state / "agent"),
        "--register-socket", str(state / "r.sock"),
        "--backend", "sim",
        "--sim-bandwidth", "1TB/s",
        "--sim-latency", "0",
        *extra,
    ]  # fmt: skip


def orchestrator_args(state: pathlib.Path, agent: str, *extra: str) -> list[str]:
    return [
        "--local-agent", f"node-a={agent}",
        "--host", "127.0.0.1",
        "--port", "0",
        "--metrics-port", "0",
        "--state-dir", str(state / "orch"),
        "--shutdown-grace", "1",
        *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def serving(kind: str, args: Sequence[str], log: pathlib.Path) -> Iterator[Server]:
    with serving_all([(kind, args, log)]) as (server,):
        yield server


@contextlib.contextmanager
def serving_all(
    servers: Sequence[tuple[str, Sequence[str], pathlib.Path]],
) -> Iterator[list[Server]]:
    """Start every server at once (two cores: starting in turn doubles the wait)."""
    started: list[Server] = []
    try:
        for kind, args, log in servers:
            started.append(Server(kind, args, log))
        for server in started:
            server.wait_ready()
        yield started
    finally:
        for server in reversed(started):
            server.stop()


#: Tokens the servers of :func:`secure_stack` know (by their SHA-256 or a file).
JOB_A_TOKEN = "job-a-token-0123456789"
READER_TOKEN = "reader-token-0123456789"


@dataclasses.dataclass(frozen=True)
class SecureStack:
    """An agent and an orchestrator serving mutual TLS with authentication on."""

    orchestrator: str
    #: The agent's TCP port (mutual TLS) and its Unix socket (plaintext, local callers).
    agent: str
    agent_unix: str
    certs: Certs

    def security(self, identity: str | None, *, token: str | None = None) -> tls.ClientSecurity:
        """A client's TLS (``identity``'s certificate, if any) and token, as the job side has it."""
        env = self.certs.env(identity)
        if token is not None:
            env["TSLICE_TOKEN"] = token
        return tls.ClientSecurity.from_env(env)


def _tokens_file(directory: pathlib.Path) -> pathlib.Path:
    reader = directory / "reader.token"
    reader.write_text(READER_TOKEN + "\n")
    digest = hashlib.sha256(JOB_A_TOKEN.encode()).hexdigest()
    path = directory / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        f"  - {{name: job-a, roles: [job], jobs: [job-a], sha256: {digest}}}\n"
        f"  - {{name: reader, roles: [], token_file: {reader}}}\n"
    )
    return path


@pytest.fixture(scope="session")
def secure_stack(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    """Both servers with mutual TLS and ``auth:``; the orchestrator calls the agent with its
    own client certificate (identity ``orchestrator``)."""
    state = tmp_path_factory.mktemp("secure")
    tokens = _tokens_file(state)
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="tslice-sec-"))  # short Unix socket paths
    agent_config = state / "agent.yaml"
    agent_config.write_text(f"auth: {{tokens_file: {tokens}}}\n")
    port = closed_port()  # chosen first, so that both servers start at once
    agent = agent_args(
        state,
        "--config", str(agent_config),
        "--unix-socket", str(sockets / "agent.sock"),
        *tls_args(certs, mutual=True),
    )  # fmt: skip
    agent[agent.index("--port") + 1] = str(port)
    me = certs.client("orchestrator")
    orch_config = state / "orchestrator.yaml"
    orch_config.write_text(
        f"agent_client: {{ca: {certs.ca.cert}, cert: {me.cert}, key: {me.key}}}\n"
        f"auth: {{tokens_file: {tokens}}}\n"
    )
    orch = orchestrator_args(
        state, f"127.0.0.1:{port}", "--config", str(orch_config), *tls_args(certs, mutual=True)
    )
    servers = [("agent", agent, state / "agent.log"), ("orchestrator", orch, state / "orch.log")]
    with serving_all(servers) as (agent_server, orch_server):
        yield SecureStack(
            orchestrator=orch_server.address,
            agent=agent_server.address,
            agent_unix=f"unix:{sockets / 'agent.sock'}",
            certs=certs,
        )
