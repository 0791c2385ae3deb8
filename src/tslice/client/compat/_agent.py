"""Drop-in ``SnapshotAgentClient`` with llm-d's methods, types and error.

Beyond llm-d: every call has a deadline; read-only calls are retried on
UNAVAILABLE (Snapshot/Restore are not: the wire has no request id to dedup them);
``wait_for_operation`` uses tslice's ``WaitOperation`` long-poll when the agent
has it (one round trip per operation instead of one per second) and falls back
to polling ``GetOperation`` on UNIMPLEMENTED; it also takes a ``timeout_sec``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.client import _address, _channel, _config, _retry, _services, _streams
from tslice.client.compat import _agent_types as types
from tslice.common import errors

T = TypeVar("T")

#: Longest single WaitOperation long-poll; the agent answers PENDING after it.
WAIT_CHUNK_MS = 30_000


class SnapshotAgentError(errors.RPCError):
    """Every failure of :class:`SnapshotAgentClient` (llm-d name and attributes).

    ``code`` is the ``grpc.StatusCode`` (``None`` for a client-side failure) and
    ``details`` the server's message; it is also a tslice ``RPCError``.
    """

    def __init__(
        self,
        message: str,
        code: grpc.StatusCode | None = None,
        details: str | None = None,
    ) -> None:
        errors.RPCError.__init__(
            self, code or grpc.StatusCode.UNKNOWN, details if details is not None else message
        )
        self.args = (message,)
        self.code = code
        self.details = details


def _backend_enum(backend: str | int | None, config: pb.BackendConfig | None) -> int:
    """The deprecated ``backend`` field, still sent for llm-d agents that read it."""
    if config is not None:
        return pb.BACKEND_CUDA if config.HasField("cuda") else pb.BACKEND_UNSPECIFIED
    if backend is None or isinstance(backend, int):
        return backend or pb.BACKEND_UNSPECIFIED
    for name in (backend, f"BACKEND_{backend.upper()}"):
        try:
            return pb.Backend.Value(name)
        except ValueError:
            continue
    raise ValueError(f"unknown backend {backend!r}; use 'cuda' or pass backend_config=")


_Operation = TypeVar("_Operation", pb.SnapshotRequest, pb.RestoreRequest)


def _operation_request(
    kind: type[_Operation],
    job_id: str,
    group: str,
    backend_config: pb.BackendConfig | None,
    backend: str | int | None,
) -> _Operation:
    """A Snapshot or Restore request (they have the same fields)."""
    return kind(
        job_id=job_id,
        group=group,
        backend=pb.Backend.Name(_backend_enum(backend, backend_config)),
        backend_config=backend_config,
    )


class SnapshotAgentClient:
    """Client of one node's snapshot agent (llm-d API).

    Give either ``endpoint`` (``"host:9001"``; the client owns and closes its channel)
    or an existing ``channel`` (not closed by :meth:`close`).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        channel: grpc.Channel | None = None,
        *,
        timeout_sec: float = _config.DEFAULT_CALL_TIMEOUT_S,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        channel_options: Sequence[_config.ChannelOption] | None = None,
        connect_timeout_sec: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> None:
        if channel is None and not endpoint:
            raise ValueError("Either 'endpoint' or 'channel' must be provided.")
        target = (
            _address.grpc_target(endpoint, default_port=_address.AGENT_PORT, source="endpoint")
            if channel is None and endpoint
            else endpoint or "the given channel"
        )
        server = _channel.Endpoint(
            target=target,
            peer="the snapshot agent",
            retry=retry,
            connect_timeout=_config.resolve_connect_timeout(connect_timeout_sec),
            channel_options=tuple(channel_options or ()),
        )
        self._own_channel = channel is None
        self.channel = server.channel() if channel is None else channel
        self.endpoint = endpoint
        _config.check_timeout("timeout_sec", timeout_sec)
        self._timeout = timeout_sec
        self._calls = _services.AgentCalls(_channel.SyncTransport(self.channel, server))
        self.stub = self._calls.stub
        # None: not tried yet; False: the agent answered UNIMPLEMENTED (an llm-d agent).
        self._long_poll: bool | None = None

    def _options(
        self, timeout: float | None = None, job_id: str | None = None
    ) -> _channel.CallOptions:
        return _channel.CallOptions(timeout=timeout or self._timeout, job_id=job_id or None)

    @staticmethod
    def _call(method: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except SnapshotAgentError:
            raise
        except errors.RPCError as err:
            raise SnapshotAgentError(
                f"gRPC error calling {method}: {err.status} - {err.message}",
                code=err.status,
                details=err.message,
            ) from err
        except Exception as err:
            # llm-d wraps everything (e.g. a call on a closed channel) the same way.
            raise SnapshotAgentError(f"Unexpected error in {method}: {err}") from err

    # -- the RPCs ---------------------------------------------------------------------

    def snapshot(
        self,
        job_id: str,
        group: str = "",
        backend_config: pb.BackendConfig | None = None,
        *,
        backend: str | int | None = None,
    ) -> types.SnapshotResponse:
        """Start a snapshot of ``job_id``; poll the returned operation id."""
        request = _operation_request(pb.SnapshotRequest, job_id, group, backend_config, backend)
        return types.SnapshotResponse(self._start("Snapshot", self._calls.snapshot, request))

    def restore(
        self,
        job_id: str,
        group: str = "",
        backend_config: pb.BackendConfig | None = None,
        *,
        backend: str | int | None = None,
    ) -> types.RestoreResponse:
        """Start a restore of ``job_id``; poll the returned operation id."""
        request = _operation_request(pb.RestoreRequest, job_id, group, backend_config, backend)
        return types.RestoreResponse(self._start("Restore", self._calls.restore, request))

    def _start(
        self,
        method: str,
        send: Callable[
            [_Operation, _channel.CallOptions], pb.SnapshotResponse | pb.RestoreResponse
        ],
        request: _Operation,
    ) -> str:
        """Send a Snapshot or Restore; the id of the operation it started."""
        options = self._options(job_id=request.job_id)
        return self._call(method, lambda: send(request, options)).operation_id

    def get_operation(self, operation_id: str) -> types.GetOperationResponse:
        request = pb.GetOperationRequest(operation_id=operation_id)
        response = self._call(
            "GetOperation", lambda: self._calls.get_operation(request, self._options())
        )
        return types.operation(response)

    def status(self) -> types.StatusResponse:
        response = self._call(
            "Status", lambda: self._calls.status(pb.StatusRequest(), self._options())
        )
        return types.status(response)

    def check_health(self, service: str = "") -> types.HealthResponse:
        """Standard gRPC health check; ``service`` = "" (default backend) or a backend name."""
        request = _streams.HealthCheckRequest(value=service)
        response = self._call(
            "CheckHealth", lambda: self._calls.check_health(request, self._options())
        )
        return types.HealthResponse(
            status=_streams.SERVING_STATUS.get(response.value, str(response.value))
        )

    @property
    def health_stub(self) -> Any:
        """llm-d's raw ``grpc.health.v1`` stub; needs grpcio-health-checking
        (``pip install 'tslice[server]'``), which the job side does without."""
        try:
            from grpc_health.v1 import health_pb2_grpc
        except ImportError as err:
            raise ImportError(
                "SnapshotAgentClient.health_stub needs grpcio-health-checking: "
                "pip install 'tslice[server]' (check_health() works without it)"
            ) from err
        return health_pb2_grpc.HealthStub(self.channel)

    # -- tslice additions ------------------------------------------------------------------

    def grant(
        self,
        job_id: str,
        group: str = "",
        *,
        grant_epoch: int = 0,
        footprint_bytes: int = 0,
        backend_config: pb.BackendConfig | None = None,
    ) -> str:
        """Tell the agent ``job_id`` was granted its group; returns the job state name."""
        request = pb.GrantRequest(
            job_id=job_id,
            group=group,
            grant_epoch=grant_epoch,
            footprint_bytes=footprint_bytes,
            backend_config=backend_config,
        )
        response = self._call(
            "Grant", lambda: self._calls.grant(request, self._options(job_id=job_id))
        )
        return types.job_state_name(response.state)

    def reset_job(self, job_id: str) -> str:
        """Clear a FAULTED job; returns its new state name (IDLE, or SAVED)."""
        request = pb.ResetJobRequest(job_id=job_id)
        response = self._call(
            "ResetJob", lambda: self._calls.reset_job(request, self._options(job_id=job_id))
        )
        return types.job_state_name(response.state)

    # -- waiting ---------------------------------------------------------------------------

    def wait_for_operation(
        self,
        operation_id: str,
        poll_interval_sec: float = 1.0,
        timeout_sec: float | None = None,
    ) -> types.GetOperationResponse:
        """Wait until the operation is COMPLETE or FAILED and return it (FAILED is not raised).

        ``timeout_sec`` (``None`` = no limit) raises :class:`SnapshotAgentError` with
        ``DEADLINE_EXCEEDED`` when the operation is still PENDING at the deadline.
        """
        deadline = None if timeout_sec is None else time.monotonic() + timeout_sec
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            operation = self._wait_once(operation_id, left)
            polled = operation is None
            if operation is None:
                operation = self.get_operation(operation_id)
            if operation.finished:
                return operation
            self._raise_if_late(operation_id, deadline, timeout_sec, operation)
            if polled:
                time.sleep(poll_interval_sec if left is None else min(poll_interval_sec, left))

    def _wait_once(
        self, operation_id: str, left: float | None
    ) -> types.GetOperationResponse | None:
        """One WaitOperation long-poll; ``None`` when the agent does not have it."""
        if self._long_poll is False:
            return None
        chunk_ms = WAIT_CHUNK_MS if left is None else min(WAIT_CHUNK_MS, int(left * 1000))
        request = pb.WaitOperationRequest(operation_id=operation_id, timeout_ms=chunk_ms)
        # The RPC may take the whole chunk by design: its deadline is chunk + the usual.
        options = self._options(timeout=chunk_ms / 1000 + self._timeout)
        try:
            response = self._call(
                "WaitOperation", lambda: self._calls.wait_operation(request, options)
            )
        except SnapshotAgentError as err:
            if err.code == grpc.StatusCode.UNIMPLEMENTED and self._long_poll is None:
                self._long_poll = False
                return None
            raise
        self._long_poll = True
        return types.operation(response)

    @staticmethod
    def _raise_if_late(
        operation_id: str,
        deadline: float | None,
        timeout_sec: float | None,
        operation: types.GetOperationResponse,
    ) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            message = f"operation {operation_id} is still {operation.status} after {timeout_sec} s"
            raise SnapshotAgentError(
                message, code=grpc.StatusCode.DEADLINE_EXCEEDED, details=message
            )

    def snapshot_and_wait(
        self,
        job_id: str,
        group: str = "",
        poll_interval_sec: float = 1.0,
        backend_config: pb.BackendConfig | None = None,
        *,
        timeout_sec: float | None = None,
    ) -> types.GetOperationResponse:
        """Snapshot and wait; a FAILED operation is returned, not raised (as llm-d)."""
        started = self.snapshot(job_id, group, backend_config=backend_config)
        return self.wait_for_operation(started.operation_id, poll_interval_sec, timeout_sec)

    def restore_and_wait(
        self,
        job_id: str,
        group: str = "",
        poll_interval_sec: float = 1.0,
        backend_config: pb.BackendConfig | None = None,
        *,
        timeout_sec: float | None = None,
    ) -> types.GetOperationResponse:
        """Restore and wait; a FAILED operation is returned, not raised (as llm-d)."""
        started = self.restore(job_id, group, backend_config=backend_config)
        return self.wait_for_operation(started.operation_id, poll_interval_sec, timeout_sec)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the channel if this client created it."""
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> SnapshotAgentClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
