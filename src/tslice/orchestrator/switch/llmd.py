"""llm-d's agents: a switch as Snapshot and Restore directives, awaited by polling.

An agent whose Status reply declares no features (``StatusResponse.features`` unset) is
llm-d's: it has Snapshot, Restore, GetOperation and Status, and nothing of tslice's (no
Grant, no WaitOperation, no ResetJob). :class:`LlmdLink` is the only thing that speaks to
such an agent (``switch.links``: it is chosen once per connection). On each node:

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
from tslice.orchestrator.switch import links, pool
from tslice.orchestrator.switch import plan as plans

#: First and longest pause between two GetOperation polls, seconds.
FIRST_POLL_S = 0.005
MAX_POLL_S = 0.5


class LlmdLink(links.AgentLink):
    """llm-d's agents: Snapshot and Restore, polled (see the module docstring)."""

    def __init__(self, client: pool.AgentClient) -> None:
        self._client = client

    async def converge(self, step: links.Step, view: plans.NodeView) -> None:
        p = step.plan
        try:
            for _ in range(plans.MAX_REPLANS):
                if await self._evict(step, view) or await self._settle(step, p.to_job, view):
                    view = await step.read()
                    continue
                target = view.get(p.to_job)
                if target is not None and target.state == pb.JOB_STATE_SAVED:
                    await self._move(step, "restore", p.to_job)
                return
            raise plans.StepFailed("plan", "job states keep changing under the switch")
        finally:
            step.forget_view()

    async def _evict(self, step: links.Step, view: plans.NodeView) -> bool:
        """Snapshot the group's residents other than the target; True if Status must be
        read again."""
        p = step.plan
        for job in p.evictees(view):
            if view[job].state == pb.JOB_STATE_TRANSITIONING:
                return await self._settle(step, job, view)
            await self._move(step, "snapshot", job)
            view[job] = plans.JobView(pb.JOB_STATE_SAVED, view[job].group)
        touched = (p.from_job, p.to_job)
        for job, jv in view.items():
            if jv.state == pb.JOB_STATE_FAULTED and (jv.group == p.group or job in touched):
                return await self._settle(step, job, view)
        return False

    async def _settle(self, step: links.Step, job: str, view: plans.NodeView) -> bool:
        """Wait out an operation in flight; True if one was waited on. A FAULTED job refuses."""
        jv = view.get(job)
        if jv is None:
            return False
        if jv.state == pb.JOB_STATE_FAULTED:
            raise pool.AgentRejected(
                self._client.address,
                "reset",
                f"job {job} is FAULTED on node {step.node.name} and llm-d's agent cannot reset "
                "it; restart the job's workload or the agent there",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        if jv.state != pb.JOB_STATE_TRANSITIONING:
            return False
        if not jv.operation_id:
            raise plans.StepFailed("wait", f"job {job} is TRANSITIONING with no operation id")
        step.operation = "wait"
        await self._poll(jv.operation_id)
        return True

    async def _move(self, step: links.Step, kind: str, job: str) -> None:
        """One Snapshot or Restore of ``job``, awaited; raises OperationFailed if it failed."""
        group, client = step.plan.group, self._client
        step.operation = kind
        t0 = time.monotonic()
        if kind == "snapshot":
            op_id = await client.snapshot(job_id=job, group=group)
        else:
            op_id = await client.restore(job_id=job, group=group)
        op = await self._poll(op_id)
        step.observe(kind, time.monotonic() - t0)
        if op.status != pb.OPERATION_STATUS_COMPLETE:
            raise pool.OperationFailed(
                client.address, kind, f"{kind} of job {job} failed: {op.error}"
            )
        step.moved(kind, job, op)

    async def _poll(self, op_id: str) -> pb.GetOperationResponse:
        """GetOperation until the operation finished (llm-d's agents have no long-poll)."""
        client = self._client
        deadline = time.monotonic() + client.operation_timeout_s
        pause = FIRST_POLL_S
        while True:
            op = await client.get_operation(op_id)
            if op.status != pb.OPERATION_STATUS_PENDING:
                return op
            left = deadline - time.monotonic()
            if left <= 0:
                raise pool.OperationFailed(
                    client.address,
                    "wait",
                    f"operation {op_id} did not finish within "
                    f"{client.operation_timeout_s:g} s (operation_timeout_s)",
                )
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, MAX_POLL_S)
