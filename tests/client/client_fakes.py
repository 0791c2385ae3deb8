"""Test doubles for the client tests: a small but real orchestrator and agent.

Both are grpc.aio servicers bound to 127.0.0.1:0 and run on an event loop in a
background thread, so that blocking (sync) clients and async clients alike talk
to them over a real socket. The orchestrator double has genuine lock semantics
(holder, FIFO waiters, a waiter leaves when its RPC is cancelled), records every
call with its metadata, and can be told to fail the next calls of a method with
a given status code.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Call:
    method: str
    job_id: str
    group_id: str
    metadata: dict[str, str]
    footprint_bytes: int = 0


@dataclasses.dataclass
class Group:
    holder: str = ""
    waiters: collections.OrderedDict[str, asyncio.Future[None]] = dataclasses.field(
        default_factory=collections.OrderedDict
    )
    epoch: int = 0


class Observable:
    """Lets tests wait (on the server loop) until the double reaches some state."""

    _changed: asyncio.Condition | None = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[Any], bool]) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: predicate(self))


class FakeOrchestrator(Observable, opb_grpc.TimeSliceOrchestratorServiceServicer):
    """FIFO lock per group, enough of the orchestrator's contract to test clients."""

    def __init__(self, groups: tuple[str, ...] = ("g", "a", "b")) -> None:
        self.groups = {name: Group() for name in groups}
        self.calls: list[Call] = []
        self.failures: dict[str, collections.deque[tuple[grpc.StatusCode, str]]] = (
            collections.defaultdict(collections.deque)
        )
        self.events: list[opb.OrchestratorEvent] = []
        #: Calls whose effect happens but whose reply is "lost" (UNAVAILABLE instead).
        self.lost_replies: collections.Counter[str] = collections.Counter()

    # -- helpers (run on the server loop) --

    async def _enter(self, method: str, request: Any, context: grpc.aio.ServicerContext) -> None:
        metadata = {key: value for key, value in context.invocation_metadata() or ()}
        self.calls.append(
            Call(
                method,
                getattr(request, "job_id", ""),
                getattr(request, "group_id", ""),
                metadata,
                getattr(request, "footprint_bytes", 0),
            )
        )
        await self._notify()
        if self.failures[method]:
            code, details = self.failures[method].popleft()
            await context.abort(code, details)

    def _group(self, group_id: str) -> Group | None:
        return self.groups.get(group_id)

    def calls_of(self, method: str) -> list[Call]:
        return [call for call in self.calls if call.method == method]

    # -- the RPCs --

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        # Like an orchestrator without the stream (llm-d's): clients fall back to the
        # unary calls, whose metadata, failures and lost replies this fake scripts.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    async def Acquire(
        self, request: opb.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> opb.AcquireResponse:
        await self._enter("Acquire", request, context)
        group = self._group(request.group_id)
        if group is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown group {request.group_id!r}")
        assert group is not None
        job = request.job_id
        if group.holder == job:
            return opb.AcquireResponse(success=True, grant_epoch=group.epoch)
        if not group.holder and not group.waiters:
            group.holder = job
            group.epoch += 1
            await self._notify()
            return opb.AcquireResponse(success=True, grant_epoch=group.epoch)
        waiter = group.waiters.get(job)
        if waiter is None:
            waiter = asyncio.get_running_loop().create_future()
            group.waiters[job] = waiter
        await self._notify()
        try:
            await asyncio.shield(waiter)
        except asyncio.CancelledError:
            # The client left (deadline, cancel, disconnect): it leaves the queue at once.
            if group.waiters.get(job) is waiter:
                del group.waiters[job]
            await self._notify()
            raise
        return opb.AcquireResponse(
            success=True, waited_ms=1, context_restored=True, grant_epoch=group.epoch
        )

    async def Yield(
        self, request: opb.YieldRequest, context: grpc.aio.ServicerContext
    ) -> opb.YieldResponse:
        await self._enter("Yield", request, context)
        group = self._group(request.group_id)
        if group is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown group {request.group_id!r}")
        assert group is not None
        if group.holder and group.holder != request.job_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"group {request.group_id!r} is held by {group.holder!r}",
            )
        pending = len(group.waiters)
        if group.holder == request.job_id:
            group.holder = ""
            if group.waiters:
                job, waiter = group.waiters.popitem(last=False)
                group.holder = job
                group.epoch += 1
                waiter.set_result(None)
        await self._notify()
        if self.lost_replies["Yield"]:
            self.lost_replies["Yield"] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset (reply lost)")
        return opb.YieldResponse(
            success=True, pending_waiters=pending, snapshot_deferred=pending == 0
        )

    async def ListGroups(
        self, request: opb.ListGroupsRequest, context: grpc.aio.ServicerContext
    ) -> opb.ListGroupsResponse:
        await self._enter("ListGroups", request, context)
        return opb.ListGroupsResponse(group_ids=sorted(self.groups))

    async def GetGroupStatus(
        self, request: opb.GetGroupStatusRequest, context: grpc.aio.ServicerContext
    ) -> opb.GetGroupStatusResponse:
        await self._enter("GetGroupStatus", request, context)
        group = self._group(request.group_id)
        if group is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown group {request.group_id!r}")
        assert group is not None
        status = opb.GroupStatus(
            group_id=request.group_id,
            group_state=(
                opb.GroupStatus.STATE_LOCKED if group.holder else opb.GroupStatus.STATE_IDLE
            ),
            locking_job=group.holder,
            active_job=group.holder,
            loaded_job=group.holder,
            waiter_queue_depth=len(group.waiters),
            waiting_jobs=list(group.waiters),
            nodes=["node-a", "node-b"],
            grant_epoch=group.epoch,
            detail="fake",
        )
        status.state_timestamp.FromSeconds(1_700_000_000)
        states = [
            opb.SnapshotAgentJobState(
                agent=node, job_id=group.holder, job_state=opb.SnapshotAgentJobState.STATE_RUNNING
            )
            for node in ("node-a", "node-b")
            if group.holder
        ]
        return opb.GetGroupStatusResponse(group=status, agent_job_states=states)

    async def WatchEvents(
        self, request: opb.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[opb.OrchestratorEvent]:
        await self._enter("WatchEvents", request, context)
        for event in self.events:
            if not request.group_id or event.group_id == request.group_id:
                yield event


@dataclasses.dataclass
class Operation:
    job_id: str
    kind: str
    status: int = pb.OPERATION_STATUS_PENDING
    error: str | None = None
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class FakeAgent(Observable, pb_grpc.SnapshotAgentServiceServicer):
    """Snapshot agent double: operations finish when the test says so.

    With ``long_poll=False`` it behaves like an llm-d agent (no WaitOperation).
    """

    def __init__(self, *, long_poll: bool = True, auto_complete: bool = False) -> None:
        self.long_poll = long_poll
        self.auto_complete = auto_complete
        self.operations: dict[str, Operation] = {}
        self.requests: list[tuple[str, Any]] = []
        self.jobs: dict[str, int] = {}

    def _start(self, kind: str, request: Any) -> str:
        self.requests.append((kind, request))
        op_id = f"op-{len(self.operations) + 1}"
        self.operations[op_id] = Operation(request.job_id, kind)
        self.jobs[request.job_id] = pb.JOB_STATE_TRANSITIONING
        if self.auto_complete:
            self.finish(op_id)
        return op_id

    def finish(self, op_id: str, *, error: str | None = None) -> None:
        op = self.operations[op_id]
        op.status = pb.OPERATION_STATUS_FAILED if error else pb.OPERATION_STATUS_COMPLETE
        op.error = error
        if error:
            self.jobs[op.job_id] = pb.JOB_STATE_FAULTED
        else:
            self.jobs[op.job_id] = (
                pb.JOB_STATE_SAVED if op.kind == "snapshot" else pb.JOB_STATE_RUNNING
            )
        op.done.set()

    def _response(self, op_id: str) -> pb.GetOperationResponse:
        op = self.operations[op_id]
        response = pb.GetOperationResponse(
            status=op.status, elapsed_ms=5, job_id=op.job_id, kind=op.kind
        )
        if op.status == pb.OPERATION_STATUS_COMPLETE:
            response.storage_bytes = 1024
        if op.error is not None:
            response.error = op.error
        return response

    async def Snapshot(
        self, request: pb.SnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.SnapshotResponse:
        if request.job_id == "missing":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "job missing is not RUNNING")
        return pb.SnapshotResponse(operation_id=self._start("snapshot", request))

    async def Restore(
        self, request: pb.RestoreRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestoreResponse:
        return pb.RestoreResponse(operation_id=self._start("restore", request))

    async def GetOperation(
        self, request: pb.GetOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetOperationResponse:
        self.requests.append(("get", request))
        if request.operation_id not in self.operations:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"operation {request.operation_id} not found"
            )
        return self._response(request.operation_id)

    async def WaitOperation(
        self, request: pb.WaitOperationRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetOperationResponse:
        if not self.long_poll:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        self.requests.append(("wait", request))
        await self._notify()
        op = self.operations.get(request.operation_id)
        if op is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"operation {request.operation_id} not found"
            )
        assert op is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(op.done.wait(), request.timeout_ms / 1000)
        return self._response(request.operation_id)

    async def Status(
        self, request: pb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.StatusResponse:
        return pb.StatusResponse(
            job_statuses=[
                pb.JobStatus(job_id=job, state=state, group="g", backend="noop")  # type: ignore[arg-type]
                for job, state in sorted(self.jobs.items())
            ],
            accelerator_statuses=[
                pb.AcceleratorStatus(id="gpu-0", memory_used_bytes=1, memory_total_bytes=2)
            ],
            node="node-a",
        )

    async def Grant(
        self, request: pb.GrantRequest, context: grpc.aio.ServicerContext
    ) -> pb.GrantResponse:
        self.jobs[request.job_id] = pb.JOB_STATE_RUNNING
        return pb.GrantResponse(state=pb.JOB_STATE_RUNNING)

    async def ResetJob(
        self, request: pb.ResetJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResetJobResponse:
        self.jobs[request.job_id] = pb.JOB_STATE_IDLE
        return pb.ResetJobResponse(state=pb.JOB_STATE_IDLE)


class ServerThread:
    """An event loop in a thread hosting one grpc.aio server at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-server")
        self._thread.start()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.servicer: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def run(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def invoke() -> T:
            return fn()

        return self.run(invoke())  # type: ignore[no-any-return]

    def start(self, servicer: Any, *, port: int = 0) -> None:
        self.servicer = servicer
        self.run(self._start(servicer, port))

    async def _start(self, servicer: Any, port: int) -> None:
        server = grpc.aio.server()
        if isinstance(servicer, FakeOrchestrator):
            opb_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(servicer, server)
        else:
            pb_grpc.add_SnapshotAgentServiceServicer_to_server(servicer, server)
            health_servicer = health.aio.HealthServicer()
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
            await health_servicer.set("noop", health_pb2.HealthCheckResponse.NOT_SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self.server = server

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop(None))
            self.server = None

    def wait_for(self, predicate: Callable[[Any], bool], timeout: float = 10) -> None:
        """Block until ``predicate(servicer)`` holds (evaluated on every state change)."""
        self.run(self.servicer.wait_for(predicate), timeout)

    async def await_for(self, predicate: Callable[[Any], bool], timeout: float = 10) -> None:
        future = asyncio.run_coroutine_threadsafe(self.servicer.wait_for(predicate), self.loop)
        await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
