"""The coordinated context switch on every node of a group.

Each node converges on its own, concurrently with the others, towards "only the
incoming job is resident, and it has been granted". Residency is per (job, group):
a switch moves only this group's state of each job, and a job's state for another
group stays where it is, unless that group shares the node's devices, has no holder
and the incoming job would not fit beside it (``give_way``, see
``tslice.orchestrator.group.overlap``).

How a node gets there depends on what its agent declared in its Status reply
(``tslice.orchestrator.switch.pool.Features``), read before the node's first step and
again whenever its view was dropped; this is the one place that looks at it:

- a tslice agent (``grant_step``) takes one Grant per node: ``evict`` the outgoing
  resident and any other job of the group running there, ``give_way`` the deferred
  residents of overlapping groups, ``restore`` the incoming job if it is SAVED,
  record the grant with its epoch. The agent answers once the node is done, or after
  a wait chunk with the operations in flight, which are then awaited (WaitOperation)
  before the Grant is re-issued (it is idempotent). FAULTED jobs are reset first
  (ResetJob: the agent refuses to move them blindly);
- an agent that declares nothing is llm-d's and gets Snapshot/Restore directives
  (``tslice.orchestrator.switch.llmd``).

A node that keeps refusing (it answers with a permanent status such as
FAILED_PRECONDITION on a fresh view) is retried ``max_refusals`` times, one whose
snapshot or restore keeps failing (the job is left FAULTED there)
``max_operation_failures`` times in a row, and then it is marked degraded
(:class:`NodeDegraded`); a refusal that can never change (the
incoming job's state does not fit the devices at all) ends the switch at once
(:class:`JobRefused`). Any other failing step is retried with jittered exponential
backoff for as long as somebody wants the switch (``SwitchHooks.should_continue``),
re-reading the node's Status first, so the same code finishes a switch interrupted
by a crash (roll forward is idempotent).

To keep hand-overs cheap the group keeps a per-node view of job states learnt from
its own operations (``tslice.orchestrator.switch.plan``); a view is dropped (and Status
re-read) on any error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import config
from tslice.orchestrator.events import bus as events
from tslice.orchestrator.switch import llmd as compat_agent
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents
from tslice.rpc import refusals
from tslice.server import grant_marks


class GiveUp(Exception):
    """Nobody wants the switch any more and a node keeps failing."""


class Deposed(GiveUp):
    """An agent has seen a newer leader term: this elected leader was deposed. Nothing
    moved; the switch is the new leader's now (this replica steps down)."""


class NodeDegraded(GiveUp):
    """The node kept refusing the switch (not unreachable: it answered) past the bound."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"node {node} degraded: {reason}")
        self.node = node
        self.reason = reason


class StaleEpoch(GiveUp):
    """A node refused the grant as stale and named its mark: the orchestrator's epoch is
    behind what the agents saw (its database was lost or truncated)."""

    def __init__(self, node: str, mark: int, detail: str) -> None:
        super().__init__(f"{node}: {detail}")
        self.node = node
        self.mark = mark


class JobRefused(GiveUp):
    """An agent refused the incoming job for good (e.g. its state can never fit)."""

    def __init__(self, node: str, code: refusals.Code, detail: str) -> None:
        super().__init__(f"{node}: {detail}")
        self.code = code
        self.detail = detail


#: Refusals that say the request itself can never be served, whatever is retried.
_REFUSED_FOR_GOOD = {grpc.StatusCode.RESOURCE_EXHAUSTED: refusals.Code.RESOURCE_EXHAUSTED}
#: Refusals that a retry on a fresh view does not change by itself (counted to the bound);
#: anything else (UNAVAILABLE, ABORTED, a failed operation) is retried while wanted.
_PERMANENT = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
)


def _stale_mark(err: agents.AgentRejected, epoch: int) -> int | None:
    """The agent's mark if ``err`` refuses ``epoch`` as stale and the mark can be passed."""
    if err.code != grpc.StatusCode.FAILED_PRECONDITION or err.operation != "grant":
        return None
    mark = grant_marks.mark_of(err.reason)
    if mark is None or mark < epoch or mark >= grant_marks.MAX_ADOPTED:
        return None
    return mark


class SwitchHooks(Protocol):
    """What the switch reports to (and asks of) its group driver."""

    def wants(self, kind: opb.OrchestratorEvent.Kind) -> bool: ...

    def publish(self, event: opb.OrchestratorEvent) -> None: ...

    def observe(self, node: str, operation: str, seconds: float) -> None: ...

    def node_ok(self, node: str) -> None: ...

    def node_failed(
        self, node: str, operation: str, detail: str, *, unreachable: bool, retry_in: float
    ) -> None: ...

    def should_continue(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.05
    max_s: float = 5.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * (2**attempt))
        return float(base * random.uniform(0.5, 1.0))


@dataclasses.dataclass
class _Context:
    """What every node of one switch shares."""

    plan: steps.SwitchPlan
    views: dict[str, steps.NodeView]
    hooks: SwitchHooks
    backoff: Backoff
    max_refusals: int
    max_operation_failures: int


class NodeSwitcher:
    """Converges one node for one switch (see the module docstring); a ``steps.Step``."""

    def __init__(self, node: config.NodeRef, client: agents.AgentClient, context: _Context) -> None:
        self.node = node
        self.client = client
        self.plan = context.plan
        self._ctx = context
        self.restored = False
        self._op = "status"
        #: Operations already reported (a re-issued Grant lists them again).
        self._noted: set[str] = set()
        #: Called once, when the node's first call is under way (or the node is done).
        self.first_call: Callable[[], None] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    async def run(self) -> bool:
        """Return whether a restore happened on this node; raise GiveUp."""
        try:
            return await self._run()
        finally:
            self._calling()

    async def _run(self) -> bool:
        attempt = 0
        refusals = 0
        #: Failed operations in a row: a backend that keeps failing is degraded, not retried
        #: for ever (the group would stay SWITCHING while anyone waits).
        failures = 0
        views, hooks = self._ctx.views, self._ctx.hooks
        while True:
            fresh = self.name not in views
            try:
                await self._converge()
                hooks.node_ok(self.name)
                return self.restored
            except agents.AgentUnreachable as err:
                unreachable, detail = True, str(err)
                refusals = failures = 0
            except agents.AgentRejected as err:
                unreachable, detail = False, str(err)
                if isinstance(err, agents.AgentDeposed) and err.sent:
                    # Retrying would only mark a healthy node degraded (an embedded
                    # orchestrator, term 0, does get the node degraded with the fix).
                    raise Deposed(f"{self.name}: {err.reason}") from err
                if err.code in _REFUSED_FOR_GOOD:
                    raise JobRefused(self.name, _REFUSED_FOR_GOOD[err.code], err.reason) from err
                mark = _stale_mark(err, self.plan.epoch)
                if mark is not None:
                    raise StaleEpoch(self.name, mark, err.reason) from err
                if not fresh:
                    # Our cached view was stale: re-read Status and retry at once.
                    views.pop(self.name, None)
                    continue
                refusals = refusals + 1 if err.code in _PERMANENT else 0
            except (agents.OperationFailed, steps.StepFailed) as err:
                unreachable, detail = False, str(err)
                refusals = 0
                if isinstance(err, agents.OperationFailed):
                    failures += 1  # the snapshot/restore itself failed (job FAULTED)
            views.pop(self.name, None)
            if refusals >= self._ctx.max_refusals:
                # It answers, and keeps saying no: retrying forever would wedge the group.
                raise NodeDegraded(self.name, f"{self._op} refused {refusals} times: {detail}")
            if failures >= self._ctx.max_operation_failures:
                raise NodeDegraded(self.name, f"{self._op} failed {failures} times: {detail}")
            if not hooks.should_continue():
                raise GiveUp(f"{self.name}: {detail}")
            delay = self._ctx.backoff.delay(attempt)
            attempt += 1
            hooks.node_failed(self.name, self._op, detail, unreachable=unreachable, retry_in=delay)
            self._calling()  # nothing is held back while this node waits to retry
            await asyncio.sleep(delay)

    # ---- steps.Step ------------------------------------------------------------------------

    def calling(self, operation: str) -> None:
        self._op = operation
        self._calling()

    def observe(self, operation: str, seconds: float) -> None:
        self._ctx.hooks.observe(self.name, operation, seconds)

    def moved(self, kind: str, job: str, op_id: str, op: pb.GetOperationResponse) -> None:
        if kind == "snapshot":
            self._publish(
                opb.OrchestratorEvent.KIND_SNAPSHOT_DONE, job, op.elapsed_ms, op.storage_bytes
            )
            return
        if job == self.plan.to_job:
            self.restored = True
        self._publish(
            opb.OrchestratorEvent.KIND_RESTORE_DONE, job, op.elapsed_ms, op.snapshot_device_bytes
        )

    async def read(self) -> steps.NodeView:
        view, _ = await self._read()
        return view

    def forget_view(self) -> None:
        self._ctx.views.pop(self.name, None)

    # ---- the path ----------------------------------------------------------------------

    def _issued(self) -> Callable[[], None] | None:
        """The callback for the next call: ``first_call`` for the first one, else None."""
        notify, self.first_call = self.first_call, None
        return notify

    def _calling(self) -> None:
        """A call is about to be made (paths off the hand-over's fast path)."""
        notify = self._issued()
        if notify is not None:
            notify()

    async def _read(self) -> tuple[steps.NodeView, agents.Features]:
        self._op = "status"
        t0 = time.monotonic()
        resp = await self.client.status(issued=self._issued())
        self.observe("status", time.monotonic() - t0)
        view = steps.view_from_status(resp, self.plan.group)
        self._ctx.views[self.name] = view
        return view, agents.Features.declared(resp)

    async def _converge(self) -> None:
        view = self._ctx.views.get(self.name)
        features = self.client.features
        if view is None or features is None:
            view, features = await self._read()
        if not features.grant_step:
            await compat_agent.converge(self, view)
            return
        for _ in range(steps.MAX_REPLANS):
            if not await self._reset_faulted(view):
                await self._grant(view)
                return
            view, _ = await self._read()
        raise steps.StepFailed("plan", "job states keep changing under the switch")

    async def _reset_faulted(self, view: steps.NodeView) -> bool:
        """Reset FAULTED jobs the switch touches; True if any was reset.

        Those of overlapping groups that may give way count too: a give-way snapshot
        that failed leaves its state FAULTED on the devices, and nothing else resets it
        while its own group has no switch.
        """
        p = self.plan
        touched = [
            (job, jv.group)
            for job, jv in view.items()
            if jv.state == pb.JOB_STATE_FAULTED
            and (jv.group == p.group or job in (p.from_job, p.to_job))
        ]
        touched += [
            key
            for key, jv in sorted(view.others.items())
            if jv.state == pb.JOB_STATE_FAULTED and p.may_give_way(self.name, key[1])
        ]
        for job, group in touched:
            self.calling("reset")
            t0 = time.monotonic()
            await self.client.reset_job(job_id=job, group=group)
            self.observe("reset", time.monotonic() - t0)
        return bool(touched)

    def _give_way(self, view: steps.NodeView) -> list[tuple[str, str]]:
        """Other groups' residents here that may be snapshotted to make room."""
        p, others = self.plan, view.others.items()
        return sorted(
            key
            for key, jv in others
            if jv.state in steps.RESIDENT and p.may_give_way(self.name, key[1])
        )

    async def _grant(self, view: steps.NodeView) -> None:
        """One Grant, re-issued after waiting on the operations it reports."""
        p = self.plan
        evict = p.evictees(view)
        give_way = self._give_way(view)
        deadline = time.monotonic() + self.client.operation_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise agents.OperationFailed(
                    self.client.address,
                    "grant",
                    f"job {p.to_job} was not made resident within "
                    f"{self.client.operation_timeout_s:g} s (operation_timeout_s)",
                )
            self._op = "grant"
            t0 = time.monotonic()
            resp = await self.client.grant(
                job_id=p.to_job,
                group=p.group,
                epoch=p.epoch,
                footprint_bytes=p.footprint_bytes,
                evict=evict,
                give_way=give_way,
                devices=self.node.devices or (),
                wait_s=min(self.client.wait_chunk_s, left),
                issued=self._issued(),
            )
            self.observe("grant", time.monotonic() - t0)
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                self._note(op_id, op, view)
            if resp.granted:
                view[p.to_job] = steps.JobView(pb.JOB_STATE_RUNNING, p.group)
                return
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                if op.status == pb.OPERATION_STATUS_PENDING:
                    self.calling("wait")
                    self._note(op_id, await self.client.wait_operation(op_id), view)

    def _note(self, op_id: str, op: pb.GetOperationResponse, view: steps.NodeView) -> None:
        """Learn from an operation of the Grant: view, events and metrics, once each."""
        if op.status == pb.OPERATION_STATUS_PENDING or op_id in self._noted:
            return
        self._noted.add(op_id)
        p = self.plan
        if op.status == pb.OPERATION_STATUS_FAILED:
            raise agents.OperationFailed(
                self.client.address, op.kind, f"{op.kind} of job {op.job_id} failed: {op.error}"
            )
        if op.group and op.group != p.group:
            # Another group's resident gave way: only its record changes.
            view.others[(op.job_id, op.group)] = steps.JobView(pb.JOB_STATE_SAVED, op.group, op_id)
            self.observe(op.kind, op.elapsed_ms / 1000)
            self._publish(
                opb.OrchestratorEvent.KIND_SNAPSHOT_DONE, op.job_id, op.elapsed_ms, op.storage_bytes
            )
            return
        group = view[op.job_id].group if op.job_id in view else p.group
        saved = op.kind == "snapshot"
        state = pb.JOB_STATE_SAVED if saved else pb.JOB_STATE_RUNNING
        view[op.job_id] = steps.JobView(state, group, op_id)
        if op.kind in ("snapshot", "restore"):
            self.observe(op.kind, op.elapsed_ms / 1000)
            self.moved(op.kind, op.job_id, op_id, op)

    def _publish(
        self, kind: opb.OrchestratorEvent.Kind, job: str, elapsed_ms: int, size: int
    ) -> None:
        hooks = self._ctx.hooks
        if hooks.wants(kind):  # nobody watching: not even built
            p = self.plan
            event = events.make_event(
                kind,
                group_id=p.group,
                job_id=job,
                node=self.name,
                duration_ms=elapsed_ms,
                from_job=p.from_job or "",
                grant_epoch=p.epoch,
                size_bytes=size,
            )
            hooks.publish(event)


async def run_switch(
    *,
    plan: steps.SwitchPlan,
    nodes: tuple[config.NodeRef, ...],
    pool: agents.AgentPool,
    views: dict[str, steps.NodeView],
    hooks: SwitchHooks,
    backoff: Backoff,
    started: Callable[[], None] | None = None,
    max_refusals: int = 5,
    max_operation_failures: int = 10,
) -> bool:
    """Converge every node concurrently; return whether any node restored the target.

    ``started`` is called once every node's first call is under way (created, its send
    scheduled), so that what it releases (replies, event deliveries) runs after the
    sends; a node that ends before any call counts as under way.
    """
    context = _Context(plan, views, hooks, backoff, max_refusals, max_operation_failures)
    switchers = [NodeSwitcher(n, pool.get(n.address), context) for n in nodes]
    unsent = len(switchers)

    def one_sent() -> None:
        nonlocal unsent
        unsent -= 1
        if unsent == 0 and started is not None:
            started()

    for switcher in switchers:
        switcher.first_call = one_sent
    results = await asyncio.gather(*(s.run() for s in switchers), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    if failures:
        for r in failures:
            if not isinstance(r, GiveUp):
                raise r
        # A refusal for good or a degraded node says more than "gave up".
        for kind in (JobRefused, NodeDegraded):
            for r in failures:
                if isinstance(r, kind):
                    raise r
        stale = [r for r in failures if isinstance(r, StaleEpoch)]
        if stale:
            raise max(stale, key=lambda r: r.mark)
        raise GiveUp("; ".join(str(r) for r in failures))
    return any(r is True for r in results)
