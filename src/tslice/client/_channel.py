"""The one wrapper every RPC of the client passes through.

Deadlines, metadata (``x-tslice-job-id``, ``x-tslice-client-version``), retry and
the translation of gRPC status codes into :mod:`tslice.common.errors` live here
and nowhere else. Above the transports sit thin per-service classes with one
typed method per RPC of the wire contract (a test checks that none is missing);
their ``stub`` attribute is the raw generated stub, the escape hatch.

The sync transport issues unary calls through ``.future()`` and waits on the
future: unlike a plain blocking call that wait is interruptible, and on Ctrl-C
the call is cancelled so that the orchestrator drops the waiter at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, cast

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tslice
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _config, _retry, _session
from tslice.client.compat import _unary
from tslice.common import errors

T = TypeVar("T")

# The generated stubs are untyped; the typed surface is the classes below.
_OrchestratorStub: Any = opb_grpc.TimeSliceOrchestratorServiceStub
_AgentStub: Any = pb_grpc.SnapshotAgentServiceStub
_HealthStub: Any = health_pb2_grpc.HealthStub

ORCHESTRATOR_SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
AGENT_SERVICE = "snapshot_agent.v1alpha1.SnapshotAgentService"
HEALTH_SERVICE = "grpc.health.v1.Health"

JOB_ID_HEADER = "x-tslice-job-id"
CLIENT_VERSION_HEADER = "x-tslice-client-version"

#: Channel options applied under the caller's (the caller's win on the same key).
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    # A blocked Acquire sends no data for minutes; keepalive notices a dead peer
    # (host gone, network cut). 60 s stays above what default servers tolerate: the
    # client sends at most 2 pings without data, one strike, no GOAWAY.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # The channel's own reconnect back-off starts at 1 s and grows to 120 s; after
    # an orchestrator restart our retries would keep failing fast until it fires.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


@dataclasses.dataclass(frozen=True)
class Method:
    """One RPC of the wire contract and whether re-issuing it is safe."""

    service: str
    name: str
    #: Safe to re-issue after UNAVAILABLE (idempotent, or the server dedups it).
    retryable: bool = False
    #: Codes that, answering a re-issued attempt, mean an earlier attempt took effect
    #: (its reply was lost with the connection); the call then returns ``settled()``.
    settled_codes: frozenset[grpc.StatusCode] = frozenset()
    settled: Callable[[], Any] | None = None


_ORCH = ORCHESTRATOR_SERVICE
ORCHESTRATOR_METHODS = {
    m.name: m
    for m in (
        # The orchestrator keeps a re-issued Acquire's place or recognises the holder.
        Method(_ORCH, "Acquire", retryable=True),
        # A Yield whose reply was lost may already have handed the group on: the
        # re-issued one then meets PERMISSION_DENIED, yet the job did let go.
        Method(
            _ORCH,
            "Yield",
            retryable=True,
            settled_codes=frozenset({grpc.StatusCode.PERMISSION_DENIED}),
            settled=lambda: opb.YieldResponse(success=True),
        ),
        Method(_ORCH, "ListGroups", retryable=True),
        Method(_ORCH, "GetGroupStatus", retryable=True),
        Method(_ORCH, "WatchEvents"),
        Method(_ORCH, "Session"),
        # The lease keeper (_lease) re-opens it with its own back-off.
        Method(_ORCH, "Hold"),
    )
}
AGENT_METHODS = {
    m.name: m
    for m in (
        # Snapshot/Restore have no request id: a lost reply cannot be recovered by
        # re-issuing (ABORTED / FAILED_PRECONDITION would follow), so never retried.
        Method(AGENT_SERVICE, "Snapshot"),
        Method(AGENT_SERVICE, "Restore"),
        Method(AGENT_SERVICE, "GetOperation", retryable=True),
        Method(AGENT_SERVICE, "Status", retryable=True),
        Method(AGENT_SERVICE, "WorkloadChannel"),
        Method(AGENT_SERVICE, "WaitOperation", retryable=True),
        # The agent ignores grants older than the last epoch.
        Method(AGENT_SERVICE, "Grant", retryable=True),
        Method(AGENT_SERVICE, "GrantStream"),
        Method(AGENT_SERVICE, "ResetJob", retryable=True),
    )
}
HEALTH_CHECK = Method(HEALTH_SERVICE, "Check", retryable=True)


def channel_options(user: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    """Our defaults merged under ``user`` (same key: the user's value wins)."""
    given = list(user or ())
    keys = {key for key, _ in given}
    return [item for item in DEFAULT_CHANNEL_OPTIONS if item[0] not in keys] + given


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """Per-call settings for one RPC."""

    #: Deadline of the whole call, retries included, in seconds (``None`` = none).
    timeout: float | None = None
    #: Sent as ``x-tslice-job-id`` so that server logs name the caller.
    job_id: str | None = None
    #: Lets NOT_FOUND become :class:`~tslice.common.errors.UnknownGroup`.
    group_id: str | None = None
    #: ``None`` = the transport's policy.
    retry: _retry.RetryPolicy | None = None


_NO_OPTIONS = CallOptions()

# The first connection is proven by any answer to a health check (every server has
# the method or answers UNIMPLEMENTED); wait_for_ready makes it wait out refusals.
_PROBE = health_pb2.HealthCheckRequest()
_NOT_CONNECTED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _last_probe_s(budget: float) -> float:
    """The end of the connect budget kept for a last probe without wait_for_ready: it
    fails at once, saying why (refused, no such host), where the waiting one cannot."""
    return min(0.2, budget / 4)


class _Transport:
    """What the sync and async transports share: metadata, attempt planning, and the
    bound on the first connection.

    Until the channel has been ready once, a call first waits for it, at most
    ``connect_timeout`` (and never past the call's deadline): an address where nothing
    answers then fails with a clear :class:`~tslice.common.errors.Unavailable` instead
    of being retried silently. Once connected, UNAVAILABLE is retried as the method
    allows (an orchestrator restart is ridden out).
    """

    def __init__(
        self,
        *,
        target: str,
        retry: _retry.RetryPolicy,
        connect_timeout: float | None = None,
        peer: str = "the server",
    ) -> None:
        self.target = target
        self.retry = retry
        self.connect_timeout = connect_timeout
        self.peer = peer
        self._connected = connect_timeout is None

    def connect_budget(self, call_timeout: float | None) -> float | None:
        """How long to wait for the first connection (None: no need, it happened)."""
        if self._connected or self.connect_timeout is None:
            return None
        return (
            self.connect_timeout
            if call_timeout is None
            else min(call_timeout, self.connect_timeout)
        )

    def connected(self) -> None:
        self._connected = True

    def not_connected(self, waited_s: float, last: grpc.RpcError) -> errors.Unavailable:
        """The error of a first connection that did not happen; ``last`` says why."""
        reason = (
            last.details()
            if last.code() == grpc.StatusCode.UNAVAILABLE
            else "the connection was not completed"
        )
        return errors.Unavailable(
            grpc.StatusCode.UNAVAILABLE,
            f"failed to connect to {self.peer} at {self.target} within {waited_s:.3g} s"
            + (f" ({reason})" if reason else "")
            + ": is it running, and is the address right? "
            f"(${_config.CONNECT_TIMEOUT_ENV} waits longer)",
        )

    def metadata(self, options: CallOptions) -> tuple[tuple[str, str], ...]:
        items = [(CLIENT_VERSION_HEADER, tslice.__version__)]
        if options.job_id:
            items.append((JOB_ID_HEADER, options.job_id))
        return tuple(items)

    def attempts(self, method: Method, options: CallOptions) -> _retry.Attempts:
        return _retry.Attempts(
            method=method.name,
            target=self.target,
            retryable=method.retryable,
            settled_codes=method.settled_codes,
            policy=options.retry or self.retry,
            timeout=options.timeout,
            group_id=options.group_id,
        )


def _settled(method: Method) -> Any:
    assert method.settled is not None, f"{method.name} declares no settled response"
    return method.settled()


class SyncStream(Generic[T]):
    """Responses of a streaming call; errors arrive as tslice errors; ``cancel()`` ends it."""

    def __init__(self, call: Any, *, group_id: str | None = None) -> None:
        self._call = call
        self._group_id = group_id
        self._cancelled = False

    def __iter__(self) -> Iterator[T]:
        try:
            for item in self._call:
                yield cast(T, item)
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise errors.from_grpc(err, group_id=self._group_id) from err

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()

    def started(self) -> None:
        """Block until the server has answered with its headers (or the call failed: the
        iteration raises the error)."""
        with contextlib.suppress(grpc.RpcError):
            self._call.initial_metadata()


class AsyncStream(Generic[T]):
    """Async twin of :class:`SyncStream`; the call starts at the first ``async for`` or
    ``started()``, once the transport is connected."""

    def __init__(
        self,
        open_call: Callable[[], Any],
        *,
        connect: Callable[[], Awaitable[None]],
        group_id: str | None = None,
    ) -> None:
        self._open_call = open_call
        self._connect = connect
        self._call: Any = None
        self._group_id = group_id
        self._cancelled = False

    async def _opened(self) -> Any:
        if self._call is None:
            await self._connect()
            self._call = self._open_call()
            if self._cancelled:
                self._call.cancel()
        return self._call

    async def __aiter__(self) -> AsyncIterator[T]:
        try:
            async for item in await self._opened():
                yield cast(T, item)
        except grpc.RpcError as err:
            if self._cancelled and err.code() == grpc.StatusCode.CANCELLED:
                return
            raise errors.from_grpc(err, group_id=self._group_id) from err
        except asyncio.CancelledError:
            if not self._cancelled:
                raise

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    async def started(self) -> None:
        """See :meth:`SyncStream.started`."""
        call = await self._opened()
        with contextlib.suppress(grpc.RpcError):
            await call.initial_metadata()


class SyncTransport(_Transport):
    """Runs RPCs on a ``grpc.Channel`` (blocking)."""

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        target: str,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        sleep: Callable[[float], None] = time.sleep,
        connect_timeout: float | None = None,
        peer: str = "the server",
    ) -> None:
        super().__init__(target=target, retry=retry, connect_timeout=connect_timeout, peer=peer)
        self.channel = channel
        self._sleep = sleep

    def connect(self, call_timeout: float | None) -> None:
        """Wait for the first connection (see :class:`_Transport`)."""
        budget = self.connect_budget(call_timeout)
        if budget is None:
            return
        probe = _HealthStub(self.channel).Check
        try:
            self._once(probe, _PROBE, budget - _last_probe_s(budget), (), wait_for_ready=True)
        except grpc.RpcError as err:
            if err.code() in _NOT_CONNECTED:
                last = self._last_error(probe, _last_probe_s(budget))
                if last is not None and last.code() in _NOT_CONNECTED:
                    raise self.not_connected(budget, last) from err
        # Any answer, if only a refusal, proves the connection.
        self.connected()

    def _last_error(self, probe: Any, timeout: float) -> grpc.RpcError | None:
        try:
            self._once(probe, _PROBE, timeout, ())
        except grpc.RpcError as err:
            return err
        return None

    def unary(self, method: Method, call: Any, request: Any, options: CallOptions) -> Any:
        attempts = self.attempts(method, options)
        metadata = self.metadata(options)
        self.connect(attempts.attempt_timeout())
        while True:
            try:
                response = self._once(call, request, attempts.attempt_timeout(), metadata)
            except grpc.RpcError as err:
                delay = attempts.after_error(err)
            else:
                attempts.succeeded()
                return response
            if delay is None:
                return _settled(method)
            self._sleep(delay)

    @staticmethod
    def _once(
        call: Any,
        request: Any,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...],
        **flags: bool,
    ) -> Any:
        future = call.future(request, timeout=timeout, metadata=metadata, **flags)
        try:
            return future.result()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: make sure the server sees the caller leave.
            future.cancel()
            raise

    def unary_stream(
        self, method: Method, call: Any, request: Any, options: CallOptions
    ) -> SyncStream[Any]:
        # Streams are never retried: only the caller knows how to resume one.
        self.connect(options.timeout)
        stream = call(request, timeout=options.timeout, metadata=self.metadata(options))
        return SyncStream(stream, group_id=options.group_id)

    def stream_stream(
        self, method: Method, call: Any, requests: Iterable[Any], options: CallOptions
    ) -> SyncStream[Any]:
        self.connect(options.timeout)
        stream = call(iter(requests), timeout=options.timeout, metadata=self.metadata(options))
        return SyncStream(stream, group_id=options.group_id)


class AsyncTransport(_Transport):
    """Runs RPCs on a ``grpc.aio.Channel``; differs from :class:`SyncTransport` only in awaiting."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        *,
        target: str,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        connect_timeout: float | None = None,
        peer: str = "the server",
    ) -> None:
        super().__init__(target=target, retry=retry, connect_timeout=connect_timeout, peer=peer)
        self.channel = channel

    async def connect(self, call_timeout: float | None) -> None:
        """Wait for the first connection (see :class:`_Transport`)."""
        budget = self.connect_budget(call_timeout)
        if budget is None:
            return
        probe = _HealthStub(self.channel).Check
        try:
            await probe(_PROBE, timeout=budget - _last_probe_s(budget), wait_for_ready=True)
        except grpc.RpcError as err:
            if err.code() in _NOT_CONNECTED:
                last = await self._last_error(probe, _last_probe_s(budget))
                if last is not None and last.code() in _NOT_CONNECTED:
                    raise self.not_connected(budget, last) from err
        # Any answer, if only a refusal, proves the connection.
        self.connected()

    @staticmethod
    async def _last_error(probe: Any, timeout: float) -> grpc.RpcError | None:
        try:
            await probe(_PROBE, timeout=timeout)
        except grpc.RpcError as err:
            return err
        return None

    async def unary(self, method: Method, call: Any, request: Any, options: CallOptions) -> Any:
        attempts = self.attempts(method, options)
        metadata = self.metadata(options)
        await self.connect(attempts.attempt_timeout())
        while True:
            try:
                response = await call(
                    request, timeout=attempts.attempt_timeout(), metadata=metadata
                )
            except grpc.RpcError as err:
                delay = attempts.after_error(err)
            else:
                attempts.succeeded()
                return response
            if delay is None:
                return _settled(method)
            await asyncio.sleep(delay)

    def unary_stream(
        self, method: Method, call: Any, request: Any, options: CallOptions
    ) -> AsyncStream[Any]:
        return AsyncStream(
            lambda: call(request, timeout=options.timeout, metadata=self.metadata(options)),
            connect=lambda: self.connect(options.timeout),
            group_id=options.group_id,
        )

    def stream_stream(
        self, method: Method, call: Any, requests: Any, options: CallOptions
    ) -> AsyncStream[Any]:
        return AsyncStream(
            lambda: call(requests, timeout=options.timeout, metadata=self.metadata(options)),
            connect=lambda: self.connect(options.timeout),
            group_id=options.group_id,
        )


_O = ORCHESTRATOR_METHODS
_A = AGENT_METHODS


class OrchestratorCalls:
    """One blocking method per orchestrator RPC."""

    def __init__(self, transport: SyncTransport) -> None:
        self.transport = transport
        self.stub = _OrchestratorStub(transport.channel)
        # Acquire and Yield go over one Session stream (unary where there is none).
        self._session = _session.SyncSession(self.stub, metadata=transport.metadata(_NO_OPTIONS))
        self._acquire = _unary.SyncUnaryFallback(self._session.acquire, self.stub.Acquire)
        self._yield = _unary.SyncUnaryFallback(self._session.yield_, self.stub.Yield)

    def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        self._session.close()

    def acquire(
        self, request: opb.AcquireRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.AcquireResponse:
        return cast(
            opb.AcquireResponse,
            self.transport.unary(_O["Acquire"], self._acquire, request, options),
        )

    def yield_(
        self, request: opb.YieldRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.YieldResponse:
        return cast(
            opb.YieldResponse,
            self.transport.unary(_O["Yield"], self._yield, request, options),
        )

    def list_groups(
        self, request: opb.ListGroupsRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.ListGroupsResponse:
        return cast(
            opb.ListGroupsResponse,
            self.transport.unary(_O["ListGroups"], self.stub.ListGroups, request, options),
        )

    def get_group_status(
        self, request: opb.GetGroupStatusRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.GetGroupStatusResponse:
        return cast(
            opb.GetGroupStatusResponse,
            self.transport.unary(_O["GetGroupStatus"], self.stub.GetGroupStatus, request, options),
        )

    def watch_events(
        self, request: opb.WatchEventsRequest, options: CallOptions = _NO_OPTIONS
    ) -> SyncStream[opb.OrchestratorEvent]:
        return self.transport.unary_stream(
            _O["WatchEvents"], self.stub.WatchEvents, request, options
        )

    def hold(
        self, request: opb.HoldRequest, options: CallOptions = _NO_OPTIONS
    ) -> SyncStream[opb.HoldEvent]:
        return self.transport.unary_stream(_O["Hold"], self.stub.Hold, request, options)

    def session(
        self, requests: Iterable[opb.SessionRequest], options: CallOptions = _NO_OPTIONS
    ) -> SyncStream[opb.SessionResponse]:
        """The raw Session stream (acquire() and yield_() already use one of their own)."""
        return self.transport.stream_stream(_O["Session"], self.stub.Session, requests, options)


class AsyncOrchestratorCalls:
    """One coroutine per orchestrator RPC."""

    def __init__(self, transport: AsyncTransport) -> None:
        self.transport = transport
        self.stub = _OrchestratorStub(transport.channel)
        # Acquire and Yield go over one Session stream (unary where there is none).
        self._session = _session.Session(self.stub, metadata=transport.metadata(_NO_OPTIONS))
        self._acquire = _unary.UnaryFallback(self._session.acquire, self.stub.Acquire)
        self._yield = _unary.UnaryFallback(self._session.yield_, self.stub.Yield)

    async def acquire(
        self, request: opb.AcquireRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.AcquireResponse:
        return cast(
            opb.AcquireResponse,
            await self.transport.unary(_O["Acquire"], self._acquire, request, options),
        )

    async def yield_(
        self, request: opb.YieldRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.YieldResponse:
        return cast(
            opb.YieldResponse,
            await self.transport.unary(_O["Yield"], self._yield, request, options),
        )

    async def list_groups(
        self, request: opb.ListGroupsRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.ListGroupsResponse:
        return cast(
            opb.ListGroupsResponse,
            await self.transport.unary(_O["ListGroups"], self.stub.ListGroups, request, options),
        )

    async def get_group_status(
        self, request: opb.GetGroupStatusRequest, options: CallOptions = _NO_OPTIONS
    ) -> opb.GetGroupStatusResponse:
        return cast(
            opb.GetGroupStatusResponse,
            await self.transport.unary(
                _O["GetGroupStatus"], self.stub.GetGroupStatus, request, options
            ),
        )

    def watch_events(
        self, request: opb.WatchEventsRequest, options: CallOptions = _NO_OPTIONS
    ) -> AsyncStream[opb.OrchestratorEvent]:
        return self.transport.unary_stream(
            _O["WatchEvents"], self.stub.WatchEvents, request, options
        )

    def hold(
        self, request: opb.HoldRequest, options: CallOptions = _NO_OPTIONS
    ) -> AsyncStream[opb.HoldEvent]:
        return self.transport.unary_stream(_O["Hold"], self.stub.Hold, request, options)

    def session(
        self, requests: Any, options: CallOptions = _NO_OPTIONS
    ) -> AsyncStream[opb.SessionResponse]:
        """The raw Session stream (acquire() and yield_() already use one of their own)."""
        return self.transport.stream_stream(_O["Session"], self.stub.Session, requests, options)

    async def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        await self._session.close()


class AgentCalls:
    """One blocking method per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: SyncTransport) -> None:
        self.transport = transport
        self.stub = _AgentStub(transport.channel)
        self.health_stub = _HealthStub(transport.channel)

    def snapshot(
        self, request: pb.SnapshotRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.SnapshotResponse:
        return cast(
            pb.SnapshotResponse,
            self.transport.unary(_A["Snapshot"], self.stub.Snapshot, request, options),
        )

    def restore(
        self, request: pb.RestoreRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.RestoreResponse:
        return cast(
            pb.RestoreResponse,
            self.transport.unary(_A["Restore"], self.stub.Restore, request, options),
        )

    def get_operation(
        self, request: pb.GetOperationRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GetOperationResponse:
        return cast(
            pb.GetOperationResponse,
            self.transport.unary(_A["GetOperation"], self.stub.GetOperation, request, options),
        )

    def status(
        self, request: pb.StatusRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.StatusResponse:
        return cast(
            pb.StatusResponse,
            self.transport.unary(_A["Status"], self.stub.Status, request, options),
        )

    def workload_channel(
        self, requests: Iterable[pb.WorkloadMessage], options: CallOptions = _NO_OPTIONS
    ) -> SyncStream[pb.AgentCommand]:
        return self.transport.stream_stream(
            _A["WorkloadChannel"], self.stub.WorkloadChannel, requests, options
        )

    def wait_operation(
        self, request: pb.WaitOperationRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GetOperationResponse:
        return cast(
            pb.GetOperationResponse,
            self.transport.unary(_A["WaitOperation"], self.stub.WaitOperation, request, options),
        )

    def grant(
        self, request: pb.GrantRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GrantResponse:
        return cast(
            pb.GrantResponse,
            self.transport.unary(_A["Grant"], self.stub.Grant, request, options),
        )

    def grant_stream(
        self, requests: Iterable[pb.GrantStreamRequest], options: CallOptions = _NO_OPTIONS
    ) -> SyncStream[pb.GrantStreamResponse]:
        return self.transport.stream_stream(
            _A["GrantStream"], self.stub.GrantStream, requests, options
        )

    def reset_job(
        self, request: pb.ResetJobRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.ResetJobResponse:
        return cast(
            pb.ResetJobResponse,
            self.transport.unary(_A["ResetJob"], self.stub.ResetJob, request, options),
        )

    def check_health(
        self, request: health_pb2.HealthCheckRequest, options: CallOptions = _NO_OPTIONS
    ) -> health_pb2.HealthCheckResponse:
        return cast(
            health_pb2.HealthCheckResponse,
            self.transport.unary(HEALTH_CHECK, self.health_stub.Check, request, options),
        )


class AsyncAgentCalls:
    """One coroutine per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: AsyncTransport) -> None:
        self.transport = transport
        self.stub = _AgentStub(transport.channel)
        self.health_stub = _HealthStub(transport.channel)

    async def snapshot(
        self, request: pb.SnapshotRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.SnapshotResponse:
        return cast(
            pb.SnapshotResponse,
            await self.transport.unary(_A["Snapshot"], self.stub.Snapshot, request, options),
        )

    async def restore(
        self, request: pb.RestoreRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.RestoreResponse:
        return cast(
            pb.RestoreResponse,
            await self.transport.unary(_A["Restore"], self.stub.Restore, request, options),
        )

    async def get_operation(
        self, request: pb.GetOperationRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GetOperationResponse:
        return cast(
            pb.GetOperationResponse,
            await self.transport.unary(
                _A["GetOperation"], self.stub.GetOperation, request, options
            ),
        )

    async def status(
        self, request: pb.StatusRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.StatusResponse:
        return cast(
            pb.StatusResponse,
            await self.transport.unary(_A["Status"], self.stub.Status, request, options),
        )

    def workload_channel(
        self, requests: Any, options: CallOptions = _NO_OPTIONS
    ) -> AsyncStream[pb.AgentCommand]:
        return self.transport.stream_stream(
            _A["WorkloadChannel"], self.stub.WorkloadChannel, requests, options
        )

    async def wait_operation(
        self, request: pb.WaitOperationRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GetOperationResponse:
        return cast(
            pb.GetOperationResponse,
            await self.transport.unary(
                _A["WaitOperation"], self.stub.WaitOperation, request, options
            ),
        )

    async def grant(
        self, request: pb.GrantRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.GrantResponse:
        return cast(
            pb.GrantResponse,
            await self.transport.unary(_A["Grant"], self.stub.Grant, request, options),
        )

    def grant_stream(
        self, requests: Any, options: CallOptions = _NO_OPTIONS
    ) -> AsyncStream[pb.GrantStreamResponse]:
        return self.transport.stream_stream(
            _A["GrantStream"], self.stub.GrantStream, requests, options
        )

    async def reset_job(
        self, request: pb.ResetJobRequest, options: CallOptions = _NO_OPTIONS
    ) -> pb.ResetJobResponse:
        return cast(
            pb.ResetJobResponse,
            await self.transport.unary(_A["ResetJob"], self.stub.ResetJob, request, options),
        )

    async def check_health(
        self, request: health_pb2.HealthCheckRequest, options: CallOptions = _NO_OPTIONS
    ) -> health_pb2.HealthCheckResponse:
        return cast(
            health_pb2.HealthCheckResponse,
            await self.transport.unary(HEALTH_CHECK, self.health_stub.Check, request, options),
        )
