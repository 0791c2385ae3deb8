"""A real orchestrator and node agent as subprocesses on loopback, for the job-side tests.

The job-side tests run in venvs that hold only the job-side install (oldest or newest
grpcio/protobuf, no extras), so the servers cannot run in the test's interpreter: they
run from ``$TSLICE_SERVER_PYTHON`` (a venv with ``tslice[server]``), by default the
test's own interpreter. This module imports nothing of tslice, only the standard library
(and tests.harness.servers, which starts the servers and is standard library only).

A server is ready once it wrote its ready file; its output goes to a log file in the
state directory, and the logs are shown when a test fails (``running_stack`` on an
exception, the ``stack`` fixture on a failed test) or when a server does not come up.

With ``tls=`` (certificates from :func:`make_certs`, which runs ``tslice certs`` in the
server Python: the job-side venvs have no ``cryptography``) both servers serve mutual TLS
on TCP; with ``tokens=`` they also have ``auth:`` on (the orchestrator proves its role to
the agent, over the agent's plaintext Unix socket, with a token of its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence

from tests.harness.servers import Server

SERVER_PYTHON_ENV = "TSLICE_SERVER_PYTHON"
NODE = "node-a"


def server_python() -> str:
    """The interpreter that runs the servers: ``$TSLICE_SERVER_PYTHON``, else this one."""
    return os.environ.get(SERVER_PYTHON_ENV) or sys.executable


@dataclasses.dataclass(frozen=True)
class StackTLS:
    """A development CA, the servers' certificate and client certificates (``tslice certs``)."""

    directory: pathlib.Path

    @property
    def ca(self) -> pathlib.Path:
        return self.directory / "ca.pem"

    def server_args(self) -> list[str]:
        """Mutual TLS: the servers require client certificates signed by the CA."""
        return [
            "--tls-cert", str(self.directory / "server.pem"),
            "--tls-key", str(self.directory / "server.key"),
            "--tls-client-ca", str(self.ca),
        ]  # fmt: skip

    def env(self, identity: str | None) -> dict[str, str]:
        """The job side's variables: the CA, and ``identity``'s certificate if given."""
        env = {"TSLICE_TLS_CA": str(self.ca)}
        if identity is not None:
            stem = re.sub(r"[^A-Za-z0-9_.=+@-]+", "-", identity)  # as `tslice certs` names it
            env["TSLICE_TLS_CERT"] = str(self.directory / f"{stem}.pem")
            env["TSLICE_TLS_KEY"] = str(self.directory / f"{stem}.key")
        return env


def make_certs(directory: pathlib.Path, clients: Sequence[str]) -> StackTLS:
    """``tslice certs`` in the server Python, with a client certificate per identity."""
    command = [server_python(), "-m", "tslice", "certs", "--out", str(directory)]
    for identity in clients:
        command += ["--client", identity]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"tslice certs failed ({done.returncode}): {done.stderr}")
    return StackTLS(directory)


def _auth_configs(
    state_dir: pathlib.Path, tokens: Mapping[str, str]
) -> tuple[pathlib.Path, pathlib.Path]:
    """The agent's and the orchestrator's config files: ``auth:`` with a job token for each
    of ``tokens`` (job id -> token), and the orchestrator's own token towards the agent."""
    secret = state_dir / "orchestrator.token"
    secret.write_text("orchestrator-token-of-the-stack\n")
    lines = [f"  - {{name: orchestrator, roles: [orchestrator], token_file: {secret}}}"]
    for job, token in tokens.items():
        digest = hashlib.sha256(token.encode()).hexdigest()
        lines.append(f"  - {{name: {job}, roles: [job], jobs: [{job}], sha256: {digest}}}")
    tokens_file = state_dir / "tokens.yaml"
    tokens_file.write_text("tokens:\n" + "\n".join(lines) + "\n")
    agent, orchestrator = state_dir / "agent.yaml", state_dir / "orchestrator.yaml"
    agent.write_text(f"auth: {{tokens_file: {tokens_file}}}\n")
    orchestrator.write_text(
        f"auth: {{tokens_file: {tokens_file}}}\nagent_client: {{token_file: {secret}}}\n"
    )
    return agent, orchestrator


@dataclasses.dataclass(frozen=True)
class Stack:
    """Addresses of a running orchestrator (local mode) and its one node agent."""

    address: str
    agent_address: str
    groups: tuple[str, ...]
    state_dir: pathlib.Path
    #: Set when the servers serve mutual TLS (``running_stack(tls=...)``).
    tls: StackTLS | None = None
    #: Job id -> bearer token the servers know (``running_stack(tokens=...)``).
    tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def env(self, job_id: str) -> dict[str, str]:
        """``os.environ`` plus what a job process of ``job_id`` needs to reach this stack.

        Both spellings are set (llm-d's ``TIMESLICE_*`` and tslice's ``TSLICE_*``) so that
        a stale variable of the outer environment never wins over this stack.
        """
        env = dict(os.environ)
        env.pop("TSLICE_DISABLED", None)
        env.update(
            {
                "TIMESLICE_JOB_ID": job_id,
                "TSLICE_JOB_ID": job_id,
                "TIMESLICE_ORCH_ADDR": self.address,
                "TSLICE_ORCHESTRATOR": self.address,
                "TSLICE_AGENT": self.agent_address,
                "TSLICE_AGENT_ADDR": self.agent_address,
            }
        )
        if self.tls is not None:
            env.update(self.tls.env(f"job:{job_id}"))
        if job_id in self.tokens:
            env["TSLICE_TOKEN"] = self.tokens[job_id]
        for role in ("trainer", "sampler"):
            key = f"TIMESLICE_{role.upper()}_GROUP"
            if role in self.groups:
                env[key] = role
            else:
                env.pop(key, None)
        return env

    def logs(self) -> str:
        """The servers' logs so far (for assertion messages)."""
        parts = []
        for path in sorted(self.state_dir.glob("*.log")):
            text = path.read_text(encoding="utf-8", errors="replace")
            parts.append(f"----- {path.name} -----\n{text}")
        return "\n".join(parts)


@contextlib.contextmanager
def running_stack(
    tmp_path: pathlib.Path,
    *,
    groups: Sequence[str] = ("trainer", "sampler"),
    backend: str = "app-channel",
    tls: StackTLS | None = None,
    tokens: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """An agent (``backend``) and a local-mode orchestrator serving exactly ``groups``.

    In local mode every group spans the one agent, so groups share its (simulated or
    real) GPUs: one job may hold several at once, two jobs never do. ``tls``: both serve
    mutual TLS on TCP; ``tokens`` (job id -> token): both have authentication on.
    """
    state_dir = tmp_path / "tslice-stack"
    state_dir.mkdir(parents=True, exist_ok=True)
    # A Unix socket path is limited to ~107 bytes; pytest's tmp_path can be longer.
    sockets = pathlib.Path(tempfile.mkdtemp(prefix="tslice-"))
    servers: list[Server] = []
    agent_extra, orchestrator_extra = (tls.server_args(), tls.server_args()) if tls else ([], [])
    if tokens is not None:
        agent_config, orchestrator_config = _auth_configs(state_dir, tokens)
        agent_extra += ["--config", str(agent_config)]
        orchestrator_extra += ["--config", str(orchestrator_config)]
    try:
        agent = Server(
            "agent",
            [
                "--node-name",
                NODE,
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--state-dir",
                str(state_dir / "agent"),
                "--register-socket",
                str(sockets / "register.sock"),
                "--backend",
                backend,
                # The orchestrator reaches the agent here, so both start at once (its
                # TCP port, chosen by the agent, is known only once it serves).
                "--unix-socket",
                str(sockets / "agent.sock"),
                *agent_extra,
            ],
            state_dir / "agent.log",
            python=server_python(),
        )
        servers.append(agent)
        orchestrator_args = [
            "--local-agent", f"{NODE}=unix:{sockets / 'agent.sock'}",
            "--host", "127.0.0.1",
            "--port", "0",
            "--metrics-port", "0",
            "--state-dir", str(state_dir / "orchestrator"),
            "--shutdown-grace", "1",
            *orchestrator_extra,
        ]  # fmt: skip
        for group in groups:
            orchestrator_args += ["--group", group]
        orchestrator = Server(
            "orchestrator",
            orchestrator_args,
            state_dir / "orchestrator.log",
            python=server_python(),
        )
        servers.append(orchestrator)
        agent_address = agent.wait_ready()
        address = orchestrator.wait_ready()
        stack = Stack(
            address, agent_address, tuple(groups), state_dir, tls=tls, tokens=dict(tokens or {})
        )
        try:
            yield stack
        except BaseException:
            sys.stderr.write(stack.logs())
            raise
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(sockets, ignore_errors=True)
