"""One typed method per RPC of the wire contract, for each service, sync and async.

Each RPC is declared once, as a descriptor whose type arguments are its request and
reply messages (a test checks them, and that no RPC is missing, against the proto
descriptors); read on a sync calls object it is a blocking method, on an async one a
coroutine method. Either way the call goes through the transport
(:mod:`tslice.client._channel`), which times, retries and translates it. ``stub`` is
the raw generated stub, the escape hatch. Acquire and Yield go over the
orchestrator's Session stream, or unary where there is none
(:mod:`tslice.client.compat._unary`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, Generic, TypeAlias, TypeVar, overload

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _channel, _session
from tslice.client._channel import (
    NO_OPTIONS,
    CallOptions,
    HealthCheckRequest,
    HealthCheckResponse,
    Method,
)
from tslice.client.compat import _unary

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
        # re-issued one then meets PERMISSION_DENIED, yet the job did let go.
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


def _yield_settled() -> opb.YieldResponse:
    """What a Yield that met PERMISSION_DENIED after a lost reply returns: it let go."""
    return opb.YieldResponse(success=True)


# -- the calls objects ----------------------------------------------------------------------


class SyncCalls:
    """Blocking calls of one service over a sync transport."""

    def __init__(self, transport: _channel.SyncTransport, stub: Any) -> None:
        self.transport = transport
        self.stub = stub
        self._check = _channel.health_check(transport.channel)


class AsyncCalls:
    """Coroutine calls of one service over an async transport."""

    def __init__(self, transport: _channel.AsyncTransport, stub: Any) -> None:
        self.transport = transport
        self.stub = stub
        self._check = _channel.health_check(transport.channel)


_Calls: TypeAlias = SyncCalls | AsyncCalls


class _Rpc(Generic[Req, Rep]):
    """One RPC: the transport's method for it, and what it calls (the stub's method of
    the same name, or the calls object's attribute ``via``)."""

    def __init__(
        self, method: Method, *, via: str = "", settled: Callable[[], Rep] | None = None
    ) -> None:
        self.method = method
        self.via = via
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
        transport, target = calls.transport, self.target(calls)
        return lambda request, options: transport.unary(
            self.method, target, request, options, settled=self.settled
        )


class ServerStream(_Rpc[Req, Rep]):
    @overload
    def __get__(
        self, calls: SyncCalls, owner: object
    ) -> Callable[[Req, CallOptions], _channel.SyncStream[Rep]]: ...
    @overload
    def __get__(
        self, calls: AsyncCalls, owner: object
    ) -> Callable[[Req, CallOptions], _channel.AsyncStream[Rep]]: ...
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
    ) -> Callable[[Iterable[Req], CallOptions], _channel.SyncStream[Rep]]: ...
    @overload
    def __get__(
        self, calls: AsyncCalls, owner: object
    ) -> Callable[[AsyncIterator[Req] | Iterator[Req], CallOptions], _channel.AsyncStream[Rep]]: ...
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
        _O["Yield"], via="_yield", settled=_yield_settled
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
        self._session = _session.SyncSession(stub, metadata=transport.metadata(NO_OPTIONS))
        self._acquire = _unary.SyncUnaryFallback(self._session.acquire, stub.Acquire)
        self._yield = _unary.SyncUnaryFallback(self._session.yield_, stub.Yield)
        # Started by a helper thread, so that Ctrl-C never loses the call (a ghost set).
        self._acquire_set = _unary.SyncUnaryFallback(None, stub.AcquireSet)

    def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        self._session.close()


class AsyncOrchestratorCalls(_OrchestratorRpcs, AsyncCalls):
    """One coroutine per orchestrator RPC."""

    stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(transport.channel)
        super().__init__(transport, stub)
        self._session = _session.Session(stub, metadata=transport.metadata(NO_OPTIONS))
        self._acquire = _unary.UnaryFallback(self._session.acquire, stub.Acquire)
        self._yield = _unary.UnaryFallback(self._session.yield_, stub.Yield)
        self._acquire_set = stub.AcquireSet

    async def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        await self._session.close()


class AgentCalls(_AgentRpcs, SyncCalls):
    """One blocking method per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.SyncTransport) -> None:
        super().__init__(transport, pb_grpc.SnapshotAgentServiceStub(transport.channel))


class AsyncAgentCalls(_AgentRpcs, AsyncCalls):
    """One coroutine per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        super().__init__(transport, pb_grpc.SnapshotAgentServiceStub(transport.channel))
