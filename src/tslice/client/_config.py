"""Client configuration: explicit arguments first, then the environment.

No orchestrator address anywhere means no-op mode, so that one training script
runs unchanged with and without the platform.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from typing import Final, Literal, TypeAlias

import grpc

from tslice.client import _address, _retry
from tslice.common import errors, validation
from tslice.security import tls

#: Orchestrator address, or several (``a:50051,b:50051``: HA replicas, tried in turn, a
#: follower's redirect to the leader followed); the first variable set wins (the second
#: is llm-d's name).
ADDRESS_ENV: Final = ("TSLICE_ORCHESTRATOR", "TIMESLICE_ORCH_ADDR")
#: Job id; the first variable set wins (the second is llm-d's name).
JOB_ID_ENV: Final = ("TSLICE_JOB_ID", "TIMESLICE_JOB_ID")
#: Inside a Slurm job, the job id when none of :data:`JOB_ID_ENV` is set: its steps act
#: as one job (array tasks too, where they set ``TSLICE_JOB_ID=$SLURM_ARRAY_JOB_ID``).
SLURM_JOB_ID_ENV: Final = "SLURM_JOB_ID"
#: Group used when a call names none.
GROUP_ENV: Final = ("TSLICE_GROUP",)
#: ``1``/``true``/``yes``/``on`` forces no-op mode even when an address is given.
DISABLED_ENV: Final = "TSLICE_DISABLED"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}

#: Default deadline of the calls that never wait for other jobs (yield, status...).
DEFAULT_CALL_TIMEOUT_S: Final = 30.0


class _Default(enum.Enum):
    TOKEN = "USE_CLIENT_DEFAULT"


#: Marks "not given, use the client's default" where ``None`` means "no deadline".
USE_CLIENT_DEFAULT: Final = _Default.TOKEN
Timeout: TypeAlias = float | Literal[_Default.TOKEN] | None
#: One gRPC channel option (``("grpc.keepalive_time_ms", 60000)``); grpc checks the values.
ChannelOption: TypeAlias = tuple[str, object]
#: A job id; ``None``: calls name theirs (``job_id=``); the default: ``$TSLICE_JOB_ID`` (in a
#: Slurm job, else ``$SLURM_JOB_ID``), required.
JobId: TypeAlias = str | Literal[_Default.TOKEN] | None


#: Holder lease of a client that sets none (``lease_s`` argument, then ``$TSLICE_LEASE_S``).
DEFAULT_LEASE_S: Final = 30.0
LEASE_ENV: Final = "TSLICE_LEASE_S"
#: Bound on the first connection to a server (``connect_timeout``, then this variable).
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
CONNECT_TIMEOUT_ENV: Final = "TSLICE_CONNECT_TIMEOUT_S"
_NONE = {"none", "off", "0"}


def resolve_seconds(
    value: Timeout,
    *,
    name: str,
    env: str,
    default: float,
    none_means: str,
    environ: Mapping[str, str] | None = None,
) -> float | None:
    """Seconds (None: ``none_means``): the argument ``name``, else ``$env``, else ``default``."""
    if value is not USE_CLIENT_DEFAULT:
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 seconds or None ({none_means}), got {value!r}")
        return value
    raw = (os.environ if environ is None else environ).get(env, "").strip()
    if not raw:
        return default
    if raw.lower() in _NONE:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise errors.ConfigError(
            f"{env}={raw!r} is not understood; use a number of seconds (e.g. {default:g}) or "
            f"'none' for {none_means}"
        )
    return seconds


def resolve_lease(lease_s: Timeout, environ: Mapping[str, str] | None = None) -> float | None:
    """The holder lease in seconds (None: no lease): the argument, else the environment;
    one shorter than the servers' floor is refused here, before any call."""
    lease = resolve_seconds(
        lease_s,
        name="lease_s",
        env=LEASE_ENV,
        default=DEFAULT_LEASE_S,
        none_means="no lease",
        environ=environ,
    )
    if lease is not None and lease * 1000 < validation.MIN_LEASE_MS:
        floor = validation.MIN_LEASE_MS / 1000
        why = (
            f"is shorter than the orchestrator's floor of {floor:g} s: the lease would lapse "
            f"before the Hold stream opens; use {floor:g} s or more (5 s or more where the "
            "orchestrator may restart), or None for no lease"
        )
        if lease_s is USE_CLIENT_DEFAULT:
            raise errors.ConfigError(f"{LEASE_ENV}={lease:g} {why}")
        raise ValueError(f"lease_s={lease!r} {why}")
    return lease


def resolve_connect_timeout(
    connect_timeout: Timeout, environ: Mapping[str, str] | None = None
) -> float | None:
    """How long the first connection may take (None: retry as long as the call may)."""
    return resolve_seconds(
        connect_timeout,
        name="connect_timeout",
        env=CONNECT_TIMEOUT_ENV,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        none_means="no bound",
        environ=environ,
    )


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Resolved client settings (arguments, then environment, then defaults)."""

    #: Orchestrator address (``host:port``, ``unix:/path``...), or several joined with
    #: commas (see :attr:`addresses`); ``None`` = no-op mode.
    address: str | None
    #: Job id used when a call names none (``None``: each acquire/yield/slice names one).
    job_id: str | None
    #: Group used when a call names none.
    default_group: str | None
    #: Default deadline of ``acquire`` in seconds; ``None`` = wait as long as it takes.
    timeout: float | None
    #: Default deadline, retries included, of the calls that do not wait for a grant.
    call_timeout: float
    #: Device bytes the job occupies per node when resident (0 = the agent's default).
    footprint_bytes: int
    retry: _retry.RetryPolicy
    #: gRPC channel options laid over :data:`tslice.client._channel.DEFAULT_CHANNEL_OPTIONS`.
    channel_options: tuple[ChannelOption, ...]
    #: Why the client is in no-op mode ("" when it is active).
    noop_reason: str = ""
    #: Bound on the first connection, in seconds (``None``: retried as long as a call may).
    connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S
    #: True when no-op mode was asked for (``$TSLICE_DISABLED``), so it goes unannounced.
    disabled_on_purpose: bool = False
    #: TLS and bearer token of the channel (``$TSLICE_TLS_*``, ``$TSLICE_TOKEN*``).
    security: tls.ClientSecurity = dataclasses.field(default_factory=tls.ClientSecurity)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every orchestrator address given, in order (empty in no-op mode)."""
        return _address.split_targets(self.address) if self.address is not None else ()


def _first_env(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def check_id(kind: str, value: str, *, source: str) -> str:
    try:
        return validation.check_id(kind, value)
    except validation.InvalidIdError as err:
        raise errors.InvalidArgument(
            grpc.StatusCode.INVALID_ARGUMENT, f"{err} (from {source})"
        ) from err


def check_timeout(name: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return value


def resolve(
    *,
    address: str | Sequence[str] | None,
    job_id: JobId,
    default_group: str | None,
    timeout: float | None,
    call_timeout: float,
    footprint_bytes: int | None,
    retry: _retry.RetryPolicy,
    channel_options: Sequence[ChannelOption] | None,
    connect_timeout: Timeout = USE_CLIENT_DEFAULT,
    environ: Mapping[str, str] | None = None,
    security: tls.ClientSecurity | None = None,
) -> ClientConfig:
    """Build a :class:`ClientConfig`; raise a clear error for anything malformed.

    An active client (an orchestrator is configured) needs a job id unless ``job_id``
    is ``None`` on purpose (each call then names its job): without one, the error
    comes here rather than at the first slice.
    """
    env = os.environ if environ is None else environ
    disabled = env.get(DISABLED_ENV, "").strip().lower()
    if disabled not in _TRUE | _FALSE:
        raise errors.ConfigError(
            f"{DISABLED_ENV}={env[DISABLED_ENV]!r} is not understood; use 1 to turn "
            "time-slicing off or 0 (or unset it) to leave it on"
        )

    job_required = job_id is USE_CLIENT_DEFAULT
    resolved_job: str | None = None
    if isinstance(job_id, str):
        resolved_job = check_id("job_id", job_id, source="the job_id argument")
    elif found := _first_env(env, (*JOB_ID_ENV, SLURM_JOB_ID_ENV)):
        resolved_job = check_id("job_id", found[1], source=f"${found[0]}")
    if default_group is not None:
        default_group = check_id("group_id", default_group, source="the default_group argument")
    elif found := _first_env(env, GROUP_ENV):
        default_group = check_id("group_id", found[1], source=f"${found[0]}")

    target: str | None = None
    if address is not None:
        if isinstance(address, str) and not address.strip():
            raise errors.ConfigError(
                "address is empty; pass 'host:port' (or 'unix:/path'), or None to read "
                f"${ADDRESS_ENV[0]}"
            )
        target = _address.grpc_targets(
            address, default_port=_address.ORCHESTRATOR_PORT, source="address"
        )
    elif found := _first_env(env, ADDRESS_ENV):
        target = _address.grpc_targets(
            found[1], default_port=_address.ORCHESTRATOR_PORT, source=f"${found[0]}"
        )

    noop_reason = ""
    if disabled in _TRUE:
        noop_reason = f"${DISABLED_ENV} is set"
        target = None
    elif target is None:
        noop_reason = (
            f"no orchestrator configured (pass address= or set ${ADDRESS_ENV[0]} "
            f"or ${ADDRESS_ENV[1]})"
        )
    elif resolved_job is None and job_required:
        raise errors.ConfigError(
            f"a job id is required: pass job_id= to the client or set ${JOB_ID_ENV[0]} "
            f"(or ${JOB_ID_ENV[1]}; in a Slurm job ${SLURM_JOB_ID_ENV} is taken); "
            "job_id=None makes each acquire/yield/slice name its job"
        )

    if footprint_bytes is not None and footprint_bytes < 0:
        raise ValueError(f"footprint_bytes must be >= 0, got {footprint_bytes!r}")
    check_timeout("timeout", timeout)
    check_timeout("call_timeout", call_timeout)
    return ClientConfig(
        address=target,
        job_id=resolved_job,
        default_group=default_group,
        timeout=timeout,
        call_timeout=call_timeout,
        footprint_bytes=footprint_bytes or 0,
        retry=retry,
        channel_options=tuple(channel_options or ()),
        noop_reason=noop_reason,
        connect_timeout=resolve_connect_timeout(connect_timeout, env),
        disabled_on_purpose=disabled in _TRUE,
        # Given, else the environment's (read only for an active client: a no-op one
        # opens no channel).
        security=security
        if security is not None
        else tls.ClientSecurity.from_env(env)
        if target
        else tls.ClientSecurity(),
    )
