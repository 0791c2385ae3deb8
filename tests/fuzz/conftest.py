"""One real agent (sim, noop and app-channel backends) and one real orchestrator (local
mode, with its own sim agent) for the fuzz tests, as ``python -m tslice ...`` processes on
loopback (tests.harness.servers: ready once each has written its ready file).

Real processes rather than in-process servers: a crash, a hang of the event loop or a
SIGTERM ignored shows exactly as it would in production, and the examples stay cheap
(a loopback call costs about a millisecond; the servers start once for all modules).
At the end every server must still be alive and stop cleanly on SIGTERM.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Iterator, Sequence

import grpc
import pytest

from tests.fuzz import calls
from tests.harness.servers import Server

NODE = "node-a"


@dataclasses.dataclass
class Served:
    """A running server and a channel to it."""

    server: Server
    channel: grpc.Channel


def _flags(flags: dict[str, str]) -> list[str]:
    return [part for flag, value in flags.items() for part in (f"--{flag}", value)]


def _agent(state: pathlib.Path, name: str) -> Server:
    flags = {
        "node-name": NODE,
        "host": "127.0.0.1",
        "port": "0",
        "state-dir": str(state / name),
        "register-socket": str(state / f"{name}-r.sock"),
        "operation-timeout": "5",
        "sim-bandwidth": "1TB/s",
        "sim-latency": "0",
        "sim-devices": "2",
    }
    backends = ["--backend", "sim", "--backend", "noop", "--backend", "app-channel"]
    return Server("agent", [*_flags(flags), *backends], state / f"{name}.log")


def orchestrator_process(
    state: pathlib.Path, agent_address: str, *, groups: Sequence[str] = ()
) -> Server:
    """A local-mode orchestrator over the agent at ``agent_address`` (``groups``: the
    only groups there are; none: made on first Acquire)."""
    flags = {
        "local-agent": f"{NODE}={agent_address}",
        "host": "127.0.0.1",
        "port": "0",
        "metrics-port": "0",
        "state-dir": str(state / "orchestrator"),
        "shutdown-grace": "1",
        "operation-timeout": "5",
        "agent-rpc-timeout": "5",
    }
    only = [part for group in groups for part in ("--group", group)]
    return Server("orchestrator", [*_flags(flags), *only], state / "orchestrator.log")


#: Tracebacks a server may log during a fuzz run (a substring of the log line, and why).
#: Any other means a failure the caller was not told about (a crashed task, say).
KNOWN_TRACEBACKS = (
    ("Health/List", "grpcio-health-checking's servicer has no List: UNIMPLEMENTED, logged"),
)


def unexpected_tracebacks(log: str) -> list[str]:
    """The log's entries with a traceback that :data:`KNOWN_TRACEBACKS` does not name."""
    return [
        line[:600]
        for line in log.splitlines()
        if '"exc": ' in line and not any(known in line for known, _ in KNOWN_TRACEBACKS)
    ]


def served(server: Server) -> Iterator[Served]:
    """Yield ``server`` once serving; at the end it must be alive, have logged no
    unexpected traceback, and stop on SIGTERM."""
    try:
        address = server.wait_ready()
        with grpc.insecure_channel(address, options=calls.CHANNEL_OPTIONS) as channel:
            yield Served(server, channel)
        assert server.proc.poll() is None, (
            f"the {server.kind} died during the fuzz run:\n{server.logs()[-8000:]}"
        )
        assert server.terminate() == 0, server.logs()[-8000:]
        unexpected = unexpected_tracebacks(server.logs())
        assert not unexpected, f"the {server.kind} logged tracebacks:\n" + "\n".join(unexpected)
    finally:
        server.stop()


@pytest.fixture(scope="package")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """An agent fuzzed directly (not the orchestrator's: its grant marks get wild)."""
    state = tmp_path_factory.mktemp("fuzz-agent")
    yield from served(_agent(state, "agent"))


@pytest.fixture(scope="package")
def orchestrator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A local-mode orchestrator (groups made on first Acquire) over its own agent."""
    state = tmp_path_factory.mktemp("fuzz-orchestrator")
    for behind in served(_agent(state, "orchestrator-agent")):
        yield from served(orchestrator_process(state, behind.server.address))
