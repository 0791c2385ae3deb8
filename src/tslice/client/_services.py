"""One typed method per RPC of the wire contract, for each service, sync and async.

Each RPC is declared once, as a descriptor whose type arguments are its request and
reply messages (a test checks them, and that no RPC is missing, against the proto
descriptors); read on a sync calls object it is a blocking method, on an async one a
coroutine method. Either way the call goes through the transport
(:mod:`tslice.client._channel`), which times, retries and translates it. ``stub`` is
the raw generated stub, the escape hatch.

Acquire and Yield go over the orchestrator's Session stream (:mod:`tslice.client._session`);
a channel whose orchestrator has none (llm-d's) takes llm-d's unary calls instead. That
is decided once per channel, by the first Acquire or Yield (:class:`_SyncFirstLockCall`,
:class:`_AsyncFirstLockCall`), which then puts the chosen methods in place: no later
call tries one and falls back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Generic, TypeAlias, TypeVar, overload

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _channel, _session, _streams
from tslice.client._channel import CallOptions, Method
from tslice.client._streams import HealthCheckRequest, HealthCheckResponse
from tslice.client.compat import _unary
from tslice.common import errors
from tslice.rpc import multiplex

Req = TypeVar("Req")
Rep = TypeVar("Rep")

ORCHESTRATOR_SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
AGENT_SERVICE = "snapshot_agent.v1alpha1.SnapshotAgentService"
HEALTH_SERVICE = "grpc.health.v1.Health"

_ORCH = ORCHESTRATOR_SERVICE
ORCHESTRATOR_METHODS = {
    m.name: m
    for m in (
        # The orchestrator keeps a re-issued Acquire's place or recognises the holder.
        Method(_ORCH, "Acquire", retryable=True),
        # Likewise for each group of the set: a re-issued AcquireSet re-attaches to its
        # queue entries (and a group already granted to the job counts as granted).
        Method(_ORCH, "AcquireSet", retryable=True),
        # A Yield whose reply was lost may already have handed the group on: the
        # re-issued one then meets PERMISSION_DENIED, yet the job did let go (when it
        # no longer holds the group: a refusal of its identity leaves it holding).
        Method(
            _ORCH,
            "Yield",
            retryable=True,
            settled_codes=frozenset({grpc.StatusCode.PERMISSION_DENIED}),
        ),
        Method(_ORCH, "ListGroups", retryable=True),
        Method(_ORCH, "GetGroupStatus", retryable=True),
        Method(_ORCH, "WatchEvents"),
        Method(_ORCH, "Session"),
        # The lease keeper (_lease) re-opens it with its own back-off.
        Method(_ORCH, "Hold"),
        # Not re-issued: after a lost reply the second answer would say nothing was
        # cleared, and the operator must see what the first one did.
        Method(_ORCH, "ClearDegraded"),
        # Not re-issued either: a second Evict after a lost reply would meet NOT_FOUND,
        # and the operator must see what the first one did (a Drain likewise).
        Method(_ORCH, "Evict"),
        Method(_ORCH, "Drain"),
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
        # An administrator's: not re-issued (the operator must see what the first did).
        Method(AGENT_SERVICE, "ResetLeaderTerm"),
    )
}
HEALTH_CHECK = Method(HEALTH_SERVICE, "Check", retryable=True)


_LET_GO = opb.YieldResponse(success=True)
#: Deadline of the status read that confirms a re-issued Yield's refusal (seconds).
_CONFIRM_S = 10.0


_CONFIRMING = CallOptions(timeout=_CONFIRM_S)


def _still_holds(request: opb.YieldRequest, status: opb.GetGroupStatusResponse) -> bool:
    return status.group.locking_job == request.job_id


# -- the calls objects ----------------------------------------------------------------------


class SyncCalls:
    """Blocking calls of one service over a sync transport."""

    def __init__(self, transport: _channel.SyncTransport, stub: Any) -> None:
        self.transport = transport
        self.stub = stub
        self._check = _streams.health_check(transport.channel)


class AsyncCalls:
    """Coroutine calls of one service over an async transport."""

    def __init__(self, transport: _channel.AsyncTransport, stub: Any) -> None:
        self.transport = transport
        self.stub = stub
        self._check = _streams.health_check(transport.channel)


_Calls: TypeAlias = SyncCalls | AsyncCalls


class _Rpc(Generic[Req, Rep]):
    """One RPC: the transport's method for it, and what it calls (the stub's method of
    the same name, or the calls object's attribute ``via``)."""

    def __init__(self, method: Method, *, via: str = "", settled: str = "") -> None:
        self.method = method
        self.via = via
        #: The calls object's method that confirms a settled answer (``Method.settled_codes``).
        self.settled = settled

    def target(self, calls: _Calls) -> Any:
        return getattr(calls, self.via) if self.via else getattr(calls.stub, self.method.name)


class Unary(_Rpc[Req, Rep]):
    @overload
    def __get__(self, calls: SyncCalls, owner: object) -> Callable[[Req, CallOptions], Rep]: ...
    @overload
    def __get__(
        self, calls: AsyncCalls, owner: object
    ) -> Callable[[Req, CallOptions], Awaitable[Rep]]: ...
    def __get__(self, calls: _Calls | None, owner: object) -> Any:
        if calls is None:
            return self
        transport, method = calls.transport, self.method
        target = getattr(calls, self.via) if self.via else getattr(calls.stub, method.name)
        settled = getattr(calls, self.settled) if self.settled else None
        return lambda request, options: transport.unary(
            method, target, request, options, settled=settled
        )


class ServerStream(_Rpc[Req, Rep]):
    @overload
    def __get__(
        self, calls: SyncCalls, owner: object
    ) -> Callable[[Req, CallOptions], _streams.SyncStream[Rep]]: ...
    @overload
    def __get__(
        self, calls: AsyncCalls, owner: object
    ) -> Callable[[Req, CallOptions], _streams.AsyncStream[Rep]]: ...
    def __get__(self, calls: _Calls | None, owner: object) -> Any:
        if calls is None:
            return self
        transport, target = calls.transport, self.target(calls)
        return lambda request, options: transport.unary_stream(
            self.method, target, request, options
        )


class BidiStream(_Rpc[Req, Rep]):
    @overload
    def __get__(
        self, calls: SyncCalls, owner: object
    ) -> Callable[[Iterable[Req], CallOptions], _streams.SyncStream[Rep]]: ...
    @overload
    def __get__(
        self, calls: AsyncCalls, owner: object
    ) -> Callable[[AsyncIterator[Req] | Iterator[Req], CallOptions], _streams.AsyncStream[Rep]]: ...
    def __get__(self, calls: _Calls | None, owner: object) -> Any:
        if calls is None:
            return self
        transport, target = calls.transport, self.target(calls)
        return lambda requests, options: transport.stream_stream(
            self.method, target, requests, options
        )


# -- the services ---------------------------------------------------------------------------

_O = ORCHESTRATOR_METHODS
_A = AGENT_METHODS


class _OrchestratorRpcs:
    # Acquire and Yield go over one Session stream (unary where there is none).
    acquire = Unary[opb.AcquireRequest, opb.AcquireResponse](_O["Acquire"], via="_acquire")
    yield_ = Unary[opb.YieldRequest, opb.YieldResponse](
        _O["Yield"], via="_yield", settled="_yield_settled"
    )
    # Unary, not over the Session: an older tslice's Session refuses a request it cannot
    # read with INVALID_ARGUMENT, where the unary RPC answers UNIMPLEMENTED, which a
    # client can tell from a refusal of the set itself (and falls back on).
    acquire_set = Unary[opb.AcquireSetRequest, opb.AcquireSetResponse](
        _O["AcquireSet"], via="_acquire_set"
    )
    list_groups = Unary[opb.ListGroupsRequest, opb.ListGroupsResponse](_O["ListGroups"])
    get_group_status = Unary[opb.GetGroupStatusRequest, opb.GetGroupStatusResponse](
        _O["GetGroupStatus"]
    )
    watch_events = ServerStream[opb.WatchEventsRequest, opb.OrchestratorEvent](_O["WatchEvents"])
    hold = ServerStream[opb.HoldRequest, opb.HoldEvent](_O["Hold"])
    #: The raw Session stream (acquire and yield_ already use one of their own).
    session = BidiStream[opb.SessionRequest, opb.SessionResponse](_O["Session"])
    clear_degraded = Unary[opb.ClearDegradedRequest, opb.ClearDegradedResponse](_O["ClearDegraded"])
    evict = Unary[opb.EvictRequest, opb.EvictResponse](_O["Evict"])
    drain = Unary[opb.DrainRequest, opb.DrainResponse](_O["Drain"])


class _AgentRpcs:
    snapshot = Unary[pb.SnapshotRequest, pb.SnapshotResponse](_A["Snapshot"])
    restore = Unary[pb.RestoreRequest, pb.RestoreResponse](_A["Restore"])
    get_operation = Unary[pb.GetOperationRequest, pb.GetOperationResponse](_A["GetOperation"])
    status = Unary[pb.StatusRequest, pb.StatusResponse](_A["Status"])
    workload_channel = BidiStream[pb.WorkloadMessage, pb.AgentCommand](_A["WorkloadChannel"])
    wait_operation = Unary[pb.WaitOperationRequest, pb.GetOperationResponse](_A["WaitOperation"])
    grant = Unary[pb.GrantRequest, pb.GrantResponse](_A["Grant"])
    grant_stream = BidiStream[pb.GrantStreamRequest, pb.GrantStreamResponse](_A["GrantStream"])
    reset_job = Unary[pb.ResetJobRequest, pb.ResetJobResponse](_A["ResetJob"])
    reset_leader_term = Unary[pb.ResetLeaderTermRequest, pb.ResetLeaderTermResponse](
        _A["ResetLeaderTerm"]
    )
    check_health = Unary[HealthCheckRequest, HealthCheckResponse](HEALTH_CHECK, via="_check")


class OrchestratorCalls(_OrchestratorRpcs, SyncCalls):
    """One blocking method per orchestrator RPC."""

    stub: opb_grpc.TimeSliceOrchestratorServiceStub

    def __init__(self, transport: _channel.SyncTransport) -> None:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(transport.channel)
        super().__init__(transport, stub)
        self.session_calls = _session.SyncSession(transport)
        self._starter = _unary.Starter("tslice-unary-calls")
        self._acquire: _channel.SyncUnary[Any, Any] = _SyncFirstLockCall(self, acquire=True)
        self._yield: _channel.SyncUnary[Any, Any] = _SyncFirstLockCall(self, acquire=False)
        # Started by the channel's starter thread, so that Ctrl-C never loses the call
        # (a ghost set).
        self._acquire_set = _unary.Started(self._starter, stub.AcquireSet)

    def take_unary_calls(self) -> None:
        """The orchestrator has no Session: llm-d's unary Acquire and Yield from now on."""
        self._acquire = _unary.Started(self._starter, self.stub.Acquire)
        self._yield = _unary.Started(self._starter, self.stub.Yield)

    def take_session(self) -> None:
        self._acquire, self._yield = self.session_calls.acquire, self.session_calls.yield_

    def _yield_settled(
        self, request: opb.YieldRequest, answer: errors.RPCError
    ) -> opb.YieldResponse:
        """A re-issued Yield refused PERMISSION_DENIED: the job let go (an earlier attempt
        handed the group on) unless it still holds the group (its identity was refused)."""
        try:
            status = self.get_group_status(
                opb.GetGroupStatusRequest(group_id=request.group_id), _CONFIRMING
            )
        except errors.RPCError as err:
            raise answer from err  # not confirmed: the refusal stands
        if _still_holds(request, status):
            raise answer
        return _LET_GO

    def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        self.session_calls.close()
        self._starter.close()


class AsyncOrchestratorCalls(_OrchestratorRpcs, AsyncCalls):
    """One coroutine per orchestrator RPC."""

    stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(transport.channel)
        super().__init__(transport, stub)
        self.session_calls = _session.Session(transport)
        first = _AsyncFirstLockCall(self)
        self._acquire: _channel.AsyncUnary[Any, Any] = first.acquire
        self._yield: _channel.AsyncUnary[Any, Any] = first.yield_
        self._acquire_set = stub.AcquireSet

    def take_unary_calls(self) -> None:
        """The orchestrator has no Session: llm-d's unary Acquire and Yield from now on."""
        self._acquire, self._yield = self.stub.Acquire, self.stub.Yield

    def take_session(self) -> None:
        self._acquire, self._yield = self.session_calls.acquire, self.session_calls.yield_

    async def _yield_settled(
        self, request: opb.YieldRequest, answer: errors.RPCError
    ) -> opb.YieldResponse:
        """See :meth:`OrchestratorCalls._yield_settled`."""
        try:
            status = await self.get_group_status(
                opb.GetGroupStatusRequest(group_id=request.group_id), _CONFIRMING
            )
        except errors.RPCError as err:
            raise answer from err  # not confirmed: the refusal stands
        if _still_holds(request, status):
            raise answer
        return _LET_GO

    async def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        await self.session_calls.close()


class _SyncFirstLockCall:
    """Acquire or Yield of a channel until one of them was answered over the Session
    stream (then the session's methods take over) or found it missing (llm-d's unary
    calls take over, and carry this call): with its async twin, the one place that
    chooses."""

    def __init__(self, calls: OrchestratorCalls, *, acquire: bool) -> None:
        self._calls = calls
        self._acquire = acquire

    def future(
        self, request: Any, *, timeout: float | None = None, metadata: Any = None
    ) -> _session.Later[Any]:
        return _session.Later(lambda: self._first(request, timeout, metadata))

    def _first(self, request: Any, timeout: float | None, metadata: Any) -> Any:
        calls = self._calls
        session = calls.session_calls.acquire if self._acquire else calls.session_calls.yield_
        try:
            reply = session.future(request, timeout=timeout).result()
        except multiplex.Unsupported:
            calls.take_unary_calls()
            unary = calls._acquire if self._acquire else calls._yield
            return _channel.wait(unary.future(request, timeout=timeout, metadata=metadata))
        calls.take_session()
        return reply


class _AsyncFirstLockCall:
    """See :class:`_SyncFirstLockCall`."""

    def __init__(self, calls: AsyncOrchestratorCalls) -> None:
        self._calls = calls

    async def acquire(
        self, request: opb.AcquireRequest, *, timeout: float | None = None, metadata: Any = None
    ) -> opb.AcquireResponse:
        calls = self._calls
        try:
            reply = await calls.session_calls.acquire(request, timeout=timeout)
        except multiplex.Unsupported:
            calls.take_unary_calls()
            acquired: opb.AcquireResponse = await calls.stub.Acquire(
                request, timeout=timeout, metadata=metadata
            )
            return acquired
        calls.take_session()
        return reply

    async def yield_(
        self, request: opb.YieldRequest, *, timeout: float | None = None, metadata: Any = None
    ) -> opb.YieldResponse:
        calls = self._calls
        try:
            reply = await calls.session_calls.yield_(request, timeout=timeout)
        except multiplex.Unsupported:
            calls.take_unary_calls()
            released: opb.YieldResponse = await calls.stub.Yield(
                request, timeout=timeout, metadata=metadata
            )
            return released
        calls.take_session()
        return reply


class AgentCalls(_AgentRpcs, SyncCalls):
    """One blocking method per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.SyncTransport) -> None:
        super().__init__(transport, pb_grpc.SnapshotAgentServiceStub(transport.channel))


class AsyncAgentCalls(_AgentRpcs, AsyncCalls):
    """One coroutine per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        super().__init__(transport, pb_grpc.SnapshotAgentServiceStub(transport.channel))
