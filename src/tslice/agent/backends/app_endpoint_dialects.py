"""The engines' HTTP dialects (WIRE.md "Engine HTTP dialects") and request validation.

No I/O: :func:`plan` turns a request's ``AppEndpointConfig`` into the engines to
call, checked against the allow-list, and :func:`suspend_request` /
:func:`resume_request` build the exact calls of each dialect.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence

import httpx

from tslice.agent.backends import app_endpoint_hosts, base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import validation


class InvalidEndpointConfigError(base.InvalidBackendConfigError):
    """The request's ``AppEndpointConfig`` is unusable; nothing was sent, nothing changed.

    The agent should answer ``INVALID_ARGUMENT`` with this message and create no operation.
    """


class EndpointNotAllowedError(InvalidEndpointConfigError, base.BackendConfigRefusedError):
    """An endpoint's host and port are not on this agent's allow-list; nothing was sent.

    The agent should answer ``FAILED_PRECONDITION`` (the fix is in the agent's config).
    """


class Dialect(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"


_DIALECT_BY_APP: dict[int, Dialect] = {pb.APP_VLLM: Dialect.VLLM, pb.APP_SGLANG: Dialect.SGLANG}


@dataclasses.dataclass(frozen=True)
class EnginePlan:
    """A validated ``AppEndpointConfig``: what to call, where, with which tags."""

    dialect: Dialect
    #: Base URLs as given by the user, for messages.
    endpoints: tuple[str, ...]
    #: The same, parsed (no path: the dialect's paths are joined to them).
    bases: tuple[httpx.URL, ...]
    mode: pb.SuspendMode
    tags: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """One HTTP call to one engine."""

    method: str
    url: httpx.URL
    params: tuple[tuple[str, str], ...] = ()
    content: bytes | None = None
    content_type: str | None = None

    def describe(self) -> str:
        query = "?" + "&".join(f"{k}={v}" for k, v in self.params) if self.params else ""
        return f"{self.method} {self.url.path}{query}"


def plan(
    config: pb.BackendConfig | None,
    *,
    allowed_hosts: Sequence[app_endpoint_hosts.HostPattern],
    job_id: str = "",
) -> EnginePlan:
    """Validate a request's backend config against the allow-list; no I/O.

    Raises :class:`InvalidEndpointConfigError` or :class:`EndpointNotAllowedError`.
    """
    who = f" of job {job_id!r}" if job_id else ""
    if config is None or config.WhichOneof("backend") != "app_endpoint":
        raise InvalidEndpointConfigError(
            f"the app-endpoint backend needs backend_config.app_endpoint{who} "
            "(app and endpoints); none was given"
        )
    cfg = config.app_endpoint
    dialect = _DIALECT_BY_APP.get(cfg.app)
    if dialect is None:
        raise InvalidEndpointConfigError(
            f"app_endpoint.app{who} is unknown or unspecified ({cfg.app}); "
            "set it to APP_VLLM or APP_SGLANG"
        )
    if not cfg.endpoints:
        raise InvalidEndpointConfigError(
            f"app_endpoint.endpoints{who} is empty; give at least one engine URL "
            "such as http://127.0.0.1:8000"
        )
    if any(not tag for tag in cfg.tags):
        raise InvalidEndpointConfigError(f"app_endpoint.tags{who} contains an empty tag")
    bases: list[httpx.URL] = []
    # A set, not the list: ``url in bases`` compared URL objects pairwise (quadratic:
    # minutes for a few thousand endpoints, on the event loop).
    seen: set[str] = set()
    for endpoint in cfg.endpoints:
        url = _parse_endpoint(endpoint)
        _check_allowed(endpoint, url, allowed_hosts)
        key = str(url)
        if key in seen:
            raise InvalidEndpointConfigError(
                f"app_endpoint.endpoints{who} names {validation.shown(endpoint)} twice; "
                "each engine must be listed once"
            )
        seen.add(key)
        bases.append(url)
    return EnginePlan(
        dialect=dialect,
        endpoints=tuple(cfg.endpoints),
        bases=tuple(bases),
        mode=cfg.mode,
        tags=tuple(cfg.tags),
    )


def _parse_endpoint(endpoint: str) -> httpx.URL:
    def invalid(why: str) -> InvalidEndpointConfigError:
        return InvalidEndpointConfigError(
            f"app_endpoint endpoint {validation.shown(endpoint)} {why}"
        )

    try:
        url = httpx.URL(endpoint)
    except (httpx.InvalidURL, TypeError, ValueError) as exc:
        raise invalid(f"is not a valid URL ({exc})") from exc
    if url.scheme not in ("http", "https"):
        raise invalid("must start with http:// or https://")
    if not url.host:
        raise invalid("has no host")
    if url.userinfo:
        raise invalid("must not carry credentials (user:password@)")
    if url.query or url.fragment:
        raise invalid("must not have a query string or fragment; give the server's base URL")
    if url.path not in ("", "/"):
        # The dialect chooses every path the agent calls (WIRE.md): a caller's path would
        # aim the privileged agent's POSTs at any route of the server.
        raise invalid(
            "must be the engine server's base URL (scheme://host:port) without a path; the "
            "agent calls the dialect's own paths (vLLM /sleep, /wake_up; SGLang "
            "/release_memory_occupation, /resume_memory_occupation)"
        )
    if url.port is not None and not 0 < url.port < 65536:
        raise invalid(f"has an invalid port {url.port}")
    return url.copy_with(path="")


def _effective_port(url: httpx.URL) -> int:
    if url.port is not None:
        return url.port
    return 443 if url.scheme == "https" else 80


def _check_allowed(
    endpoint: str, url: httpx.URL, allowed: Sequence[app_endpoint_hosts.HostPattern]
) -> None:
    port = _effective_port(url)
    if any(p.matches(host=url.host, port=port) for p in allowed):
        return
    listed = ", ".join(p.text for p in allowed) or "(nothing)"
    raise EndpointNotAllowedError(
        f"app_endpoint endpoint {validation.shown(endpoint)} is refused: host "
        f"{validation.shown(url.host)} port {port} is not "
        f"in this agent's app-endpoint allowed_hosts ({listed}); add it to the agent config "
        f"as {_pattern_for(url, port)} if this engine is meant to be driven by this agent"
    )


def _pattern_for(url: httpx.URL, port: int) -> str:
    host = f"[{url.host}]" if ":" in url.host else url.host
    return validation.shown(f"{host}:{port}")


def join(base_url: httpx.URL, operation: str) -> httpx.URL:
    # httpx spells an empty path "/", so strip again rather than trust the stored base.
    return base_url.copy_with(path=f"{base_url.path.rstrip('/')}/{operation}")


def _json_body(tags: Sequence[str]) -> bytes:
    body: dict[str, list[str]] = {"tags": list(tags)} if tags else {}
    return json.dumps(body, separators=(",", ":")).encode()


def suspend_request(
    dialect: Dialect, base_url: httpx.URL, *, level: int, tags: Sequence[str]
) -> EngineRequest:
    """vLLM: ``POST /sleep?level=N``, empty body (vLLM takes no tags on sleep).
    SGLang: ``POST /release_memory_occupation`` with ``{}`` or ``{"tags": [...]}``."""
    if dialect is Dialect.VLLM:
        return EngineRequest("POST", join(base_url, "sleep"), params=(("level", str(level)),))
    return EngineRequest(
        "POST",
        join(base_url, "release_memory_occupation"),
        content=_json_body(tags),
        content_type="application/json",
    )


def resume_request(dialect: Dialect, base_url: httpx.URL, *, tags: Sequence[str]) -> EngineRequest:
    """vLLM: ``POST /wake_up`` plus one ``tags=`` parameter per tag, in order, empty body.
    SGLang: ``POST /resume_memory_occupation`` with ``{}`` or ``{"tags": [...]}``."""
    if dialect is Dialect.VLLM:
        return EngineRequest(
            "POST", join(base_url, "wake_up"), params=tuple(("tags", t) for t in tags)
        )
    return EngineRequest(
        "POST",
        join(base_url, "resume_memory_occupation"),
        content=_json_body(tags),
        content_type="application/json",
    )


def sleep_level(mode: pb.SuspendMode) -> int:
    """vLLM's sleep level: 2 drops the weights (DISCARD), 1 keeps them in host memory."""
    return 2 if mode == pb.SUSPEND_MODE_DISCARD else 1
