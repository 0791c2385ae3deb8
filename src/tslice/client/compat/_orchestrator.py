"""Drop-in ``TimeSliceOrchestratorClient`` for code written against llm-d's client.

Same constructor, methods, result types and exception names as llm-d's
``timeslice.orchestrator`` package, running on :class:`tslice.Client`: UNAVAILABLE
is retried across orchestrator restarts (llm-d's retry config named a service
that does not exist, so it never applied), DEADLINE_EXCEEDED never is, and nested
``on_accelerators`` blocks on the same group hold it once. Every exception raised
is both an llm-d ``Orchestrator*Error`` and the matching tslice error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import ClassVar, Protocol, TypeVar

import grpc

from tslice.client import _client, _config, _types
from tslice.common import errors

# llm-d's names for the shared result types.
GroupLockState = _types.GroupState
AgentJobState = _types.AgentJobState
SnapshotAgentJobState = _types.AgentJobStatus
GroupStatus = _types.GroupStatus
AcquireResult = _types.AcquireResult
YieldResult = _types.YieldResult


@dataclasses.dataclass(frozen=True)
class OrchestratorGroupStatus:
    """llm-d's ``get_status()`` result: the group and its per-node job states."""

    group: _types.GroupStatus
    agent_job_states: list[_types.AgentJobStatus]


class OrchestratorError(errors.RPCError):
    """Root of the drop-in client's errors (llm-d name); also a tslice ``RPCError``."""

    default_status: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str = "", *, status: grpc.StatusCode | None = None) -> None:
        errors.RPCError.__init__(self, status or self.default_status, message)
        # llm-d's errors print as their bare message.
        self.args = (message,)


class OrchestratorConnectionError(OrchestratorError, errors.Unavailable):
    """The orchestrator could not be reached (UNAVAILABLE, after retries)."""

    default_status = grpc.StatusCode.UNAVAILABLE


class OrchestratorTimeoutError(OrchestratorError, errors.DeadlineExceeded):
    """The call's deadline passed (an acquire that timed out is no longer queued)."""

    default_status = grpc.StatusCode.DEADLINE_EXCEEDED


class OrchestratorInvalidArgumentError(OrchestratorError, errors.InvalidArgument):
    """An id was empty or malformed."""

    default_status = grpc.StatusCode.INVALID_ARGUMENT


class OrchestratorInternalError(OrchestratorError):
    """The orchestrator failed (INTERNAL or UNKNOWN)."""

    default_status = grpc.StatusCode.INTERNAL


class OrchestratorNotFoundError(OrchestratorError, errors.UnknownGroup):
    """tslice addition: the group does not exist (NOT_FOUND)."""

    default_status = grpc.StatusCode.NOT_FOUND


class OrchestratorPermissionDeniedError(OrchestratorError, errors.NotHolder):
    """tslice addition: release of a group another job holds (PERMISSION_DENIED)."""

    default_status = grpc.StatusCode.PERMISSION_DENIED


_BY_STATUS: dict[grpc.StatusCode, type[OrchestratorError]] = {
    grpc.StatusCode.UNAVAILABLE: OrchestratorConnectionError,
    grpc.StatusCode.DEADLINE_EXCEEDED: OrchestratorTimeoutError,
    grpc.StatusCode.INVALID_ARGUMENT: OrchestratorInvalidArgumentError,
    grpc.StatusCode.INTERNAL: OrchestratorInternalError,
    grpc.StatusCode.UNKNOWN: OrchestratorInternalError,
    grpc.StatusCode.NOT_FOUND: OrchestratorNotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: OrchestratorPermissionDeniedError,
}


def translate(err: errors.RPCError) -> OrchestratorError:
    """The llm-d-named error for a tslice RPC error (same status and message)."""
    if isinstance(err, OrchestratorError):
        return err
    cls = _BY_STATUS.get(err.status, OrchestratorError)
    translated = cls(err.message, status=err.status)
    for name in ("job_id", "group_id", "waited_ms"):
        if hasattr(err, name):
            setattr(translated, name, getattr(err, name))
    return translated


@contextlib.contextmanager
def _translated() -> Iterator[None]:
    try:
        yield
    except errors.RPCError as err:
        if isinstance(err, OrchestratorError):
            raise
        raise translate(err) from err


_Result_co = TypeVar("_Result_co", covariant=True)


class _JobCall(Protocol[_Result_co]):
    """``Client.acquire`` or ``Client.yield_``: a call by one job on one group."""

    def __call__(
        self, group: str | None = None, *, job_id: str | None = None, timeout: _config.Timeout = ...
    ) -> _Result_co: ...


def _timeout(timeout_sec: float | None) -> _config.Timeout:
    # llm-d's None meant "no deadline"; ours keeps that for acquire and gives the
    # other calls the client's bounded default instead of hanging on a dead server.
    return _config.USE_CLIENT_DEFAULT if timeout_sec is None else timeout_sec


class TimeSliceOrchestratorClient:
    """llm-d's orchestrator client API on top of :class:`tslice.Client`.

    ``target`` may be ``None`` to read ``$TSLICE_ORCHESTRATOR`` / ``$TIMESLICE_ORCH_ADDR``
    (and run as a no-op when neither is set).
    """

    def __init__(
        self,
        target: str | None,
        job_id: str | None = None,
        group_id: str | None = None,
        channel_options: Sequence[_config.ChannelOption] | None = None,
    ) -> None:
        self.target = target
        self.job_id = job_id
        self.group_id = group_id
        with _translated():
            # llm-d clients send no lease: the lock outlives the process, as there; and
            # they may name the job in each call (job_id=None: $TSLICE_JOB_ID if set).
            self._client = _client.Client(
                target, job_id=None, channel_options=channel_options, lease_s=None
            )

    @property
    def client(self) -> _client.Client:
        """The tslice client underneath (for the tslice-only features)."""
        return self._client

    def _job(self, job_id: str | None) -> str:
        resolved = job_id or self.job_id or self._client.job_id
        if not resolved:
            raise ValueError(
                "job_id must be given to the constructor or to the call (or set $TSLICE_JOB_ID)"
            )
        return resolved

    def _group(self, group_id: str | None) -> str:
        resolved = group_id or self.group_id
        if not resolved:
            raise ValueError("group_id must be given to the constructor or to the call")
        return resolved

    def acquire(
        self,
        job_id: str | None = None,
        group_id: str | None = None,
        timeout_sec: float | None = None,
    ) -> _types.AcquireResult:
        """Block until the job holds the group (``timeout_sec=None``: no deadline)."""
        return self._by_job(self._client.acquire, job_id, group_id, timeout_sec)

    def release(
        self,
        job_id: str | None = None,
        group_id: str | None = None,
        timeout_sec: float | None = None,
    ) -> _types.YieldResult:
        """Yield the group; returns at once."""
        return self._by_job(self._client.yield_, job_id, group_id, timeout_sec)

    def _by_job(
        self,
        call: _JobCall[_Result_co],
        job_id: str | None,
        group_id: str | None,
        timeout_sec: float | None,
    ) -> _Result_co:
        job, group = self._job(job_id), self._group(group_id)
        with _translated():
            return call(group, job_id=job, timeout=_timeout(timeout_sec))

    def get_status(
        self, group_id: str | None = None, timeout_sec: float | None = None
    ) -> OrchestratorGroupStatus:
        group = self._group(group_id)
        with _translated():
            status = self._client.status(group, timeout=_timeout(timeout_sec))
        return OrchestratorGroupStatus(group=status, agent_job_states=list(status.agent_job_states))

    def list_groups(self, timeout_sec: float | None = None) -> list[str]:
        with _translated():
            return list(self._client.list_groups(timeout=_timeout(timeout_sec)))

    @contextlib.contextmanager
    def on_accelerators(
        self,
        job_id: str | None = None,
        group_id: str | None = None,
        timeout_sec: float | None = None,
    ) -> Iterator[_types.AcquireResult]:
        """Hold the group for a ``with`` block (yields the AcquireResult) or, used as
        a decorator, for each call of the decorated function."""
        job, group = self._job(job_id), self._group(group_id)
        with _translated():
            held = self._client.slice(group, job_id=job, timeout=_timeout(timeout_sec))
            results = held.__enter__()
        try:
            yield results[group]
        except BaseException as exc:
            # Yields and only logs its own failure: the block's exception wins.
            held.__exit__(type(exc), exc, exc.__traceback__)
            raise
        with _translated():
            held.__exit__(None, None, None)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
