"""llm-d's agents: a switch as Snapshot and Restore directives, awaited by polling.

An agent whose Status reply declares no features (``StatusResponse.features`` unset,
see ``tslice.orchestrator.switch.pool.Features``) is llm-d's: it has Snapshot, Restore,
GetOperation and Status, and nothing of tslice's (no Grant, no WaitOperation, no
ResetJob). This module is the only place that speaks to such an agent; the switch
hands a node over to :func:`converge` when the node declared nothing. On each node:

1. evict: snapshot every job of the group that is RUNNING there (and the outgoing
   job), and wait out an operation already in flight;
2. bring in: restore the incoming job if it is SAVED there.

Nothing records the grant on the node (llm-d's agents have no such call): a job with
nothing to restore is resident already. Operations are awaited by polling
GetOperation, from every few milliseconds up to :data:`MAX_POLL_S`, within the
client's ``operation_timeout_s``. A FAULTED job cannot be reset there: the node
refuses the switch (FAILED_PRECONDITION), which the switch counts towards marking
the node degraded. Workloads register on llm-d's agents behind the orchestrator's
back (RUNNING from registration), so every switch starts from a fresh Status read.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents

#: First and longest pause between two GetOperation polls, seconds.
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.5


async def converge(step: steps.Step, view: steps.NodeView) -> None:
    """Make the plan's target the group's only resident job on the node."""
    plan = step.plan
    try:
        for _ in range(steps.MAX_REPLANS):
            if await _evict(step, view) or await _settle(step, plan.to_job, view):
                view = await step.read()
                continue
            target = view.get(plan.to_job)
            if target is not None and target.state == pb.JOB_STATE_SAVED:
                await _move(step, "restore", plan.to_job)
            return
        raise steps.StepFailed("plan", "job states keep changing under the switch")
    finally:
        step.forget_view()


async def _evict(step: steps.Step, view: steps.NodeView) -> bool:
    """Snapshot the group's residents other than the target; True if Status must be re-read."""
    for job in step.plan.evictees(view):
        if view[job].state == pb.JOB_STATE_TRANSITIONING:
            return await _settle(step, job, view)
        await _move(step, "snapshot", job)
        view[job] = steps.JobView(pb.JOB_STATE_SAVED, view[job].group)
    touched = (step.plan.from_job, step.plan.to_job)
    for job, jv in view.items():
        if jv.state == pb.JOB_STATE_FAULTED and (jv.group == step.plan.group or job in touched):
            return await _settle(step, job, view)
    return False


async def _settle(step: steps.Step, job: str, view: steps.NodeView) -> bool:
    """Wait out an operation in flight; True if one was waited on. A FAULTED job refuses."""
    jv = view.get(job)
    if jv is None:
        return False
    if jv.state == pb.JOB_STATE_FAULTED:
        raise agents.AgentRejected(
            step.client.address,
            "reset",
            f"job {job} is FAULTED on node {step.name} and llm-d's agent cannot reset it; "
            "restart the job's workload or the agent there",
            grpc.StatusCode.FAILED_PRECONDITION,
        )
    if jv.state != pb.JOB_STATE_TRANSITIONING:
        return False
    if not jv.operation_id:
        raise steps.StepFailed("wait", f"job {job} is TRANSITIONING with no operation id")
    step.calling("wait")
    await _poll(step, jv.operation_id)
    return True


async def _move(step: steps.Step, kind: str, job: str) -> None:
    """One Snapshot or Restore of ``job``, awaited; raises OperationFailed if it failed."""
    group = step.plan.group
    step.calling(kind)
    t0 = time.monotonic()
    if kind == "snapshot":
        op_id = await step.client.snapshot(job_id=job, group=group)
    else:
        op_id = await step.client.restore(job_id=job, group=group)
    op = await _poll(step, op_id)
    step.observe(kind, time.monotonic() - t0)
    if op.status != pb.OPERATION_STATUS_COMPLETE:
        raise agents.OperationFailed(
            step.client.address, kind, f"{kind} of job {job} failed: {op.error}"
        )
    step.moved(kind, job, op_id, op)


async def _poll(step: steps.Step, op_id: str) -> pb.GetOperationResponse:
    """GetOperation until the operation finished (llm-d's agents have no long-poll)."""
    client = step.client
    deadline = time.monotonic() + client.operation_timeout_s
    pause = FIRST_POLL_S
    while True:
        op = await client.get_operation(op_id)
        if op.status != pb.OPERATION_STATUS_PENDING:
            return op
        left = deadline - time.monotonic()
        if left <= 0:
            raise agents.OperationFailed(
                client.address,
                "wait",
                f"operation {op_id} did not finish within "
                f"{client.operation_timeout_s:g} s (operation_timeout_s)",
            )
        await asyncio.sleep(min(pause, left))
        pause = min(pause * 2, MAX_POLL_S)
