"""The agent's part of a hand-over's trace (with tracing on: ``tslice.server.tracing``).

Installed once at start, and only when tracing is on, as wrappers around the servicer's
``Grant`` and the backends' operations, so the agent's code path is unchanged (and costs
nothing more) when it is off:

* ``tslice.agent.grant``: one node step, a server span whose parent is the trace context
  the orchestrator sent in the call's metadata;
* ``tslice.backend.<kind>``: each backend operation the step runs (its task inherits the
  step's span), failed when the operation failed.
"""

from __future__ import annotations

from typing import Any

import grpc

from tslice.agent import server
from tslice.agent.backends import guarded
from tslice.agent.jobs import model
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.server import tracing


def install(
    servicer: server.SnapshotAgentServicer, backends: guarded.GuardedBackends, *, node: str
) -> None:
    """Wrap ``servicer.Grant`` and ``backends.run`` in spans (before the servicer is
    registered); nothing when tracing is off."""
    if not tracing.ENABLED:
        return
    plain_grant = servicer.Grant
    plain_run = backends.run

    async def grant(request: pb.GrantRequest, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        attributes = {
            "tslice.node": node,
            "tslice.group": request.group,
            "tslice.job": request.job_id,
            "tslice.grant_epoch": request.grant_epoch,
            "tslice.evict": list(request.evict),
        }
        metadata = tuple(context.invocation_metadata() or ())
        with tracing.span("tslice.agent.grant", attributes, remote=metadata, server=True):
            return await plain_grant(request, context)

    async def run(
        op: model.Operation, job: model.Job, config: pb.BackendConfig | None
    ) -> model.Outcome:
        attributes = {
            "tslice.node": node,
            "tslice.group": job.group,
            "tslice.job": job.job_id,
            "tslice.backend": op.backend,
            "tslice.operation_id": op.op_id,
        }
        with tracing.span(f"tslice.backend.{op.kind.value}", attributes) as current:
            outcome = await plain_run(op, job, config)
            if outcome.error:
                tracing.failed(current, outcome.error)
            return outcome

    servicer.Grant = grant  # type: ignore[method-assign]
    backends.run = run  # type: ignore[method-assign]
