"""Addresses as people write them, turned into gRPC targets (or refused with the fix).

gRPC reads ``localhost`` as ``localhost:443`` and ``http://host:port`` as a DNS name
that never resolves: both fail late and obscurely, after silent retries. Here a
missing port gets the server's default port, IPv6 works with or without brackets,
gRPC's own target schemes (``unix:/path``, ``dns:///host:port``...) pass unchanged,
and a URL is refused with the ``host:port`` to write instead.

Several addresses (orchestrator replicas: ``a:50051,b:50051``, or a list) are checked
one by one and joined with commas (:func:`grpc_targets`); :func:`split_targets` reads
them back. A gRPC scheme target stays alone (``ipv4:`` lists are gRPC's own).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from typing import Final

from tslice.common import errors

#: Port of an orchestrator address that names none (as ``tslice orchestrator`` listens).
ORCHESTRATOR_PORT: Final = 50051
#: Port of an agent address that names none (as ``tslice agent`` listens).
AGENT_PORT: Final = 9001

#: gRPC's own name-resolver schemes: the target is gRPC's to interpret.
_GRPC_SCHEMES = ("unix:", "unix-abstract:", "vsock:", "dns:", "ipv4:", "ipv6:")
_HOST = re.compile(r"^[A-Za-z0-9_.-]+$")


def grpc_target(address: str, *, default_port: int, source: str) -> str:
    """The gRPC target for ``address``; ``source`` names where it came from (for errors)."""
    text = address.strip()
    if not text:
        raise errors.ConfigError(f"{source} is empty; write host:port (or unix:/path)")
    if text.lower().startswith(_GRPC_SCHEMES):
        return text
    if "://" in text:
        raise errors.ConfigError(_url_refusal(text, default_port=default_port, source=source))
    if text.startswith("["):
        return _bracketed(text, default_port=default_port, source=source)
    if text.count(":") > 1:
        return _bare_ipv6(text, default_port=default_port, source=source)
    host, _, port = text.partition(":")
    if not host:
        raise errors.ConfigError(
            f"{source}={text!r} names no host; write e.g. 127.0.0.1{text} or localhost{text}"
        )
    if not _HOST.fullmatch(host):
        raise errors.ConfigError(
            f"{source}={text!r}: {host!r} is not a host name or address; write host:port "
            f"(e.g. localhost:{default_port})"
        )
    return f"{host}:{_port(port, text, default_port=default_port, source=source)}"


def grpc_targets(address: str | Sequence[str], *, default_port: int, source: str) -> str:
    """The gRPC targets of one address, a comma-separated list or a list of them, checked
    and joined with commas (as :func:`split_targets` reads them)."""
    if isinstance(address, str):
        text = address.strip()
        if text.lower().startswith(_GRPC_SCHEMES) or "," not in text:
            return grpc_target(text, default_port=default_port, source=source)
        items: Sequence[str] = text.split(",")
    else:
        items = list(address)
    if not items:
        raise errors.ConfigError(f"{source} is an empty list; give at least one host:port")
    targets = [
        grpc_target(item, default_port=default_port, source=f"{source}[{at}]")
        for at, item in enumerate(items)
    ]
    if len(targets) > 1:
        schemed = [t for t in targets if t.lower().startswith(_GRPC_SCHEMES)]
        if schemed:
            raise errors.ConfigError(
                f"{source}: {schemed[0]!r} is a gRPC target, which cannot be in a list of "
                "addresses; give it alone, or list host:port addresses only"
            )
    return ",".join(dict.fromkeys(targets))


def split_targets(joined: str) -> tuple[str, ...]:
    """The targets :func:`grpc_targets` joined (one for a gRPC scheme target)."""
    if joined.lower().startswith(_GRPC_SCHEMES):
        return (joined,)
    return tuple(joined.split(","))


def _port(port: str, text: str, *, default_port: int, source: str) -> int:
    if port == "":
        return default_port
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.ConfigError(
            f"{source}={text!r}: port {port!r} is not a port number (1-65535); write "
            f"host:port, or only the host for port {default_port}"
        )
    return int(port)


def _bracketed(text: str, *, default_port: int, source: str) -> str:
    inside, closed, rest = text[1:].partition("]")
    if not closed or (rest and not rest.startswith(":")):
        raise errors.ConfigError(
            f"{source}={text!r} is not [ipv6]:port; write e.g. [::1]:{default_port}"
        )
    _check_ipv6(inside, text, default_port=default_port, source=source)
    port = _port(rest[1:], text, default_port=default_port, source=source)
    return f"[{inside}]:{port}"


def _bare_ipv6(text: str, *, default_port: int, source: str) -> str:
    _check_ipv6(text, text, default_port=default_port, source=source)
    return f"[{text}]:{default_port}"


def _check_ipv6(value: str, text: str, *, default_port: int, source: str) -> None:
    try:
        ipaddress.IPv6Address(value)
    except ValueError as err:
        raise errors.ConfigError(
            f"{source}={text!r}: {value!r} is not an IPv6 address; write host:port, or "
            f"[ipv6]:port (e.g. [::1]:{default_port})"
        ) from err


def _url_refusal(text: str, *, default_port: int, source: str) -> str:
    scheme, _, rest = text.partition("://")
    authority = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    try:
        suggestion = grpc_target(authority, default_port=default_port, source=source)
    except errors.ConfigError:
        suggestion = f"host:{default_port}"
    tls = (
        " (for TLS set $TSLICE_TLS_CA to the server's CA; the address is the same with or "
        "without TLS)"
        if scheme.lower() == "https"
        else ""
    )
    return (
        f"{source}={text!r} is a URL, but tslice needs a gRPC address{tls}: "
        f"write {suggestion!r} (host:port), or unix:/path for a Unix socket"
    )
