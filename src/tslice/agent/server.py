"""gRPC face of the node agent: ``SnapshotAgentService`` and backend health.

The servicer checks each call's leader term against the agent's fence
(:class:`tslice.security.fencing.TermFence`: a directive from a deposed orchestrator
leader is refused before anything else), validates ids and arguments, hands the request
to :class:`tslice.agent.moves.runner.AgentCore`, and maps what comes back onto the wire
(records to messages, refusals to gRPC status codes); it holds no state of its own.

The top of the hand-over path: the orchestrator's Grants arrive on one long-lived
``GrantStream`` per orchestrator (``tslice.rpc.multiplex.serve`` runs each as it comes and
refuses a second one with the id of one in flight); :meth:`SnapshotAgentServicer.grant_reply`
turns a ``GrantRequest`` into a ``grant_plan.Order`` for the runner. llm-d's orchestrator
uses Snapshot/Restore and polls GetOperation instead: the same runner, one move per call.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from tslice.agent import channel
from tslice.agent.backends import base
from tslice.agent.jobs import model
from tslice.agent.moves import grant_plan, runner
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.common import tasks, validation
from tslice.rpc import multiplex, refusals, undecodable
from tslice.security import fencing, identities, roles
from tslice.server import logs

log = logging.getLogger(__name__)

#: The GrantStream method's wire path: what a refused stream's message names.
_GRANT_STREAM_PATH = (
    f"/{pb.DESCRIPTOR.services_by_name['SnapshotAgentService'].full_name}/GrantStream"
)
_T = TypeVar("_T")
_R = TypeVar("_R")

_OP_STATUS: Mapping[model.OpStatus, pb.OperationStatus] = {
    model.OpStatus.PENDING: pb.OPERATION_STATUS_PENDING,
    model.OpStatus.COMPLETE: pb.OPERATION_STATUS_COMPLETE,
    model.OpStatus.FAILED: pb.OPERATION_STATUS_FAILED,
}


def operation_to_pb(op: model.Operation, *, now: float) -> pb.GetOperationResponse:
    """Bytes are present on every COMPLETE operation, ``error`` only on FAILED ones;
    ``elapsed_ms`` runs to ``now`` while the operation is pending."""
    end = op.finished_at if op.finished_at is not None else now
    response = pb.GetOperationResponse(
        status=_OP_STATUS[op.status],
        elapsed_ms=max(0, int((end - op.started_at) * 1000)),
        job_id=op.job_id,
        kind=op.kind.value,
        group=op.group,
    )
    if op.status is model.OpStatus.COMPLETE:
        response.storage_bytes = op.storage_bytes or 0
        response.snapshot_device_bytes = op.device_bytes or 0
        if op.device_bytes and response.elapsed_ms > 0:
            response.throughput_gbps = op.device_bytes / response.elapsed_ms / 1e6
    elif op.status is model.OpStatus.FAILED:
        response.error = validation.bounded(op.error or "operation failed")
    return response


def job_to_pb(job: model.Job) -> pb.JobStatus:
    return pb.JobStatus(
        job_id=job.job_id,
        state=model.STATE_TO_PB[job.state],
        group=job.group,
        operation_id=job.operation_id,
        device_bytes=job.device_bytes,
        host_bytes=job.host_bytes,
        backend=job.backend or job.choice,
        error=job.error,
    )


def _checked_operation_id(value: str) -> str:
    if not value:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            "operation_id is required: pass the id a Snapshot, Restore or Grant reply named",
        )
    # This agent's ids are UUIDs; any well-formed id is looked up (NOT_FOUND if unknown).
    return refusals.checked_id("operation_id", value)


def _listed_ids(request: pb.GrantRequest) -> tuple[list[str], list[tuple[str, str]]]:
    """The jobs a Grant names to evict and to give way to, each id well formed (their
    counts were bounded first). Raises ``validation.InvalidIdError``."""
    check = validation.check_id
    evict = []
    for other in request.evict:
        evict.append(check("evict", other))
    give_way = []
    for ref in request.give_way:
        give_way.append((check("give_way.job_id", ref.job_id), check("give_way.group", ref.group)))
    return evict, give_way


def _invalid(err: validation.InvalidInput) -> refusals.Refused:
    return refusals.Refused(refusals.Code.INVALID_ARGUMENT, str(err))


def _checked_group(value: str) -> str:
    """The group is optional on the agent's requests; when given it must be well formed."""
    return refusals.checked_id("group", value) if value else ""


#: How many engines one app-endpoint job may list (one per TP/DP rank server is plenty).
MAX_ENDPOINTS = 1024
_COUNTS = {"backend_config.app_endpoint.endpoints": MAX_ENDPOINTS}


def _checked_fields(message: Any) -> None:
    """Enums, counts and string lengths of the whole request (after its ids were checked)."""
    try:
        validation.check_message(message, counts=_COUNTS)
    except validation.InvalidInput as err:
        raise _invalid(err) from None


def _checked_config(message: Any) -> pb.BackendConfig | None:
    _checked_fields(message)
    if not message.HasField("backend_config"):
        return None
    config: pb.BackendConfig = message.backend_config
    if config.WhichOneof("backend") == "sim" and config.sim.footprint_bytes < 0:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"backend_config.sim.footprint_bytes must be >= 0 (got {config.sim.footprint_bytes})",
        )
    return config


def _checked_devices(devices: Sequence[int]) -> tuple[int, ...]:
    if min(devices, default=0) < 0:
        negative = [d for d in devices if d < 0]
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"devices are device indices, >= 0 (got {validation.shown_list(negative)})",
        )
    return tuple(devices)


def _checked_wait(field: str, value: int) -> float:
    """A wait in ms as seconds; negative waits are refused, long ones capped by the core."""
    if value < 0:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT, f"{field} must be >= 0 (got {value}); 0 returns at once"
        )
    return value / 1000


def _duplicate_grant(request: pb.GrantStreamRequest) -> pb.GrantStreamResponse:
    """A second Grant with the id of one in flight: refused, never run."""
    return pb.GrantStreamResponse(
        request_id=request.request_id,
        status_code=refusals.status_number(refusals.Code.INVALID_ARGUMENT),
        status_message=multiplex.duplicate_message(request.request_id),
    )


def _orchestrating() -> bool:
    """Whether the caller may raise the leader term from a read: the orchestrator role,
    or anyone on an agent without authentication (where anyone may direct it anyway)."""
    if not roles.enforced():
        return True
    caller = roles.principal_of()
    return caller is not None and identities.ORCHESTRATOR in caller.roles


#: What this agent speaks beyond llm-d's protocol, declared in every Status reply: the
#: orchestrator uses only what is declared (see docs/api.md, AgentFeatures).
_FEATURES = pb.AgentFeatures(grant_step=True, grant_stream=True, prefetch=True)


class SnapshotAgentServicer(pb_grpc.SnapshotAgentServiceServicer):
    """The v1alpha1 agent API plus tslice's WaitOperation, Grant and ResetJob."""

    def __init__(
        self,
        *,
        core: runner.AgentCore,
        hub: channel.ChannelHub,
        fence: fencing.TermFence | None = None,
    ) -> None:
        self._core = core
        self._hub = hub
        #: None: a fence in memory only (the agent's app passes the one on its store).
        self._fence = fence if fence is not None else fencing.TermFence(None)
        #: Set when the agent stops: GrantStreams end at once (the caller re-opens one).
        self._closing = multiplex.Closing()

    def close(self) -> None:
        self._closing.set()

    async def _fenced(
        self, context: grpc.aio.ServicerContext, *, directive: bool = True
    ) -> fencing.Sent:
        """Admit the call's leader term (see ``tslice.security.fencing``); returns it. Every
        handler calls this first: a deposed leader's directive is refused untouched."""
        sent = await refusals.checked(context, fencing.sent, context.invocation_metadata())
        admit = functools.partial(
            self._fence.admit, directive=directive, adopt=_orchestrating(), leader=sent.leader
        )
        await refusals.checked(context, admit, sent.term)
        return sent

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.SnapshotResponse:
        return await self._directive(context, request, model.Kind.SNAPSHOT, pb.SnapshotResponse)

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        if request.prefetch:
            return await self._prefetch(request, context)
        return await self._directive(context, request, model.Kind.RESTORE, pb.RestoreResponse)

    async def _prefetch(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        """Restore with ``prefetch`` (issue 9 §2): started, the job stays SAVED; no operation."""
        await self._fenced(context)  # it copies into device memory: a directive too
        job_id = await refusals.checked(context, refusals.checked_id, "job_id", request.job_id)
        group = await refusals.checked(context, _checked_group, request.group)
        config = await refusals.checked(context, _checked_config, request)
        await refusals.answered(
            context, self._core.prefetch(job_id=job_id, group=group, config=config)
        )
        return pb.RestoreResponse()

    async def _directive(
        self,
        context: grpc.aio.ServicerContext,
        request: pb.SnapshotRequest | pb.RestoreRequest,
        kind: model.Kind,
        reply: Callable[..., _R],
    ) -> _R:
        """Validate a Snapshot or Restore request (same fields), start it, reply with it."""
        await self._fenced(context)
        job_id = await refusals.checked(context, refusals.checked_id, "job_id", request.job_id)
        group = await refusals.checked(context, _checked_group, request.group)
        config = await refusals.checked(context, _checked_config, request)
        wait_s = await refusals.checked(context, _checked_wait, "wait_ms", request.wait_ms)
        op = await refusals.answered(
            context,
            self._core.directive(
                kind,
                job_id=job_id,
                group=group,
                config=config,
                deprecated_backend=request.backend,
                wait_s=wait_s,
            ),
        )
        return reply(operation_id=op.op_id, operation=operation_to_pb(op, now=self._core.now()))

    async def GetOperation(
        self, request: pb.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetOperationResponse:
        await self._fenced(context, directive=False)
        op_id = await refusals.checked(context, _checked_operation_id, request.operation_id)
        op = await refusals.checked(context, self._core.get_operation, op_id)
        return operation_to_pb(op, now=self._core.now())

    async def WaitOperation(
        self, request: pb.WaitOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetOperationResponse:
        await self._fenced(context)
        op_id = await refusals.checked(context, _checked_operation_id, request.operation_id)
        timeout_s = await refusals.checked(context, _checked_wait, "timeout_ms", request.timeout_ms)
        op = await refusals.answered(context, self._core.wait_operation(op_id, timeout_s=timeout_s))
        return operation_to_pb(op, now=self._core.now())

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        # A read: answered whatever the term, but a newer one is adopted (a new leader's
        # first Status read fences the node before it directs anything).
        await self._fenced(context, directive=False)
        accelerators = await self._core.accelerators()
        host_limit, host_parked = self._core.host_memory()
        return pb.StatusResponse(
            host_budget_bytes=host_limit or 0,
            host_parked_bytes=host_parked,
            job_statuses=[job_to_pb(job) for job in self._core.list_jobs()],
            accelerator_statuses=[
                pb.AcceleratorStatus(
                    id=a.id,
                    memory_used_bytes=a.memory_used_bytes,
                    memory_total_bytes=a.memory_total_bytes,
                )
                for a in accelerators
            ],
            node=self._core.node,
            features=_FEATURES,
        )

    async def Grant(
        self, request: pb.GrantRequest, context: grpc.aio.ServicerContext
    ) -> pb.GrantResponse:
        await self._fenced(context)
        return await refusals.answered(context, self.grant_reply(request))

    @undecodable.parses_own_requests
    async def GrantStream(
        self,
        request_iterator: AsyncIterator[bytes | pb.GrantStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.GrantStreamResponse]:
        """Grants of one caller: each runs as it arrives, replies go out as they finish.

        The stream's term (from its metadata; a newer one is adopted as it opens) is
        checked for each grant, whose reply carries the refusal: a stream refused as a
        whole would read to the caller as an agent without GrantStream."""
        term = await self._fenced(context, directive=False)
        async for reply in multiplex.serve(
            request_iterator,
            functools.partial(self._stream_reply, term=term),
            request_id=operator.attrgetter("request_id"),
            duplicate=_duplicate_grant,
            name=_GRANT_STREAM_PATH,
            closing=self._closing,
            parse=pb.GrantStreamRequest.FromString,
            context=context,
        ):
            yield reply

    async def _stream_reply(
        self, request: pb.GrantStreamRequest, *, term: fencing.Sent
    ) -> pb.GrantStreamResponse:
        try:
            if term != self._fence.current:  # a term the node has moved past (or not seen)
                self._fence.admit(term.term, directive=True, leader=term.leader)
            grant = await self.grant_reply(request.grant)
        except refusals.Refused as refused:
            return pb.GrantStreamResponse(
                request_id=request.request_id,
                status_code=refusals.status_number(refused.code),
                status_message=validation.bounded(refused.message),
            )
        except Exception as err:
            log.exception("grant of job %s crashed", request.grant.job_id)
            return pb.GrantStreamResponse(
                request_id=request.request_id,
                status_code=refusals.status_number(refusals.Code.INTERNAL),
                status_message=validation.bounded(
                    f"grant crashed on the agent ({type(err).__name__}: {err})"
                ),
            )
        return pb.GrantStreamResponse(request_id=request.request_id, grant=grant)

    async def grant_reply(self, request: pb.GrantRequest) -> pb.GrantResponse:
        """Validate and run one Grant (unary or streamed); raises ``refusals.Refused``."""
        # Ids are checked without refusals.checked_id's wrapper: one refusal for all.
        try:
            job_id = validation.check_id("job_id", request.job_id)
            group = validation.check_id("group", request.group) if request.group else ""
        except validation.InvalidIdError as err:
            raise _invalid(err) from None
        logs.IDS.set({"job_id": job_id, "group_id": group, "grant_epoch": request.grant_epoch})
        # Counts and enums before any list is looked at.
        config = _checked_config(request)
        if request.grant_epoch < 0 or request.footprint_bytes < 0:
            raise refusals.Refused(
                refusals.Code.INVALID_ARGUMENT,
                "grant_epoch and footprint_bytes must be >= 0 "
                f"(got {request.grant_epoch} and {request.footprint_bytes})",
            )
        try:
            named, give_way = _listed_ids(request)
        except validation.InvalidIdError as err:
            raise _invalid(err) from None
        evict = []  # every id checked first, then the named jobs' records
        for other in named:
            evict.append(self._core.key(other, group))
        # A Grant without wait_ms waits a default chunk (the orchestrator always sends one).
        wait_s = _checked_wait("wait_ms", request.wait_ms) or runner.DEFAULT_GRANT_WAIT_S
        order = grant_plan.order(
            job_id=job_id,
            group=group,
            epoch=request.grant_epoch,
            footprint_bytes=request.footprint_bytes,
            config=config,
            evict=evict,
            give_way=give_way,
            restore=request.restore,
        )
        outcome = await self._core.grant(
            order, wait_s=wait_s, devices=_checked_devices(request.devices)
        )
        now = self._core.now()
        response = pb.GrantResponse(
            state=model.STATE_TO_PB[outcome.state],
            granted=outcome.granted,
            restored=outcome.restored,
        )
        for op in outcome.operations:
            response.operations.append(operation_to_pb(op, now=now))
            response.operation_ids.append(op.op_id)
        return response

    async def ResetJob(
        self, request: pb.ResetJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetJobResponse:
        await self._fenced(context)
        job_id = await refusals.checked(context, refusals.checked_id, "job_id", request.job_id)
        group = await refusals.checked(context, _checked_group, request.group)
        state = await refusals.answered(context, self._core.reset(job_id=job_id, group=group))
        return pb.ResetJobResponse(state=model.STATE_TO_PB[state])

    async def ResetLeaderTerm(
        self, request: pb.ResetLeaderTermRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetLeaderTermResponse:
        """An administrator's repair of the term fence (not fenced itself: the admin role
        is checked by the authentication rules)."""
        caller = roles.principal_of()
        by = caller.name if caller is not None else f"an unauthenticated caller ({context.peer()})"
        reset = functools.partial(self._fence.reset, by=by)
        term, leader = await refusals.checked(context, reset, request.term)
        return pb.ResetLeaderTermResponse(previous_term=term, previous_leader=leader)

    async def WorkloadChannel(
        self, request_iterator: AsyncIterator[pb.WorkloadMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.AgentCommand]:
        async for command in self._hub.handle_stream(request_iterator, context):
            yield command


class HealthMonitor:
    """Keeps ``grpc.health.v1`` statuses fresh: "" = default backend, plus one per backend.

    Re-checked every ``interval_s`` and at once when an operation reports the backend
    unavailable. Unknown service names answer NOT_FOUND (the standard servicer).
    """

    def __init__(
        self,
        *,
        servicer: health.aio.HealthServicer,
        backends: Mapping[str, base.Backend],
        default_backend: str,
    ) -> None:
        self.servicer = servicer
        self._backends = dict(backends)
        self._default = default_backend
        self._pending: set[asyncio.Task[Any]] = set()

    async def _set(self, name: str, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self.servicer.set(name, status)
        if name == self._default:
            await self.servicer.set("", status)

    async def check_all(self) -> None:
        for name, backend in self._backends.items():
            try:
                await asyncio.wait_for(backend.check_health(), timeout=10.0)
            except Exception as err:
                log.warning("backend %s is not serving: %s", name, err, extra={"backend": name})
                await self._set(name, False)
            else:
                await self._set(name, True)

    def mark_unavailable(self, name: str, err: base.BackendError) -> None:
        """Called by the core when a backend says it cannot serve; flips health now."""
        log.warning("backend %s reported unavailable: %s", name, err, extra={"backend": name})
        task = tasks.spawn(self._set(name, False), name=f"health-{name}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def run(self, *, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.check_all()
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                continue

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()
