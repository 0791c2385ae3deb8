"""Client configuration: explicit arguments first, then the environment.

No orchestrator address anywhere means no-op mode, so that one training script
runs unchanged with and without the platform.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal, TypeAlias

import grpc

from tslice.client import _retry
from tslice.common import errors, ids

#: Orchestrator address; the first variable set wins (the second is llm-d's name).
ADDRESS_ENV: Final = ("TSLICE_ORCHESTRATOR", "TIMESLICE_ORCH_ADDR")
#: Job id; the first variable set wins (the second is llm-d's name).
JOB_ID_ENV: Final = ("TSLICE_JOB_ID", "TIMESLICE_JOB_ID")
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


#: Holder lease of a client that sets none (``lease_s`` argument, then ``$TSLICE_LEASE_S``).
DEFAULT_LEASE_S: Final = 30.0
LEASE_ENV: Final = "TSLICE_LEASE_S"
_NO_LEASE = {"none", "off", "0"}


def resolve_lease(lease_s: Timeout, environ: Mapping[str, str] | None = None) -> float | None:
    """The holder lease in seconds (None: no lease): the argument, else the environment."""
    if lease_s is not USE_CLIENT_DEFAULT:
        if lease_s is not None and not lease_s > 0:
            raise ValueError(f"lease_s must be > 0 seconds or None (no lease), got {lease_s!r}")
        return lease_s
    raw = (os.environ if environ is None else environ).get(LEASE_ENV, "").strip()
    if not raw:
        return DEFAULT_LEASE_S
    if raw.lower() in _NO_LEASE:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise errors.ConfigError(
            f"{LEASE_ENV}={raw!r} is not understood; use a number of seconds (e.g. 30) or "
            "'none' for no lease"
        )
    return value


@dataclasses.dataclass(frozen=True)
class ClientConfig:
    """Resolved client settings (arguments, then environment, then defaults)."""

    #: Orchestrator address (``host:port``, ``unix:/path``...); ``None`` = no-op mode.
    address: str | None
    #: Job id used when a call names none; required by acquire/yield in active mode.
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
    channel_options: tuple[tuple[str, Any], ...]
    #: Why the client is in no-op mode ("" when it is active).
    noop_reason: str = ""

    @property
    def enabled(self) -> bool:
        return self.address is not None


def _first_env(environ: Mapping[str, str], names: Sequence[str]) -> tuple[str, str] | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def check_id(kind: str, value: str, *, source: str) -> str:
    try:
        return ids.check_id(kind, value)
    except ids.InvalidIdError as err:
        raise errors.InvalidArgument(
            grpc.StatusCode.INVALID_ARGUMENT, f"{err} (from {source})"
        ) from err


def check_timeout(name: str, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be a positive number of seconds or None, got {value!r}")
    return value


def resolve(
    *,
    address: str | None,
    job_id: str | None,
    default_group: str | None,
    timeout: float | None,
    call_timeout: float,
    footprint_bytes: int | None,
    retry: _retry.RetryPolicy,
    channel_options: Sequence[tuple[str, Any]] | None,
    environ: Mapping[str, str] | None = None,
) -> ClientConfig:
    """Build a :class:`ClientConfig`; raise a clear error for anything malformed."""
    env = os.environ if environ is None else environ
    disabled = env.get(DISABLED_ENV, "").strip().lower()
    if disabled not in _TRUE | _FALSE:
        raise errors.ConfigError(
            f"{DISABLED_ENV}={env[DISABLED_ENV]!r} is not understood; use 1 to turn "
            "time-slicing off or 0 (or unset it) to leave it on"
        )

    if job_id is not None:
        job_id = check_id("job_id", job_id, source="the job_id argument")
    elif found := _first_env(env, JOB_ID_ENV):
        job_id = check_id("job_id", found[1], source=f"${found[0]}")
    if default_group is not None:
        default_group = check_id("group_id", default_group, source="the default_group argument")
    elif found := _first_env(env, GROUP_ENV):
        default_group = check_id("group_id", found[1], source=f"${found[0]}")

    if address is not None and not address.strip():
        raise errors.ConfigError(
            "address is empty; pass 'host:port' (or 'unix:/path'), or None to read "
            f"${ADDRESS_ENV[0]}"
        )
    if address is None and (found := _first_env(env, ADDRESS_ENV)):
        address = found[1]

    noop_reason = ""
    if disabled in _TRUE:
        noop_reason = f"${DISABLED_ENV} is set"
        address = None
    elif address is None:
        noop_reason = (
            f"no orchestrator configured (pass address= or set ${ADDRESS_ENV[0]} "
            f"or ${ADDRESS_ENV[1]})"
        )

    if footprint_bytes is not None and footprint_bytes < 0:
        raise ValueError(f"footprint_bytes must be >= 0, got {footprint_bytes!r}")
    check_timeout("timeout", timeout)
    check_timeout("call_timeout", call_timeout)
    return ClientConfig(
        address=address.strip() if address is not None else None,
        job_id=job_id,
        default_group=default_group,
        timeout=timeout,
        call_timeout=call_timeout,
        footprint_bytes=footprint_bytes or 0,
        retry=retry,
        channel_options=tuple(channel_options or ()),
        noop_reason=noop_reason,
    )
