"""Which engines the ``app-endpoint`` backend may talk to, and its settings.

The agent is privileged and reachable over the network, so it must not become a
proxy to arbitrary URLs: every endpoint's host *and port* must match ``allowed_hosts``
(default: vLLM's port 8000 and SGLang's 30000 on loopback) before any socket is opened.
An entry names its port (``HOST:PORT`` or ``HOST:FIRST-LAST``): "any port of a host"
would let a caller reach every other service on it (another local service's admin API
answered the agent; issue 10), so a bare host is refused with the form to use. Matching
is on the URL text, never on a DNS answer, so ``http://2130706433/`` is not mistaken
for ``127.0.0.1``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pydantic

from tslice.agent.backends import sections

if TYPE_CHECKING:
    from typing_extensions import Self

#: vLLM's default port (8000) and SGLang's (30000), on loopback.
DEFAULT_ALLOWED_HOSTS: tuple[str, ...] = (
    "127.0.0.1:8000",
    "localhost:8000",
    "[::1]:8000",
    "127.0.0.1:30000",
    "localhost:30000",
    "[::1]:30000",
)
#: How the settings name the entry forms (in refusals).
FORMS = "HOST:PORT, HOST:FIRST-LAST, [IPv6]:PORT, *.DOMAIN:PORT, IP:PORT or CIDR:PORT"


@dataclasses.dataclass(frozen=True)
class HostPattern:
    """One ``allowed_hosts`` entry: a host name glob, an IP address or a CIDR network, and
    its port or port range (``127.0.0.1:8000``, ``10.0.0.0/8:8000-8007``, ``[::1]:8000``)."""

    text: str
    #: Lower-case glob for host names (``*.svc.cluster.local``); ``None`` for IP entries.
    name_glob: str | None
    #: IP entries; a single address is a /32 (/128) network.
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    #: First and last port allowed (the same for one port).
    ports: tuple[int, int]

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse an entry; ``ValueError`` says what is wrong with it."""
        raw = text.strip()
        if not raw:
            raise ValueError("empty host pattern")
        host, ports = _split_host_port(raw)
        if not host:
            raise ValueError(f"host pattern {text!r} has no host")
        if ports is None:
            shown = f"[{host}]" if ":" in host else host
            raise ValueError(
                f"host pattern {text!r} names no port; an entry allows one engine's port "
                f"(or a range), not every service of the host: write {shown}:8000 "
                f"(vLLM's default), {shown}:30000 (SGLang's) or {shown}:8000-8007"
            )
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            network = None
        if network is not None:
            return cls(text=raw, name_glob=None, network=network, ports=ports)
        if "/" in host or any(c.isspace() for c in host):
            raise ValueError(f"host pattern {text!r} is neither a host name glob nor an IP/CIDR")
        return cls(text=raw, name_glob=_normalise_name(host), network=None, ports=ports)

    def matches(self, *, host: str, port: int) -> bool:
        """True if an endpoint at ``host`` (as parsed from its URL) and ``port`` is allowed."""
        if not self.ports[0] <= port <= self.ports[1]:
            return False
        address = _ip_address(host)
        if self.network is not None:
            return address is not None and address in self.network
        assert self.name_glob is not None
        return fnmatch.fnmatchcase(_normalise_name(host), self.name_glob)


def _split_host_port(raw: str) -> tuple[str, tuple[int, int] | None]:
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


def _parse_port(text: str, raw: str) -> tuple[int, int]:
    first_text, dash, last_text = text.partition("-")
    first = _one_port(first_text, raw)
    last = _one_port(last_text, raw) if dash else first
    if last < first:
        raise ValueError(f"host pattern {raw!r} has an empty port range {text!r}")
    return first, last


def _one_port(text: str, raw: str) -> int:
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

    #: Host and port pairs the backend may talk to (see :class:`HostPattern`); default:
    #: loopback, ports 8000 and 30000.
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
                    f"allowed_hosts.{index}: {exc}; entries are {FORMS}",
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
