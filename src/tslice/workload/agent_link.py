"""Where a workload's agent is and how the workload channel reaches it: the address,
the register socket, TLS and token, keepalive and reconnect settings.

Security is the job side's own (:class:`tslice.security.tls.ClientSecurity`, by default
``$TSLICE_TLS_CA``, ``$TSLICE_TLS_CERT``/``$TSLICE_TLS_KEY``, ``$TSLICE_TOKEN`` or
``$TSLICE_TOKEN_FILE``, as every job-side client): over TCP the channel this library
opens uses its TLS settings, and every stream carries its token (an agent with ``auth:``
on admits a TCP registration only from a credential that names the job). Over the
agent's Unix socket there is no TLS (the socket is plaintext; the register socket
binds the process) and the token is sent only if one is set. A ``grpc.Channel`` given
by the caller keeps its own TLS; the token is still sent.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import grpc

from tslice.security import tls
from tslice.workload import process

#: Environment variables read when ``agent`` is not given (first one set wins).
AGENT_ENV_VARS = ("TSLICE_AGENT_ADDR", "SNAPSHOT_AGENT_ADDR")


@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """How a handle keeps its stream to the agent alive, and how it reconnects."""

    #: Seconds between keepalive pings towards the agent (when the agent pings too).
    ping_interval_s: float = 5.0
    #: Silent intervals after which the connection is dropped and re-opened.
    missed_pings: int = 3
    #: First reconnect pause, seconds; doubles (with jitter) up to ``backoff_max_s``.
    backoff_initial_s: float = 0.5
    #: Longest reconnect pause, seconds.
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.ping_interval_s <= 0 or self.missed_pings < 1:
            raise ValueError("ping_interval_s must be > 0 and missed_pings >= 1")
        if self.backoff_initial_s <= 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")

    @property
    def silence_limit_s(self) -> float:
        return self.ping_interval_s * self.missed_pings


def is_unix(agent: str | grpc.Channel) -> bool:
    return isinstance(agent, str) and agent.startswith("unix:")


def resolve_agent(agent: str | grpc.Channel | None) -> str | grpc.Channel:
    if agent is None or agent == "":
        for name in AGENT_ENV_VARS:
            value = os.environ.get(name, "").strip()
            if value:
                return value
        raise ValueError(
            "no agent address: pass agent='127.0.0.1:9001' (or 'unix:/path/agent.sock') "
            f"or set {AGENT_ENV_VARS[0]}"
        )
    return agent


def register_socket(agent: str | grpc.Channel, given: str | os.PathLike[str] | None) -> Path | None:
    """The agent's register socket: given, ``$TSLICE_AGENT_REGISTER_SOCKET``, else
    ``register.sock`` next to a ``unix:`` agent socket; over TCP, none."""
    if given is not None:
        return Path(given)
    named = os.environ.get(process.SOCKET_ENV, "").strip()
    if named:
        return Path(named)
    if isinstance(agent, str) and is_unix(agent):
        path = agent[len("unix:") :]
        path = path[2:] if path.startswith("//") else path
        return Path(path).with_name("register.sock")
    return None


def security(agent: str | grpc.Channel, given: tls.ClientSecurity | None) -> tls.ClientSecurity:
    """What the channel to ``agent`` uses: ``given``, else the environment's (checked now,
    so that a bad file fails ``register_workload`` naming its variable); TLS only for a
    TCP address this library connects to."""
    chosen = given if given is not None else tls.ClientSecurity.from_env()
    if isinstance(agent, str) and not is_unix(agent):
        return chosen
    return tls.ClientSecurity(token=chosen.token)
