"""Agent configuration: a YAML file and/or CLI flags, validated once, then frozen.

Pydantic validates at the boundary (sizes such as ``80GiB``, ranges, unknown keys) and
errors name the field and the fix; the rest of the agent sees only the frozen
:class:`AgentConfig` dataclass.

File shape (every key optional)::

    node_name: gpu-node-1
    host: 0.0.0.0
    port: 9001
    unix_socket: /run/tslice/agent.sock
    state_dir: /var/lib/tslice/agent
    default_backend: sim
    backends: [sim, noop]          # enabled in addition to default_backend
    operation_timeout_s: 600
    host_budget: 512GiB            # host memory parked states may hold (default: see below)
    host_reserve: 16GiB            # kept free when host_budget is not set
    metrics_port: 0
    log_level: info
    tls: {cert: agent.pem, key: agent.key, client_ca: ca.pem}   # off: plaintext
    insecure: false                # plaintext on a non-loopback host (trusted network)
    auth: {tokens_file: /etc/tslice/tokens.yaml}   # off without it (see docs/security.md)
    sim: {devices: 2, capacity: 80GiB, bandwidth: 25GB/s, restore_bandwidth: 50GB/s,
          latency_s: 0.005, default_footprint: 48GiB, fail_probability: 0, hang_probability: 0,
          extra_latency_s: 0, seed: null}
    backend_settings:              # free-form section per backend, handed to Backend.create
      noop: {delay_s: 0.1}
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic import BaseModel, ByteSize, ConfigDict, Field

from tslice.common import errors, validation
from tslice.security.identities import AuthSettings
from tslice.security.tls import ServerTLS, check_listen
from tslice.server import serving

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/tslice/agent``, else ``/var/lib/tslice/agent`` for root,
    ``~/.local/state/tslice/agent`` otherwise (as the orchestrator's)."""
    return serving.default_state_dir("agent")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """The simulated node of the ``sim`` backend."""

    #: Number of simulated devices on this node.
    devices: int = 1
    #: Memory of each device, bytes (default 80 GiB, an H100).
    capacity_bytes: int = 80 * 1024**3
    #: Host<->device copy rate per device, bytes/s (default 25 GB/s, PCIe Gen4 x16);
    #: snapshots always move at this rate...
    bandwidth_bytes_per_s: int = 25 * 10**9
    #: ...and restores too, unless this is set (bytes/s).
    restore_bandwidth_bytes_per_s: int | None = None
    #: Fixed cost of every snapshot/restore, seconds.
    latency_s: float = 0.005
    #: Footprint per device of jobs that declare none; None = 60% of capacity, so two
    #: such jobs can never be resident together.
    default_footprint_bytes: int | None = None
    #: Probability that a snapshot/restore fails (FatalBackendError).
    fail_probability: float = 0.0
    #: Added to every snapshot/restore, seconds.
    extra_latency_s: float = 0.0
    #: Probability that a snapshot/restore hangs until the operation deadline.
    hang_probability: float = 0.0
    #: Seed of the fault-injection dice (None = random).
    seed: int | None = None

    def settings(self) -> dict[str, Any]:
        """Keyword arguments of ``SimBackend``."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Everything the node agent needs; build it with :func:`load`."""

    #: This node's name, reported in Status and in error messages (default: hostname).
    node_name: str
    #: TCP address to bind; 127.0.0.1 by default because the API is unauthenticated
    #: (use 0.0.0.0 so that an orchestrator on another machine can reach it).
    host: str = "127.0.0.1"
    #: TCP port (0 = pick a free one; 9001 by convention).
    port: int = 9001
    #: Also listen on this Unix socket, for node-local workloads (None = off).
    unix_socket: Path | None = None
    #: Unix socket where GPU processes announce themselves (PID from SO_PEERCRED); None =
    #: ``register.sock`` next to ``unix_socket`` (where the workload library looks), else
    #: ``<state_dir>/register.sock``. Workloads also find it via TSLICE_AGENT_REGISTER_SOCKET.
    register_socket: Path | None = None
    #: Kubernetes mode: watch the job pods of this node (``spec.nodeName`` = node_name) and
    #: admit a workload on the Unix socket only from a pod of the job it claims.
    kubernetes: bool = False
    #: Credentials for it (None: in-cluster config, then $KUBECONFIG / ~/.kube/config).
    kubeconfig: Path | None = None
    #: Where processes are looked up (their cgroups); a fixture tree in tests.
    proc_root: Path = Path("/proc")

    @property
    def register_path(self) -> Path:
        """Where the register socket is: :attr:`register_socket` or its default."""
        if self.register_socket is not None:
            return self.register_socket
        if self.unix_socket is not None:
            return self.unix_socket.parent / "register.sock"
        return self.state_dir / "register.sock"

    #: Where jobs, operations and simulated device state persist.
    state_dir: Path = dataclasses.field(default_factory=default_state_dir)
    #: Backend for requests that name none and jobs with no recorded choice.
    default_backend: str = "noop"
    #: Further backends enabled on this node (the default one always is).
    backends: tuple[str, ...] = ()
    #: Per-backend settings handed to ``Backend.create`` (the sim backend uses ``sim``).
    backend_settings: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)
    #: Deadline of one operation, retries included; past it the job is FAULTED.
    operation_timeout_s: float = 600.0
    #: Host memory the parked states of this node may hold, bytes; a snapshot beyond it
    #: is refused before anything is frozen (tslice.agent.moves.parking). None (default): the
    #: node's available memory at each snapshot, less ``host_reserve_bytes``.
    host_budget_bytes: int | None = None
    #: Kept free for the node's own processes when ``host_budget_bytes`` is not set;
    #: None (default): 10 % of the node's memory, at least 2 GiB.
    host_reserve_bytes: int | None = None
    #: Finished operations stay pollable this long (seconds)...
    operation_retention_s: float = 24 * 3600.0
    #: ...and at most this many are kept.
    max_operations: int = 10_000
    #: How often backend health is re-checked (seconds).
    health_interval_s: float = 10.0
    #: On SIGTERM, in-flight RPCs and operations get this long to finish (seconds).
    grace_period_s: float = 5.0
    #: Prometheus /metrics port (0 = off).
    metrics_port: int = 0
    log_level: str = "info"
    #: Certificate files the TCP port serves (None: plaintext, loopback only unless
    #: ``insecure``); the Unix socket is always plaintext (local callers only).
    tls: ServerTLS | None = None
    #: Plaintext on a non-loopback host is meant (a trusted network).
    insecure: bool = False
    #: Authentication and roles (tslice.security.identities and .roles); None: every caller
    #: may call everything.
    auth: AuthSettings | None = None

    @property
    def enabled_backends(self) -> tuple[str, ...]:
        """The default backend first, then the others, without duplicates."""
        return tuple(dict.fromkeys((self.default_backend, *self.backends)))

    def settings_for(self, backend: str) -> dict[str, Any]:
        """The settings ``Backend.create_on_node`` gets: the backend's ``backend_settings``
        section, over the ``sim`` section for the sim backend."""
        given = dict(self.backend_settings.get(backend, {}))
        return {**self.sim.settings(), **given} if backend == "sim" else given


# ---- the file/flag boundary --------------------------------------------------------------


def _strip_per_second(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower().endswith("/s"):
        return value.strip()[:-2]
    return value


def _bytes(size: ByteSize | None) -> int | None:
    return None if size is None else int(size)


class _SimModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    devices: int = Field(default=1, ge=1, le=1024)
    capacity: ByteSize = Field(default=ByteSize(80 * 1024**3), gt=0)
    bandwidth: ByteSize = Field(default=ByteSize(25 * 10**9), gt=0)
    restore_bandwidth: ByteSize | None = Field(default=None, gt=0)
    latency_s: float = Field(default=0.005, ge=0)
    default_footprint: ByteSize | None = Field(default=None, gt=0)
    fail_probability: float = Field(default=0.0, ge=0, le=1)
    extra_latency_s: float = Field(default=0.0, ge=0)
    hang_probability: float = Field(default=0.0, ge=0, le=1)
    seed: int | None = None

    @pydantic.field_validator("bandwidth", "restore_bandwidth", mode="before")
    @classmethod
    def _per_second(cls, value: Any) -> Any:
        return _strip_per_second(value)

    def freeze(self) -> SimConfig:
        return SimConfig(
            devices=self.devices,
            capacity_bytes=int(self.capacity),
            bandwidth_bytes_per_s=int(self.bandwidth),
            restore_bandwidth_bytes_per_s=_bytes(self.restore_bandwidth),
            latency_s=self.latency_s,
            default_footprint_bytes=_bytes(self.default_footprint),
            fail_probability=self.fail_probability,
            extra_latency_s=self.extra_latency_s,
            hang_probability=self.hang_probability,
            seed=self.seed,
        )

    @pydantic.model_validator(mode="after")
    def _footprint_fits(self) -> _SimModel:
        if self.default_footprint is not None and self.default_footprint > self.capacity:
            raise ValueError(
                f"default_footprint ({int(self.default_footprint)} bytes) exceeds the device "
                f"capacity ({int(self.capacity)} bytes); lower it or raise sim.capacity"
            )
        return self


class _AgentModel(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node_name: str = Field(default_factory=socket.gethostname)
    host: str = "127.0.0.1"
    port: int = Field(default=9001, ge=0, le=65535)
    unix_socket: Path | None = None
    register_socket: Path | None = None
    kubernetes: bool = False
    kubeconfig: Path | None = None
    proc_root: Path = Path("/proc")
    state_dir: Path = Field(default_factory=default_state_dir)
    default_backend: str = "noop"
    backends: list[str] = Field(default_factory=list)
    backend_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    sim: _SimModel = Field(default_factory=_SimModel)
    operation_timeout_s: float = Field(default=600.0, gt=0)
    host_budget: ByteSize | None = Field(default=None, ge=0)
    host_reserve: ByteSize | None = Field(default=None, ge=0)
    operation_retention_s: float = Field(default=24 * 3600.0, gt=0)
    max_operations: int = Field(default=10_000, ge=1)
    health_interval_s: float = Field(default=10.0, gt=0)
    grace_period_s: float = Field(default=5.0, ge=0)
    metrics_port: int = Field(default=0, ge=0, le=65535)
    log_level: str = "info"
    tls: dict[str, Any] | None = None
    insecure: bool = False
    auth: dict[str, Any] | None = None

    @pydantic.field_validator("node_name")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return validation.check_id("node_name", value)

    @pydantic.field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.lower() not in _LOG_LEVELS:
            raise ValueError(f"use one of {', '.join(_LOG_LEVELS)}")
        return value.lower()

    def freeze(self) -> AgentConfig:
        # The fields are AgentConfig's, by name; only these change type on the way.
        fields = {name: getattr(self, name) for name in type(self).model_fields}
        fields["host_budget_bytes"] = _bytes(fields.pop("host_budget"))
        fields["host_reserve_bytes"] = _bytes(fields.pop("host_reserve"))
        fields.update(
            state_dir=self.state_dir.expanduser(),
            backends=tuple(self.backends),
            backend_settings={k: dict(v) for k, v in self.backend_settings.items()},
            sim=self.sim.freeze(),
            tls=ServerTLS.from_mapping(self.tls, where="tls"),
            auth=AuthSettings.from_mapping(self.auth, load_yaml=yaml.safe_load),
        )
        return AgentConfig(**fields)


def _merge(base: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if value is None:  # a flag that was not given
            continue
        if isinstance(value, Mapping):
            below = merged.get(key)
            merged[key] = _merge(dict(below) if isinstance(below, Mapping) else {}, value)
        else:
            merged[key] = value
    return merged


def _describe(err: pydantic.ValidationError) -> str:
    parts = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key; remove it or check its spelling"
        elif item["type"].startswith("byte_size"):
            message = f"{message}; write a size such as 80GiB, 512MiB or 25GB"
        parts.append(f"{where}: {message}")
    return "; ".join(parts)


def load(*, path: Path | None = None, overrides: Mapping[str, Any] | None = None) -> AgentConfig:
    """Read ``path`` (YAML) if given, apply ``overrides`` (nested like the file), validate.

    Raises :class:`tslice.common.errors.ConfigError` naming the field and the fix.
    """
    data: dict[str, Any] = {}
    source = "flags"
    if path is not None:
        source = str(path)
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as err:
            raise errors.ConfigError(f"cannot read agent config {path}: {err.strerror}") from err
        except yaml.YAMLError as err:
            raise errors.ConfigError(f"agent config {path} is not valid YAML: {err}") from err
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise errors.ConfigError(f"agent config {path} must be a mapping of keys to values")
        data = raw
    data = _merge(data, overrides or {})
    try:
        config = _AgentModel.model_validate(data).freeze()
    except pydantic.ValidationError as err:
        raise errors.ConfigError(f"invalid agent config ({source}): {_describe(err)}") from err
    except ValueError as err:  # a section parsed outside pydantic (tls, auth)
        raise errors.ConfigError(f"invalid agent config ({source}): {err}") from err
    # Before anything starts: plaintext where other machines reach the agent is refused.
    check_listen(config.host or "0.0.0.0", tls=config.tls, insecure=config.insecure, what="agent")
    return config
