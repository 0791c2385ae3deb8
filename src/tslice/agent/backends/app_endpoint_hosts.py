"""Which engines the ``app-endpoint`` backend may talk to, and its settings.

The agent is privileged and reachable over the network, so it must not become a
proxy to arbitrary URLs: every endpoint's host (and optionally port) must match
``allowed_hosts`` (default: loopback only) before any socket is opened. Matching is
on the URL text, never on a DNS answer, so ``http://2130706433/`` is not mistaken
for ``127.0.0.1``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
from collections.abc import Mapping
from typing import Any

import pydantic
from typing_extensions import Self

from tslice.agent.backends import sections

DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")


@dataclasses.dataclass(frozen=True)
class HostPattern:
    """One ``allowed_hosts`` entry: a host name glob, an IP address or a CIDR network,
    optionally with ``:port`` (IPv6 in brackets when a port is given: ``[::1]:8000``)."""

    text: str
    #: Lower-case glob for host names (``*.svc.cluster.local``); ``None`` for IP entries.
    name_glob: str | None
    #: IP entries; a single address is a /32 (/128) network.
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    #: ``None`` = any port.
    port: int | None

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse an entry; ``ValueError`` says what is wrong with it."""
        raw = text.strip()
        if not raw:
            raise ValueError("empty host pattern")
        host, port = _split_host_port(raw)
        if not host:
            raise ValueError(f"host pattern {text!r} has no host")
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            network = None
        if network is not None:
            return cls(text=raw, name_glob=None, network=network, port=port)
        if "/" in host or any(c.isspace() for c in host):
            raise ValueError(f"host pattern {text!r} is neither a host name glob nor an IP/CIDR")
        return cls(text=raw, name_glob=_normalise_name(host), network=None, port=port)

    def matches(self, *, host: str, port: int) -> bool:
        """True if an endpoint at ``host`` (as parsed from its URL) and ``port`` is allowed."""
        if self.port is not None and self.port != port:
            return False
        address = _ip_address(host)
        if self.network is not None:
            return address is not None and address in self.network
        assert self.name_glob is not None
        return fnmatch.fnmatchcase(_normalise_name(host), self.name_glob)


def _split_host_port(raw: str) -> tuple[str, int | None]:
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep:
            raise ValueError(f"host pattern {raw!r} has an unclosed '['")
        if not rest:
            return host, None
        if not rest.startswith(":"):
            raise ValueError(f"host pattern {raw!r}: expected ':PORT' after ']'")
        return host, _parse_port(rest[1:], raw)
    if raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
        return host, _parse_port(port_text, raw)
    # No colon, or a bare IPv6 address/network (several colons, no port).
    return raw, None


def _parse_port(text: str, raw: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"host pattern {raw!r} has an invalid port {text!r} (1-65535)")
    return int(text)


def _normalise_name(host: str) -> str:
    return host.lower().rstrip(".")


def _ip_address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# --------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class AppEndpointSettings:
    """Agent-side settings of the backend (the ``app-endpoint`` section of the agent config)."""

    #: Hosts the backend may talk to (see :class:`HostPattern`); default loopback only.
    allowed_hosts: tuple[HostPattern, ...] = tuple(
        HostPattern.parse(h) for h in DEFAULT_ALLOWED_HOSTS
    )
    #: Seconds to wait for an engine's answer (reading, writing); default 300, because a
    #: level-1 sleep of a large model copies its weights to host memory first.
    timeout_s: float = 300.0
    #: Seconds to wait for a TCP connection; short, since a local engine accepts at once.
    connect_timeout_s: float = 10.0

    @classmethod
    def from_mapping(cls, settings: Mapping[str, Any]) -> Self:
        """Validate the config section; a ``ConfigError`` names the bad field and the fix."""
        model = sections.validate(_SettingsModel, settings, backend="app-endpoint")
        patterns = []
        for index, text in enumerate(model.allowed_hosts):
            try:
                patterns.append(HostPattern.parse(text))
            except ValueError as exc:
                raise sections.invalid(
                    "app-endpoint",
                    f"allowed_hosts.{index}: {exc}; use HOST, HOST:PORT, *.DOMAIN, an IP "
                    "address or a CIDR network",
                ) from exc
        return cls(
            allowed_hosts=tuple(patterns),
            timeout_s=model.timeout_s,
            connect_timeout_s=model.connect_timeout_s,
        )


class _SettingsModel(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    allowed_hosts: list[str] = pydantic.Field(default_factory=lambda: list(DEFAULT_ALLOWED_HOSTS))
    timeout_s: float = pydantic.Field(default=300.0, gt=0)
    connect_timeout_s: float = pydantic.Field(default=10.0, gt=0)
