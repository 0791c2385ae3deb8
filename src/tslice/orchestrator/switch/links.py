"""How the orchestrator moves one node for a switch, in the protocol its agent speaks.

An :class:`AgentLink` is chosen once per agent connection (``switch.step.chosen``, at the
Status read that a node's first step makes, and again only after the connection was
lost), from what the agent declares in that Status reply (``StatusResponse.features``).
Nothing else looks at the declaration:

- :class:`GrantLink` (tslice's agents, ``grant_step``): one Grant per node and switch:
  ``evict`` the outgoing resident and any other job of the group running there,
  ``give_way`` the deferred residents of overlapping groups, ``restore`` the incoming
  job if it is SAVED, record the grant with its epoch. The agent answers once the node
  is done, or after a wait chunk with the operations in flight, which are then awaited
  (WaitOperation) before the Grant is re-issued (it is idempotent). FAULTED jobs are reset
  first (ResetJob: the agent refuses to move them blindly). The Grants travel on one
  long-lived GrantStream where the agent declares it (half a unary call each); an agent
  whose stream turns out missing gets unary Grants from then on (that fallback is inside
  the link, decided once), and so does a hand-over being traced (its trace context goes
  in the call's metadata);
- :class:`~tslice.orchestrator.switch.llmd.LlmdLink` (llm-d's agents, which declare
  nothing): Snapshot and Restore directives, awaited by polling.

The node's step (``switch.step.NodeStep``) runs a link; what a link needs of it is
:class:`Step`.
"""

from __future__ import annotations

import abc
import logging
import operator
import time
from collections.abc import Awaitable
from typing import Protocol

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import config, tracing_hooks
from tslice.orchestrator.switch import plan as plans
from tslice.orchestrator.switch import pool
from tslice.rpc import multiplex
from tslice.server import tracing

log = logging.getLogger(__name__)

Kind = opb.OrchestratorEvent


class Step(Protocol):
    """What a link uses of the node's step."""

    node: config.NodeRef
    client: pool.AgentClient
    plan: plans.SwitchPlan

    #: The agent call under way (named in failure reports): set before each call.
    operation: str

    def observe(self, operation: str, seconds: float) -> None: ...

    def moved(self, kind: str, job: str, op: pb.GetOperationResponse) -> None:
        """A snapshot or a restore of ``job`` completed: report it (its event)."""

    async def read(self) -> plans.NodeView:
        """Re-read the node's Status (the view is then fresh)."""

    def forget_view(self) -> None:
        """Drop the cached view: the next switch reads the node's Status first."""


class AgentLink(abc.ABC):
    """One agent connection's protocol for a switch's node step."""

    @abc.abstractmethod
    def converge(self, step: Step, view: plans.NodeView) -> Awaitable[None]:
        """Make the plan's target the group's only resident job on the node, granted.
        Raises ``pool.AgentError`` or ``plans.StepFailed`` (the step retries)."""

    async def prefetch(self, *, job_id: str, group: str, footprint_bytes: int) -> str:
        """Bring a SAVED job's state in ahead of its grant where it fits; what was done."""
        return "the agent's protocol has no prefetch"

    async def close(self) -> None:
        """The connection is over (its streams end)."""
        return None


class GrantLink(AgentLink):
    """tslice's agents: one Grant per node and switch (see the module docstring)."""

    def __init__(self, client: pool.AgentClient, *, stream: bool, prefetch: bool) -> None:
        self._client = client
        self._prefetch = prefetch
        #: The GrantStream (None: unary Grants, for good on this connection).
        self._stream: multiplex.Caller[pb.GrantStreamRequest, pb.GrantStreamResponse] | None = (
            multiplex.Caller(
                client.open_grant_stream,
                reply_id=operator.attrgetter("request_id"),
                name=f"agent {client.address}",
            )
            if stream
            else None
        )

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()

    def converge(self, step: Step, view: plans.NodeView) -> Awaitable[None]:
        # Nothing FAULTED to reset (the usual case): the step is one Grant.
        if not _faulted(step, view):
            return self._grant(step, view)
        return self._converge_after_resets(step, view)

    async def _converge_after_resets(self, step: Step, view: plans.NodeView) -> None:
        for _ in range(plans.MAX_REPLANS):
            touched = _faulted(step, view)
            if not touched:
                await self._grant(step, view)
                return
            for job, group in touched:
                step.operation = "reset"
                t0 = time.monotonic()
                await self._client.reset_job(job_id=job, group=group)
                step.observe("reset", time.monotonic() - t0)
            view = await step.read()
        raise plans.StepFailed("plan", "job states keep changing under the switch")

    async def _grant(self, step: Step, view: plans.NodeView) -> None:
        """One Grant, re-issued after waiting on the operations it reports."""
        p, client = step.plan, self._client
        node = step.node.name
        give_way = p.giving_way(node, view.others)
        request = pb.GrantRequest(
            job_id=p.to_job,
            group=p.group,
            grant_epoch=p.epoch,
            footprint_bytes=p.footprint_bytes,
            evict=p.evictees(view),
            restore=True,
            give_way=give_way,
            devices=step.node.devices or (),
        )
        deadline = time.monotonic() + client.operation_timeout_s
        noted: set[str] = set()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise pool.OperationFailed(
                    client.address,
                    "grant",
                    f"job {p.to_job} was not made resident within "
                    f"{client.operation_timeout_s:g} s (operation_timeout_s)",
                )
            wait_s = min(client.wait_chunk_s, left)
            request.wait_ms = max(1, int(wait_s * 1000))
            step.operation = "grant"
            t0 = time.monotonic()
            resp = await self.grant(request, timeout_s=wait_s + client.rpc_timeout_s)
            step.observe("grant", time.monotonic() - t0)
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                _note(step, op_id, op, view, noted)
            if resp.granted:
                view[p.to_job] = plans.JobView(pb.JOB_STATE_RUNNING, p.group)
                return
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                if op.status == pb.OPERATION_STATUS_PENDING:
                    step.operation = "wait"
                    _note(step, op_id, await client.wait_operation(op_id), view, noted)

    async def grant(self, request: pb.GrantRequest, *, timeout_s: float) -> pb.GrantResponse:
        """One Grant: over the stream, else (no stream, or a traced hand-over) unary."""
        stream = self._stream
        if stream is None or (tracing.ENABLED and tracing_hooks.in_trace()):
            return await self._client.grant(request, timeout_s=timeout_s)
        try:
            reply = await stream.call(
                lambda rid: pb.GrantStreamRequest(request_id=rid, grant=request),
                timeout_s=timeout_s,
            )
        except multiplex.Unsupported:
            log.warning(
                "agent %s declared grant_stream but has no GrantStream; unary Grants from now on",
                self._client.address,
            )
            self._stream = None
            return await self._client.grant(request, timeout_s=timeout_s)
        except multiplex.Broken as err:
            raise self._client.error("grant", err.code, err.detail) from err
        except TimeoutError as err:
            raise self._client.error("grant", grpc.StatusCode.DEADLINE_EXCEEDED, str(err)) from err
        if reply.status_code != grpc.StatusCode.OK.value[0]:
            code = multiplex.status_code(reply.status_code)
            raise self._client.error("grant", code, reply.status_message)
        return reply.grant

    async def prefetch(self, *, job_id: str, group: str, footprint_bytes: int) -> str:
        """Only where the agent declares ``prefetch`` (an agent that does not would take the
        Restore for a real one) and the footprint fits in the free memory of every
        accelerator its Status lists (read now)."""
        if not self._prefetch:
            return "the agent declares no prefetch"
        resp = await self._client.status()
        free = [a.memory_total_bytes - a.memory_used_bytes for a in resp.accelerator_statuses]
        if not free or min(free) < footprint_bytes:
            return f"does not fit: {min(free, default=0)} bytes free on the fullest device"
        await self._client.restore_early(job_id=job_id, group=group)
        return "started"


def _faulted(step: Step, view: plans.NodeView) -> list[tuple[str, str]]:
    """The FAULTED jobs the switch touches (job, group), to reset before its Grant.

    Those of overlapping groups that may give way count too: a give-way snapshot that
    failed leaves its state FAULTED on the devices, and nothing else resets it while its
    own group has no switch.
    """
    p = step.plan
    touched: list[tuple[str, str]] = []
    for job, jv in view.items():
        if jv.state == pb.JOB_STATE_FAULTED and (
            jv.group == p.group or job in (p.from_job, p.to_job)
        ):
            touched.append((job, jv.group))
    faulted: list[tuple[str, str]] = []
    for key, jv in view.others.items():
        if jv.state == pb.JOB_STATE_FAULTED and p.may_give_way(step.node.name, key[1]):
            faulted.append(key)
    faulted.sort()
    return touched + faulted


def _note(
    step: Step, op_id: str, op: pb.GetOperationResponse, view: plans.NodeView, noted: set[str]
) -> None:
    """Learn from an operation of the Grant: view, events and metrics, once each (a
    re-issued Grant lists them again)."""
    if op.status == pb.OPERATION_STATUS_PENDING or op_id in noted:
        return
    noted.add(op_id)
    p = step.plan
    if op.status == pb.OPERATION_STATUS_FAILED:
        raise pool.OperationFailed(
            step.client.address, op.kind, f"{op.kind} of job {op.job_id} failed: {op.error}"
        )
    if op.group and op.group != p.group:
        # Another group's resident gave way: only its record changes.
        view.others[(op.job_id, op.group)] = plans.JobView(pb.JOB_STATE_SAVED, op.group, op_id)
        step.observe(op.kind, op.elapsed_ms / 1000)
        step.moved("snapshot", op.job_id, op)
        return
    group = view[op.job_id].group if op.job_id in view else p.group
    saved = op.kind == "snapshot"
    view[op.job_id] = plans.JobView(
        pb.JOB_STATE_SAVED if saved else pb.JOB_STATE_RUNNING, group, op_id
    )
    if op.kind in ("snapshot", "restore"):
        step.observe(op.kind, op.elapsed_ms / 1000)
        step.moved(op.kind, op.job_id, op)
