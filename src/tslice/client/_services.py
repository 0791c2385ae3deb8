"""One typed method per RPC of the wire contract, for each service, sync and async.

Each method hands the generated stub's method to the transport
(:mod:`tslice.client._channel`), which times, retries and translates the call; a test
checks that no RPC of the proto descriptors is missing. ``stub`` is the raw generated
stub, the escape hatch. Acquire and Yield go over the orchestrator's Session stream,
or unary where there is none (:mod:`tslice.client.compat._unary`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _channel, _session
from tslice.client._channel import NO_OPTIONS, CallOptions, Method
from tslice.client.compat import _unary

ORCHESTRATOR_SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
AGENT_SERVICE = "snapshot_agent.v1alpha1.SnapshotAgentService"
HEALTH_SERVICE = "grpc.health.v1.Health"

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

_O = ORCHESTRATOR_METHODS
_A = AGENT_METHODS


def _yield_settled() -> opb.YieldResponse:
    """What a Yield that met PERMISSION_DENIED after a lost reply returns: it let go."""
    return opb.YieldResponse(success=True)


class OrchestratorCalls:
    """One blocking method per orchestrator RPC."""

    def __init__(self, transport: _channel.SyncTransport) -> None:
        self.transport = transport
        self.stub = opb_grpc.TimeSliceOrchestratorServiceStub(transport.channel)
        # Acquire and Yield go over one Session stream (unary where there is none).
        self._session = _session.SyncSession(self.stub, metadata=transport.metadata(NO_OPTIONS))
        self._acquire = _unary.SyncUnaryFallback(self._session.acquire, self.stub.Acquire)
        self._yield = _unary.SyncUnaryFallback(self._session.yield_, self.stub.Yield)

    def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        self._session.close()

    def acquire(
        self, request: opb.AcquireRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.AcquireResponse:
        return self.transport.unary(_O["Acquire"], self._acquire, request, options)

    def yield_(
        self, request: opb.YieldRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.YieldResponse:
        return self.transport.unary(
            _O["Yield"], self._yield, request, options, settled=_yield_settled
        )

    def list_groups(
        self, request: opb.ListGroupsRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.ListGroupsResponse:
        return self.transport.unary(_O["ListGroups"], self.stub.ListGroups, request, options)

    def get_group_status(
        self, request: opb.GetGroupStatusRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.GetGroupStatusResponse:
        call = self.stub.GetGroupStatus
        return self.transport.unary(_O["GetGroupStatus"], call, request, options)

    def watch_events(
        self, request: opb.WatchEventsRequest, options: CallOptions = NO_OPTIONS
    ) -> _channel.SyncStream[opb.OrchestratorEvent]:
        call = self.stub.WatchEvents
        return self.transport.unary_stream(_O["WatchEvents"], call, request, options)

    def hold(
        self, request: opb.HoldRequest, options: CallOptions = NO_OPTIONS
    ) -> _channel.SyncStream[opb.HoldEvent]:
        return self.transport.unary_stream(_O["Hold"], self.stub.Hold, request, options)

    def session(
        self, requests: Iterable[opb.SessionRequest], options: CallOptions = NO_OPTIONS
    ) -> _channel.SyncStream[opb.SessionResponse]:
        """The raw Session stream (acquire() and yield_() already use one of their own)."""
        return self.transport.stream_stream(_O["Session"], self.stub.Session, requests, options)

    def clear_degraded(
        self, request: opb.ClearDegradedRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.ClearDegradedResponse:
        call = self.stub.ClearDegraded
        return self.transport.unary(_O["ClearDegraded"], call, request, options)


class AsyncOrchestratorCalls:
    """One coroutine per orchestrator RPC."""

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        self.transport = transport
        self.stub = opb_grpc.TimeSliceOrchestratorServiceStub(transport.channel)
        # Acquire and Yield go over one Session stream (unary where there is none).
        self._session = _session.Session(self.stub, metadata=transport.metadata(NO_OPTIONS))
        self._acquire = _unary.UnaryFallback(self._session.acquire, self.stub.Acquire)
        self._yield = _unary.UnaryFallback(self._session.yield_, self.stub.Yield)

    async def close(self) -> None:
        """End the Session stream (before the channel closes)."""
        await self._session.close()

    async def acquire(
        self, request: opb.AcquireRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.AcquireResponse:
        return await self.transport.unary(_O["Acquire"], self._acquire, request, options)

    async def yield_(
        self, request: opb.YieldRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.YieldResponse:
        return await self.transport.unary(
            _O["Yield"], self._yield, request, options, settled=_yield_settled
        )

    async def list_groups(
        self, request: opb.ListGroupsRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.ListGroupsResponse:
        call = self.stub.ListGroups
        return await self.transport.unary(_O["ListGroups"], call, request, options)

    async def get_group_status(
        self, request: opb.GetGroupStatusRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.GetGroupStatusResponse:
        call = self.stub.GetGroupStatus
        return await self.transport.unary(_O["GetGroupStatus"], call, request, options)

    def watch_events(
        self, request: opb.WatchEventsRequest, options: CallOptions = NO_OPTIONS
    ) -> _channel.AsyncStream[opb.OrchestratorEvent]:
        call = self.stub.WatchEvents
        return self.transport.unary_stream(_O["WatchEvents"], call, request, options)

    def hold(
        self, request: opb.HoldRequest, options: CallOptions = NO_OPTIONS
    ) -> _channel.AsyncStream[opb.HoldEvent]:
        return self.transport.unary_stream(_O["Hold"], self.stub.Hold, request, options)

    def session(
        self,
        requests: AsyncIterator[opb.SessionRequest] | Iterator[opb.SessionRequest],
        options: CallOptions = NO_OPTIONS,
    ) -> _channel.AsyncStream[opb.SessionResponse]:
        """The raw Session stream (acquire() and yield_() already use one of their own)."""
        return self.transport.stream_stream(_O["Session"], self.stub.Session, requests, options)

    async def clear_degraded(
        self, request: opb.ClearDegradedRequest, options: CallOptions = NO_OPTIONS
    ) -> opb.ClearDegradedResponse:
        call = self.stub.ClearDegraded
        return await self.transport.unary(_O["ClearDegraded"], call, request, options)


class AgentCalls:
    """One blocking method per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.SyncTransport) -> None:
        self.transport = transport
        self.stub = pb_grpc.SnapshotAgentServiceStub(transport.channel)
        self.health_stub = health_pb2_grpc.HealthStub(transport.channel)
        self._check = _channel.health_check(transport.channel)

    def snapshot(
        self, request: pb.SnapshotRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.SnapshotResponse:
        return self.transport.unary(_A["Snapshot"], self.stub.Snapshot, request, options)

    def restore(
        self, request: pb.RestoreRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.RestoreResponse:
        return self.transport.unary(_A["Restore"], self.stub.Restore, request, options)

    def get_operation(
        self, request: pb.GetOperationRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GetOperationResponse:
        call = self.stub.GetOperation
        return self.transport.unary(_A["GetOperation"], call, request, options)

    def status(
        self, request: pb.StatusRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.StatusResponse:
        return self.transport.unary(_A["Status"], self.stub.Status, request, options)

    def workload_channel(
        self, requests: Iterable[pb.WorkloadMessage], options: CallOptions = NO_OPTIONS
    ) -> _channel.SyncStream[pb.AgentCommand]:
        call = self.stub.WorkloadChannel
        return self.transport.stream_stream(_A["WorkloadChannel"], call, requests, options)

    def wait_operation(
        self, request: pb.WaitOperationRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GetOperationResponse:
        call = self.stub.WaitOperation
        return self.transport.unary(_A["WaitOperation"], call, request, options)

    def grant(
        self, request: pb.GrantRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GrantResponse:
        return self.transport.unary(_A["Grant"], self.stub.Grant, request, options)

    def grant_stream(
        self, requests: Iterable[pb.GrantStreamRequest], options: CallOptions = NO_OPTIONS
    ) -> _channel.SyncStream[pb.GrantStreamResponse]:
        call = self.stub.GrantStream
        return self.transport.stream_stream(_A["GrantStream"], call, requests, options)

    def reset_job(
        self, request: pb.ResetJobRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.ResetJobResponse:
        return self.transport.unary(_A["ResetJob"], self.stub.ResetJob, request, options)

    def check_health(
        self, request: health_pb2.HealthCheckRequest, options: CallOptions = NO_OPTIONS
    ) -> health_pb2.HealthCheckResponse:
        return self.transport.unary(HEALTH_CHECK, self._check, request, options)


class AsyncAgentCalls:
    """One coroutine per snapshot-agent RPC, plus the standard health check."""

    def __init__(self, transport: _channel.AsyncTransport) -> None:
        self.transport = transport
        self.stub = pb_grpc.SnapshotAgentServiceStub(transport.channel)
        self.health_stub = health_pb2_grpc.HealthStub(transport.channel)
        self._check = _channel.health_check(transport.channel)

    async def snapshot(
        self, request: pb.SnapshotRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.SnapshotResponse:
        return await self.transport.unary(_A["Snapshot"], self.stub.Snapshot, request, options)

    async def restore(
        self, request: pb.RestoreRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.RestoreResponse:
        return await self.transport.unary(_A["Restore"], self.stub.Restore, request, options)

    async def get_operation(
        self, request: pb.GetOperationRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GetOperationResponse:
        call = self.stub.GetOperation
        return await self.transport.unary(_A["GetOperation"], call, request, options)

    async def status(
        self, request: pb.StatusRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.StatusResponse:
        return await self.transport.unary(_A["Status"], self.stub.Status, request, options)

    def workload_channel(
        self,
        requests: AsyncIterator[pb.WorkloadMessage] | Iterator[pb.WorkloadMessage],
        options: CallOptions = NO_OPTIONS,
    ) -> _channel.AsyncStream[pb.AgentCommand]:
        call = self.stub.WorkloadChannel
        return self.transport.stream_stream(_A["WorkloadChannel"], call, requests, options)

    async def wait_operation(
        self, request: pb.WaitOperationRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GetOperationResponse:
        call = self.stub.WaitOperation
        return await self.transport.unary(_A["WaitOperation"], call, request, options)

    async def grant(
        self, request: pb.GrantRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.GrantResponse:
        return await self.transport.unary(_A["Grant"], self.stub.Grant, request, options)

    def grant_stream(
        self,
        requests: AsyncIterator[pb.GrantStreamRequest] | Iterator[pb.GrantStreamRequest],
        options: CallOptions = NO_OPTIONS,
    ) -> _channel.AsyncStream[pb.GrantStreamResponse]:
        call = self.stub.GrantStream
        return self.transport.stream_stream(_A["GrantStream"], call, requests, options)

    async def reset_job(
        self, request: pb.ResetJobRequest, options: CallOptions = NO_OPTIONS
    ) -> pb.ResetJobResponse:
        return await self.transport.unary(_A["ResetJob"], self.stub.ResetJob, request, options)

    async def check_health(
        self, request: health_pb2.HealthCheckRequest, options: CallOptions = NO_OPTIONS
    ) -> health_pb2.HealthCheckResponse:
        return await self.transport.unary(HEALTH_CHECK, self._check, request, options)
