"""A test double of llm-d's node agent: only the RPCs of shared WIRE.md, on a real socket.

It has Snapshot, Restore, GetOperation and Status (replies carry llm-d's fields only,
so no ``features``); every other RPC of the service answers UNIMPLEMENTED, as a Go
server without them would. Operations finish ``op_s`` after they started. Every RPC
that reaches the server is counted by method name (an interceptor sees them all, the
unimplemented ones too).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc

#: What a job's state becomes when its operation completes.
_AFTER = {"snapshot": pb.JOB_STATE_SAVED, "restore": pb.JOB_STATE_RUNNING}
#: The state an operation needs to start from.
_BEFORE = {"snapshot": pb.JOB_STATE_RUNNING, "restore": pb.JOB_STATE_SAVED}


class _Counting(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, calls: collections.Counter[str]) -> None:
        self._calls = calls

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        self._calls[handler_call_details.method.rsplit("/", 1)[1]] += 1
        return await continuation(handler_call_details)


class LlmdAgent(pb_grpc.SnapshotAgentServiceServicer):
    """Jobs and their states as llm-d's agent reports them (no groups, no operation ids)."""

    def __init__(self, jobs: dict[str, int], *, op_s: float = 0.02, bytes_: int = 1000) -> None:
        self.jobs = dict(jobs)
        self.calls: collections.Counter[str] = collections.Counter()
        self._op_s = op_s
        self._bytes = bytes_
        self._ops: dict[str, pb.GetOperationResponse] = {}
        self._ids = itertools.count(1)
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, port: int = 0) -> str:
        server = grpc.aio.server(interceptors=[_Counting(self.calls)])
        pb_grpc.add_SnapshotAgentServiceServicer_to_server(self, server)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        self._server = server
        self.address = f"127.0.0.1:{bound}"
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None

    def _start(self, kind: str, job: str) -> str:
        op_id = f"op-{next(self._ids)}"
        self._ops[op_id] = pb.GetOperationResponse(status=pb.OPERATION_STATUS_PENDING)
        self.jobs[job] = pb.JOB_STATE_TRANSITIONING

        def finish() -> None:
            self.jobs[job] = _AFTER[kind]
            done = pb.GetOperationResponse(status=pb.OPERATION_STATUS_COMPLETE, elapsed_ms=20)
            if kind == "snapshot":
                done.storage_bytes = self._bytes
            else:
                done.snapshot_device_bytes = self._bytes
            self._ops[op_id] = done

        asyncio.get_running_loop().call_later(self._op_s, finish)
        return op_id

    async def _directive(self, kind: str, job: str, context: Any) -> str:
        if self.jobs.get(job) != _BEFORE[kind]:
            state = pb.JobState.Name(self.jobs.get(job, pb.JOB_STATE_UNSPECIFIED))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{job} is {state}")
        return self._start(kind, job)

    async def Snapshot(self, request: pb.SnapshotRequest, context: Any) -> pb.SnapshotResponse:
        return pb.SnapshotResponse(
            operation_id=await self._directive("snapshot", request.job_id, context)
        )

    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
        return pb.RestoreResponse(
            operation_id=await self._directive("restore", request.job_id, context)
        )

    async def GetOperation(
        self, request: pb.GetOperationRequest, context: Any
    ) -> pb.GetOperationResponse:
        op = self._ops.get(request.operation_id)
        if op is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, request.operation_id)
        return op

    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        return pb.StatusResponse(
            job_statuses=[pb.JobStatus(job_id=j, state=s) for j, s in sorted(self.jobs.items())]
        )
