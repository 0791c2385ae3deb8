"""Certificates made by ``tslice certs``'s own code, and real servers started with them.

The servers run as ``python -m tslice orchestrator|agent`` on loopback (readiness is
their "serving on" line: no sleeps); the CA and certificates are made once per session.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import pytest

from tests.integration.test_hostile_agent import Server
from tslice.cli import certs_cmd

#: The client identities every test may use.
IDENTITIES = ("orchestrator", "admin", "job:job-a", "job:job-b")


@dataclasses.dataclass(frozen=True)
class Certs:
    """A development CA, a server certificate and one client certificate per identity."""

    directory: pathlib.Path
    ca: certs_cmd.Pair
    server: certs_cmd.Pair

    def client(self, identity: str) -> certs_cmd.Pair:
        stem = certs_cmd.file_stem(identity)
        return certs_cmd.Pair(self.directory / f"{stem}.pem", self.directory / f"{stem}.key")

    def env(self, identity: str | None) -> dict[str, str]:
        """The job-side variables: this CA, and ``identity``'s certificate if given."""
        env = {"TSLICE_TLS_CA": str(self.ca.cert)}
        if identity is not None:
            pair = self.client(identity)
            env.update(TSLICE_TLS_CERT=str(pair.cert), TSLICE_TLS_KEY=str(pair.key))
        return env


def make_certs(directory: pathlib.Path, identities: Sequence[str] = IDENTITIES) -> Certs:
    ca = certs_cmd.make_ca(directory)
    server = certs_cmd.make_server(
        ca, certs_cmd.Pair(directory / "server.pem", directory / "server.key")
    )
    made = Certs(directory, ca, server)
    for identity in identities:
        certs_cmd.make_client(ca, made.client(identity), identity=identity)
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
            server.wait_serving()
        yield started
    finally:
        for server in reversed(started):
            server.stop()
