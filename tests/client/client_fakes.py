"""The one double left in the client tests: a snapshot agent for SnapshotAgentClient.

The client tests run against real servers (servers.py); this agent double stays for
what a real agent cannot be made to do on demand: hold an operation PENDING until the
test finishes it (or fails it with a given error), and behave as an llm-d agent that
has no WaitOperation. It is a grpc.aio servicer bound to 127.0.0.1:0 on an event loop
in a background thread (:class:`ServerThread`), so blocking clients talk to it over a
real socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

T = TypeVar("T")


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
