"""The coordinated context switch on every node of a group.

Each node converges on its own, concurrently with the others, towards "only the
incoming job is resident, and it has been granted". Residency is per (job, group):
a switch moves only this group's state of each job, and a job's state for another
group stays where it is, unless that group shares the node's devices, has no holder
and the incoming job would not fit beside it (``give_way``, see
``tslice.orchestrator.overlap``). With a tslice agent that is one Grant per node
(``evict`` the outgoing resident and any other job of the group running there,
``give_way`` the deferred residents of overlapping groups, ``restore`` the incoming
job if it is SAVED, record the grant with its epoch); the agent answers once the
node is done, or after a wait chunk with the operations in flight, which are then
awaited (WaitOperation) before the Grant is re-issued (it is idempotent). FAULTED
jobs are reset first (the agent refuses to move them blindly). A node that keeps
refusing (it answers with a permanent status such as FAILED_PRECONDITION on a fresh
view) is retried ``max_refusals`` times and then marked degraded
(:class:`NodeDegraded`); a refusal that can never change (the incoming job's state
does not fit the devices at all) ends the switch at once (:class:`JobRefused`).

Agents that lack the one-step Grant get the original sequence:

1. evict: snapshot every job of the group that is RUNNING there; wait on an
   operation already in flight (``JobStatus.operation_id``); reset a FAULTED one;
2. bring in: restore the incoming job if it is SAVED there;
3. Grant: tell the agent which job now holds the group (with the grant epoch).

The switch is done when every node confirmed. A failing step is retried with
jittered exponential backoff for as long as somebody wants the switch
(``SwitchHooks.should_continue``), re-reading the node's Status first, so the
same code finishes a switch interrupted by a crash (roll forward is idempotent).

To keep hand-overs cheap the group keeps a per-node view of job states learnt
from its own operations; a view is dropped (and Status re-read) on any error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import agents, config, events

_MAX_REPLANS = 20


@dataclasses.dataclass
class JobView:
    state: pb.JobState
    group: str = ""
    operation_id: str = ""


class NodeView(dict[str, JobView]):
    """A group's records on one node by job id (its own group's, or made without a group);
    ``others`` holds the other groups' records by (job, group)."""

    def __init__(self, own: dict[str, JobView] | None = None) -> None:
        super().__init__(own or {})
        self.others: dict[tuple[str, str], JobView] = {}


def view_from_status(resp: pb.StatusResponse, group: str) -> NodeView:
    """The node's records as ``group`` sees them; its own record wins over an ungrouped one."""
    view = NodeView()
    for js in resp.job_statuses:
        jv = JobView(js.state, js.group, js.operation_id)
        if js.group == group or (not js.group and js.job_id not in view):
            view[js.job_id] = jv
        elif js.group:
            view.others[(js.job_id, js.group)] = jv
    return view


class GiveUp(Exception):
    """Nobody wants the switch any more and a node keeps failing."""


class NodeDegraded(GiveUp):
    """The node kept refusing the switch (not unreachable: it answered) past the bound."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"node {node} degraded: {reason}")
        self.node = node
        self.reason = reason


class JobRefused(GiveUp):
    """An agent refused the incoming job for good (e.g. its state can never fit)."""

    def __init__(self, node: str, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{node}: {detail}")
        self.code = code
        self.detail = detail


#: Refusals that say the request itself can never be served, whatever is retried.
_REFUSED_FOR_GOOD = (grpc.StatusCode.RESOURCE_EXHAUSTED,)
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


class StepFailed(Exception):
    def __init__(self, operation: str, detail: str) -> None:
        super().__init__(f"{operation}: {detail}")
        self.operation = operation
        self.detail = detail


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


@dataclasses.dataclass(frozen=True)
class SwitchPlan:
    group: str
    from_job: str | None
    to_job: str
    epoch: int
    footprint_bytes: int
    #: Per node: the overlapping groups (with no holder) whose residents may give way.
    give_way: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)


class NodeSwitcher:
    """Converges one node for one switch (see the module docstring)."""

    def __init__(
        self,
        *,
        node: config.NodeRef,
        client: agents.AgentClient,
        plan: SwitchPlan,
        views: dict[str, NodeView],
        hooks: SwitchHooks,
        backoff: Backoff,
        max_refusals: int = 5,
    ) -> None:
        self.node = node
        self.client = client
        self.plan = plan
        self.views = views
        self.hooks = hooks
        self.backoff = backoff
        self.max_refusals = max_refusals
        self.restored = False
        self._op = "status"
        #: Operations already reported (a re-issued Grant lists them again).
        self._noted: set[str] = set()
        #: Called once, when the node's first call is under way (or the node is done).
        self.first_call: Callable[[], None] | None = None

    async def run(self) -> bool:
        """Return whether a restore happened on this node; raise GiveUp."""
        try:
            return await self._run()
        finally:
            notify = self._issued()
            if notify is not None:
                notify()

    async def _run(self) -> bool:
        attempt = 0
        refusals = 0
        while True:
            fresh = self.node.name not in self.views
            try:
                await self._converge()
                self.hooks.node_ok(self.node.name)
                return self.restored
            except agents.AgentUnreachable as err:
                unreachable, detail = True, str(err)
                refusals = 0
            except agents.AgentRejected as err:
                unreachable, detail = False, str(err)
                if err.code in _REFUSED_FOR_GOOD:
                    raise JobRefused(self.node.name, err.code, err.reason) from err
                if not fresh:
                    # Our cached view was stale: re-read Status and retry at once.
                    self.views.pop(self.node.name, None)
                    continue
                refusals = refusals + 1 if err.code in _PERMANENT else 0
            except (agents.OperationFailed, StepFailed) as err:
                unreachable, detail = False, str(err)
                refusals = 0
            self.views.pop(self.node.name, None)
            if refusals >= self.max_refusals:
                # It answers, and keeps saying no: retrying forever would wedge the group.
                raise NodeDegraded(self.node.name, f"{self._op} refused {refusals} times: {detail}")
            if not self.hooks.should_continue():
                raise GiveUp(f"{self.node.name}: {detail}")
            delay = self.backoff.delay(attempt)
            attempt += 1
            self.hooks.node_failed(
                self.node.name, self._op, detail, unreachable=unreachable, retry_in=delay
            )
            self._calling()  # nothing is held back while this node waits to retry
            await asyncio.sleep(delay)

    def _issued(self) -> Callable[[], None] | None:
        """The callback for the next call: ``first_call`` for the first one, else None."""
        notify, self.first_call = self.first_call, None
        return notify

    def _calling(self) -> None:
        """A call is about to be made (paths off the hand-over's fast path)."""
        notify = self._issued()
        if notify is not None:
            notify()

    async def _read(self) -> NodeView:
        self._op = "status"
        t0 = time.monotonic()
        resp = await self.client.status(issued=self._issued())
        self.hooks.observe(self.node.name, "status", time.monotonic() - t0)
        view = view_from_status(resp, self.plan.group)
        self.views[self.node.name] = view
        return view

    async def _converge(self) -> None:
        view = self.views.get(self.node.name)
        fresh = view is None
        if view is None:
            view = await self._read()
        for _ in range(_MAX_REPLANS):
            if await self._reset_faulted(view):
                view, fresh = await self._read(), True
                continue
            if self.client.one_step is not False:
                try:
                    if await self._grant_step(view):
                        return
                except agents.AgentRejected as err:
                    # An agent that ignores evict/restore refuses such a Grant (a SAVED
                    # target, a resident neighbour); unless it is known to do one-step
                    # Grants, that refusal on a fresh view means: use the steps below.
                    unknown = self.client.one_step is None
                    if not (unknown and fresh and err.code == grpc.StatusCode.FAILED_PRECONDITION):
                        raise
                view, fresh = await self._read(), True
            if await self._step_by_step(view):
                return
            view, fresh = await self._read(), True
        raise StepFailed("plan", "job states keep changing under the switch")

    async def _reset_faulted(self, view: NodeView) -> bool:
        """Reset FAULTED jobs the switch touches; True if any was reset."""
        p = self.plan
        touched = [
            job
            for job, jv in view.items()
            if jv.state == pb.JOB_STATE_FAULTED
            and (jv.group == p.group or job in (p.from_job, p.to_job))
        ]
        for job in touched:
            await self._settle(job, view)
        return bool(touched)

    def _evictees(self, view: NodeView) -> list[str]:
        p = self.plan
        resident = (pb.JOB_STATE_RUNNING, pb.JOB_STATE_TRANSITIONING)
        return [
            job
            for job, jv in view.items()
            if job != p.to_job
            and (jv.group == p.group or job == p.from_job)
            and jv.state in resident
        ]

    def _give_way(self, view: NodeView) -> list[tuple[str, str]]:
        """Other groups' residents here that may be snapshotted to make room."""
        groups = self.plan.give_way.get(self.node.name, frozenset())
        resident = (pb.JOB_STATE_RUNNING, pb.JOB_STATE_TRANSITIONING)
        return sorted(
            key for key, jv in view.others.items() if key[1] in groups and jv.state in resident
        )

    async def _grant_step(self, view: NodeView) -> bool:
        """One Grant (re-issued after waiting); False if the agent lacks the feature."""
        p = self.plan
        evict = self._evictees(view)
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
            resp = await self.client.grant_step(
                job_id=p.to_job,
                group=p.group,
                epoch=p.epoch,
                footprint_bytes=p.footprint_bytes,
                evict=evict,
                give_way=give_way,
                wait_s=min(self.client.wait_chunk_s, left),
                issued=self._issued(),
            )
            self.hooks.observe(self.node.name, "grant", time.monotonic() - t0)
            if not resp.granted and not resp.operations:
                # Our agents answer granted or with the operations in flight: this one
                # ignored the one-step fields.
                self.client.one_step = False
                return False
            self.client.one_step = True
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                self._note(op_id, op, view)
            if resp.granted:
                view[p.to_job] = JobView(pb.JOB_STATE_RUNNING, p.group)
                return True
            for op_id, op in zip(resp.operation_ids, resp.operations, strict=False):
                if op.status == pb.OPERATION_STATUS_PENDING:
                    self._op = "wait"
                    self._calling()
                    self._note(op_id, await self.client.wait_operation(op_id), view)

    def _note(self, op_id: str, op: pb.GetOperationResponse, view: NodeView) -> None:
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
            view.others[(op.job_id, op.group)] = JobView(pb.JOB_STATE_SAVED, op.group, op_id)
            self.hooks.observe(self.node.name, op.kind, op.elapsed_ms / 1000)
            self._publish(
                opb.OrchestratorEvent.KIND_SNAPSHOT_DONE,
                job=op.job_id,
                elapsed_ms=op.elapsed_ms,
                size=op.storage_bytes,
            )
            return
        group = view[op.job_id].group if op.job_id in view else p.group
        if op.kind == "snapshot":
            view[op.job_id] = JobView(pb.JOB_STATE_SAVED, group, op_id)
            kind, size = opb.OrchestratorEvent.KIND_SNAPSHOT_DONE, op.storage_bytes
        elif op.kind == "restore":
            view[op.job_id] = JobView(pb.JOB_STATE_RUNNING, group, op_id)
            kind, size = opb.OrchestratorEvent.KIND_RESTORE_DONE, op.snapshot_device_bytes
            if op.job_id == p.to_job:
                self.restored = True
        else:
            view[op.job_id] = JobView(pb.JOB_STATE_RUNNING, group, op_id)
            return
        self.hooks.observe(self.node.name, op.kind, op.elapsed_ms / 1000)
        self._publish(kind, job=op.job_id, elapsed_ms=op.elapsed_ms, size=size)

    def _publish(
        self, kind: opb.OrchestratorEvent.Kind, *, job: str, elapsed_ms: int, size: int
    ) -> None:
        if self.hooks.wants(kind):  # nobody watching: not even built
            event = _event(
                kind, self.plan, job=job, node=self.node.name, elapsed_ms=elapsed_ms, size=size
            )
            self.hooks.publish(event)

    async def _step_by_step(self, view: NodeView) -> bool:
        """The original sequence (snapshot, restore, Grant); False if Status must be re-read."""
        p = self.plan
        if await self._evict(view) or await self._settle(p.to_job, view):
            return False
        target = view.get(p.to_job)
        if target is not None and target.state == pb.JOB_STATE_SAVED:
            await self._restore(view)
        self._op = "grant"
        t0 = time.monotonic()
        self._calling()
        resp = await self.client.grant(
            job_id=p.to_job, group=p.group, epoch=p.epoch, footprint_bytes=p.footprint_bytes
        )
        self.hooks.observe(self.node.name, "grant", time.monotonic() - t0)
        if not resp.granted:
            self.client.one_step = False  # tslice agents set granted on every success
        if resp.state != pb.JOB_STATE_RUNNING:
            raise StepFailed(
                "grant", f"job {p.to_job} is {pb.JobState.Name(resp.state)} after Grant"
            )
        view[p.to_job] = JobView(pb.JOB_STATE_RUNNING, p.group)
        return True

    async def _evict(self, view: NodeView) -> bool:
        """Snapshot resident jobs other than the target; True if Status must be re-read."""
        p = self.plan
        for job, jv in view.items():
            if job == p.to_job or not (jv.group == p.group or job == p.from_job):
                continue
            if jv.state in (pb.JOB_STATE_TRANSITIONING, pb.JOB_STATE_FAULTED):
                return await self._settle(job, view)
            if jv.state == pb.JOB_STATE_RUNNING:
                await self._snapshot(job, view)
        return False

    async def _settle(self, job: str, view: NodeView) -> bool:
        """Wait out an operation in flight or reset a FAULTED job; True if anything was done."""
        jv = view.get(job)
        if jv is None:
            return False
        if jv.state == pb.JOB_STATE_TRANSITIONING and jv.operation_id:
            self._op = "wait"
            self._calling()
            await self.client.wait_operation(jv.operation_id)
            return True
        if jv.state == pb.JOB_STATE_FAULTED:
            self._op = "reset"
            t0 = time.monotonic()
            self._calling()
            await self.client.reset_job(job_id=job, group=jv.group)
            self.hooks.observe(self.node.name, "reset", time.monotonic() - t0)
            return True
        if jv.state == pb.JOB_STATE_TRANSITIONING:
            raise StepFailed("wait", f"job {job} is TRANSITIONING with no operation id")
        return False

    async def _snapshot(self, job: str, view: NodeView) -> None:
        p = self.plan
        self._op = "snapshot"
        t0 = time.monotonic()
        self._calling()
        op_id = await self.client.snapshot(job_id=job, group=p.group)
        view[job] = JobView(pb.JOB_STATE_TRANSITIONING, p.group, op_id)
        resp = await self.client.wait_operation(op_id)
        self.hooks.observe(self.node.name, "snapshot", time.monotonic() - t0)
        if resp.status != pb.OPERATION_STATUS_COMPLETE:
            raise agents.OperationFailed(
                self.client.address, "snapshot", f"snapshot of job {job} failed: {resp.error}"
            )
        view[job] = JobView(pb.JOB_STATE_SAVED, view[job].group)
        self._publish(
            opb.OrchestratorEvent.KIND_SNAPSHOT_DONE,
            job=job,
            elapsed_ms=resp.elapsed_ms,
            size=resp.storage_bytes,
        )

    async def _restore(self, view: NodeView) -> None:
        p = self.plan
        self._op = "restore"
        t0 = time.monotonic()
        self._calling()
        op_id = await self.client.restore(job_id=p.to_job, group=p.group)
        view[p.to_job] = JobView(pb.JOB_STATE_TRANSITIONING, p.group, op_id)
        resp = await self.client.wait_operation(op_id)
        self.hooks.observe(self.node.name, "restore", time.monotonic() - t0)
        if resp.status != pb.OPERATION_STATUS_COMPLETE:
            raise agents.OperationFailed(
                self.client.address, "restore", f"restore of job {p.to_job} failed: {resp.error}"
            )
        view[p.to_job] = JobView(pb.JOB_STATE_RUNNING, p.group)
        self.restored = True
        self._publish(
            opb.OrchestratorEvent.KIND_RESTORE_DONE,
            job=p.to_job,
            elapsed_ms=resp.elapsed_ms,
            size=resp.snapshot_device_bytes,
        )


def _event(
    kind: opb.OrchestratorEvent.Kind,
    plan: SwitchPlan,
    *,
    job: str,
    node: str,
    elapsed_ms: int,
    size: int,
) -> opb.OrchestratorEvent:
    return events.make_event(
        kind,
        group_id=plan.group,
        job_id=job,
        node=node,
        duration_ms=elapsed_ms,
        from_job=plan.from_job or "",
        grant_epoch=plan.epoch,
        size_bytes=size,
    )


async def run_switch(
    *,
    plan: SwitchPlan,
    nodes: tuple[config.NodeRef, ...],
    pool: agents.AgentPool,
    views: dict[str, NodeView],
    hooks: SwitchHooks,
    backoff: Backoff,
    started: Callable[[], None] | None = None,
    max_refusals: int = 5,
) -> bool:
    """Converge every node concurrently; return whether any node restored the target.

    ``started`` is called once every node's first call is under way (created, its send
    scheduled), so that what it releases (replies, event deliveries) runs after the
    sends; a node that ends before any call counts as under way.
    """
    switchers = [
        NodeSwitcher(
            node=n,
            client=pool.get(n.address),
            plan=plan,
            views=views,
            hooks=hooks,
            backoff=backoff,
            max_refusals=max_refusals,
        )
        for n in nodes
    ]
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
        raise GiveUp("; ".join(str(r) for r in failures))
    return any(r is True for r in results)
