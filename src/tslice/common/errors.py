"""One error root for everything tslice raises, and the gRPC status mapping.

    TsliceError
    ├── ConfigError                 bad configuration file / flags
    └── RPCError(status, message)   a gRPC call failed
        ├── InvalidArgument         INVALID_ARGUMENT
        ├── UnknownGroup            NOT_FOUND on a group
        ├── NotFound                NOT_FOUND on anything else (operation, job)
        ├── NotHolder               PERMISSION_DENIED (yield of another job's lock)
        ├── Unavailable             UNAVAILABLE (server down or group cannot serve)
        ├── Aborted                 ABORTED (an operation is already running)
        ├── FailedPrecondition      FAILED_PRECONDITION
        ├── DeadlineExceeded        DEADLINE_EXCEEDED
        │   └── AcquireTimeout      ... while waiting for a group
        └── Cancelled               CANCELLED

Translation happens in one place, :func:`from_grpc`, always ``raise ... from`` the
original ``grpc.RpcError``.
"""

from __future__ import annotations

import grpc


class TsliceError(Exception):
    """Root of every error tslice raises."""


class ConfigError(TsliceError):
    """Invalid configuration; the message names the field and the fix."""


class RPCError(TsliceError):
    """A gRPC call failed with ``status``; ``message`` is the server's explanation."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


class InvalidArgument(RPCError):
    pass


class NotFound(RPCError):
    pass


class UnknownGroup(NotFound):
    pass


class NotHolder(RPCError):
    pass


class Unavailable(RPCError):
    pass


class Aborted(RPCError):
    pass


class FailedPrecondition(RPCError):
    pass


class DeadlineExceeded(RPCError):
    pass


class AcquireTimeout(DeadlineExceeded):
    """Acquire gave up before the group was granted; the job is no longer queued."""

    def __init__(self, *, job_id: str, group_id: str, waited_ms: int, message: str = "") -> None:
        super().__init__(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            message or f"job {job_id!r} was not granted group {group_id!r} within {waited_ms} ms",
        )
        self.job_id = job_id
        self.group_id = group_id
        self.waited_ms = waited_ms


class Cancelled(RPCError):
    pass


_BY_STATUS: dict[grpc.StatusCode, type[RPCError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.PERMISSION_DENIED: NotHolder,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_grpc(err: grpc.RpcError, *, group_id: str | None = None) -> RPCError:
    """Translate a ``grpc.RpcError`` (sync or aio) into the most specific tslice error."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    message = details or code.name.lower()
    # The orchestrator answers NOT_FOUND for an unknown group only (its other bad
    # arguments are INVALID_ARGUMENT): a call about a group needs no look at the text.
    if code == grpc.StatusCode.NOT_FOUND and group_id is not None:
        return UnknownGroup(code, message)
    return _BY_STATUS.get(code, RPCError)(code, message)
