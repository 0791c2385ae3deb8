"""A switch: one step per node, each through its node's link; its outcome to the group.

A switch moves the resident out (snapshot) and the target in (restore) on every node of
a group, concurrently. :class:`Switches` launches a group's switch (one at a time) as
one task per node (:class:`NodeStep`); when every node is done it tells the group how the
switch ended, as data (:data:`Outcome`), and the group's lock decides what comes next.

Each node converges on its own towards "only the incoming job is resident, and it has
been granted", through the node's :class:`~tslice.orchestrator.switch.links.AgentLink`
(chosen once per agent connection, :func:`chosen`). Residency is per (job, group): a
switch moves only this group's state of each job, and a job's state for another group
stays where it is, unless that group shares the node's devices, has no holder and the
incoming job would not fit beside it (``give_way``, see ``group.overlap``). Before its
first call a node's step checks that the node can park what it moves out
(``plans.SwitchPlan.unparkable``); if not, nothing is called anywhere and the switch ends
:class:`Unparkable`: the holder keeps running.

A node that keeps refusing (it answers with a permanent status such as
FAILED_PRECONDITION on a fresh view) is retried ``max_refusals`` times, one whose snapshot
or restore keeps failing ``max_operation_failures`` times in a row, and then it is marked
degraded (:class:`Degraded`); a refusal that can never change (the incoming job's state
does not fit the devices at all) ends the switch at once (:class:`Refused`). Any other
failing step is retried with jittered exponential backoff for as long as somebody wants
the switch, re-reading the node's Status first, so the same code finishes a switch
interrupted by a crash (roll forward is idempotent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

import grpc

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import config, metrics, tracing_hooks
from tslice.orchestrator.events import bus
from tslice.orchestrator.group import effects
from tslice.orchestrator.policy import prefetch
from tslice.orchestrator.switch import links, llmd, pool
from tslice.orchestrator.switch import plan as plans
from tslice.rpc import refusals
from tslice.server import grant_marks, logs, tracing

log = logging.getLogger(__name__)

Kind = opb.OrchestratorEvent


@dataclasses.dataclass(frozen=True)
class Backoff:
    initial_s: float = 0.05
    max_s: float = 5.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * (2**attempt))
        return float(base * random.uniform(0.5, 1.0))


# ---- how a switch ends ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Done:
    """Every node is done: the target is resident everywhere (``restored``: somewhere it
    was brought back from saved state)."""

    restored: bool
    seconds: float


@dataclasses.dataclass(frozen=True)
class Refused:
    """An agent refused the target for good (its state can never fit there)."""

    code: refusals.Code
    detail: str


@dataclasses.dataclass(frozen=True)
class Unparkable:
    """A node cannot park what the switch moves out; nothing moved (issue 20 §2)."""

    node: str
    detail: str


@dataclasses.dataclass(frozen=True)
class StaleEpoch:
    """A node refused the grant as stale and named its mark: the orchestrator's epoch is
    behind what the agents saw (its database was lost or truncated)."""

    node: str
    mark: int
    detail: str


@dataclasses.dataclass(frozen=True)
class Degraded:
    """A node kept refusing the switch (it answered) past the bound."""

    node: str
    cause: str


@dataclasses.dataclass(frozen=True)
class Abandoned:
    """Nobody wants the switch any more and a node keeps failing (or a step crashed)."""

    detail: str


@dataclasses.dataclass(frozen=True)
class Deposed:
    """An agent has seen a newer leader term: nothing moved; the switch is the new
    leader's (this replica steps down, its groups stop)."""

    detail: str


Outcome: TypeAlias = "Done | Refused | Unparkable | StaleEpoch | Degraded | Abandoned | Deposed"
#: When nodes end differently, the one the switch ends with (the first kind found wins).
_PRECEDENCE = (Refused, Degraded, Unparkable, StaleEpoch, Deposed)


@dataclasses.dataclass(frozen=True)
class NodeFailure:
    """A node's step failed and is retried in ``retry_in`` seconds."""

    node: str
    operation: str
    detail: str
    unreachable: bool
    retry_in: float


class _Ended(Exception):
    """A node's step ends the switch (the node's outcome, not Done)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(str(outcome))
        self.outcome = outcome


class Group(Protocol):
    """What a switch uses of its group (its driver)."""

    group_id: str
    nodes: tuple[config.NodeRef, ...]
    views: dict[str, plans.NodeView]
    #: Where the group's events go.
    bus: bus.EventBus

    def wants_switch(self) -> bool:
        """Somebody still wants the switch in progress (worth retrying)."""

    def node_failed(self, failure: NodeFailure) -> None: ...

    def node_ok(self, node: str) -> None: ...

    def switch_ended(self, switch: effects.StartSwitch, outcome: Outcome) -> None:
        """Posted to the group: its lock decides what comes next."""


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


def chosen(client: pool.AgentClient, status: pb.StatusResponse) -> links.AgentLink:
    """The client's link, chosen from ``status`` if it has none (a new connection): the
    one place that looks at what an agent declares."""
    link = client.link
    if not isinstance(link, links.AgentLink):
        f = status.features
        link = client.link = (
            links.GrantLink(client, stream=f.grant_stream, prefetch=f.prefetch)
            if f.grant_step
            else llmd.LlmdLink(client)
        )
    return link


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What every node of a group's switches shares."""

    group: Group
    bus: bus.EventBus
    backoff: Backoff
    max_refusals: int
    max_operation_failures: int
    #: (node, operation) -> the histogram child its calls are timed into, made by
    #: ``timed`` at its first use.
    timers: dict[tuple[str, str], Any]
    timed: Callable[[str, str], Any]


class Switches:
    """A group's switches (one at a time): launched by its executor, ended by its nodes."""

    def __init__(
        self,
        group: Group,
        *,
        agents: pool.AgentPool,
        cfg: config.OrchestratorConfig,
        series: metrics.OrchestratorMetrics,
        plan_for: Callable[[effects.StartSwitch], plans.SwitchPlan],
    ) -> None:
        self._group = group
        self._agents = agents
        self._plan_for = plan_for
        gid = group.group_id
        children: dict[tuple[str, str], Any] = {}

        def timed(node: str, operation: str) -> Any:
            child = children.get((node, operation))
            if child is None:
                child = series.agent_operation.labels(gid, node, operation)
                children[(node, operation)] = child
            return child

        self._settings = _Settings(
            group,
            group.bus,
            Backoff(cfg.backoff_initial_s, cfg.backoff_max_s),
            cfg.max_refusals,
            cfg.max_operation_failures,
            children,
            timed,
        )
        self._tasks: set[asyncio.Task[Any]] = set()
        #: Each node with its agent's client (a group's nodes never change: looked up at
        #: its first switch).
        self._nodes: list[tuple[config.NodeRef, pool.AgentClient]] = []

    def launch(self, s: effects.StartSwitch) -> None:
        """Start switch ``s`` (its intent is persisted): a task per node, now."""
        if not self._nodes:
            self._nodes = [(n, self._agents.get(n.address)) for n in self._group.nodes]
        switch = _Switch(s, self._plan_for(s), self._settings, self._nodes)
        if tracing.ENABLED:  # (off: not even a call)
            traced = tracing_hooks.handover(
                switch.run_traced(), group=switch.plan.group, switch=s, nodes=self._group.nodes
            )
            self._keep(asyncio.get_running_loop().create_task(traced))
        else:
            for task in switch.start():
                self._keep(task)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self, *, grace_s: float) -> None:
        """Let a switch in flight finish within the grace."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)

    def pending(self) -> list[asyncio.Task[Any]]:
        return list(self._tasks)


class _Switch:
    """One switch in flight: its node steps, and how it ends."""

    def __init__(
        self,
        s: effects.StartSwitch,
        switch_plan: plans.SwitchPlan,
        settings: _Settings,
        nodes: list[tuple[config.NodeRef, pool.AgentClient]],
    ) -> None:
        self.switch = s
        self.plan = switch_plan
        self._settings = settings
        self._steps: list[NodeStep] = []
        for node, client in nodes:
            self._steps.append(NodeStep(node, client, switch_plan, settings))
        self._left = len(self._steps)
        #: How the nodes' steps that did not converge ended; whether one restored.
        self._ended: list[Outcome] = []
        self._restored = False
        self._started = time.monotonic()

    def start(self) -> list[asyncio.Task[Any]]:
        # Every log line of the nodes' tasks names the switch (a C call: no work to speak of).
        s = self.switch
        logs.IDS.set(
            {"group_id": self.plan.group, "job_id": s.to_job, "from_job": s.from_job or ""}
        )
        loop = asyncio.get_running_loop()
        tasks = []
        for step in self._steps:
            task = loop.create_task(step.run())
            task.add_done_callback(self._node_done)
            tasks.append(task)
        return tasks

    async def run_traced(self) -> None:
        """The nodes' tasks within the hand-over's span (tracing on)."""
        tasks = self.start()
        await asyncio.wait(tasks)

    def _node_done(self, task: asyncio.Task[bool]) -> None:
        if task.cancelled():
            return  # the group stops: its intent is on disk, recovery finishes it
        error = task.exception()
        if error is None:
            self._restored = task.result() or self._restored
        elif isinstance(error, _Ended):
            self._ended.append(error.outcome)
        else:
            log.error("group %s: a switch step crashed", self.plan.group, exc_info=error)
            self._ended.append(Abandoned(f"{type(error).__name__}: {error}"))
        self._left -= 1
        if self._left == 0:
            self._settings.group.switch_ended(self.switch, self._outcome())

    def _outcome(self) -> Outcome:
        ended = self._ended
        if not ended:
            return Done(self._restored, time.monotonic() - self._started)
        stale = [o for o in ended if isinstance(o, StaleEpoch)]
        for kind in _PRECEDENCE:
            found = [o for o in ended if isinstance(o, kind)]
            if found:
                return max(stale, key=lambda o: o.mark) if kind is StaleEpoch else found[0]
        return Abandoned("; ".join(o.detail for o in ended if isinstance(o, Abandoned)))


class NodeStep:
    """Converges one node for one switch (see the module docstring); a ``links.Step``."""

    def __init__(
        self,
        node: config.NodeRef,
        client: pool.AgentClient,
        switch_plan: plans.SwitchPlan,
        settings: _Settings,
    ) -> None:
        self.node = node
        self.client = client
        self.plan = switch_plan
        self._settings = settings
        self._views = settings.group.views
        self.restored = False
        #: The agent call under way (set by the link before each call; named in reports).
        self.operation = "status"

    async def run(self) -> bool:
        """Whether a restore happened on this node; raises :class:`_Ended`."""
        attempt = refused = failures = 0
        name, settings = self.node.name, self._settings
        while True:
            fresh = name not in self._views
            try:
                await self._converge()
                settings.group.node_ok(name)
                return self.restored
            except pool.AgentUnreachable as err:
                unreachable, detail = True, str(err)
                refused = failures = 0
                await self.client.drop_link()  # the next connection may be another agent
            except pool.AgentRejected as err:
                unreachable, detail = False, str(err)
                self._ended_by(err)
                if not fresh:
                    # Our cached view was stale: re-read Status and retry at once.
                    self._views.pop(name, None)
                    continue
                refused = refused + 1 if err.code in _PERMANENT else 0
            except (pool.OperationFailed, plans.StepFailed) as err:
                unreachable, detail = False, str(err)
                refused = 0
                if isinstance(err, pool.OperationFailed):
                    failures += 1  # the snapshot/restore itself failed (job FAULTED)
            self._views.pop(name, None)
            if refused >= settings.max_refusals:
                # It answers, and keeps saying no: retrying forever would wedge the group.
                why = f"{self.operation} refused {refused} times: {detail}"
                raise _Ended(Degraded(name, why))
            if failures >= settings.max_operation_failures:
                raise _Ended(Degraded(name, f"{self.operation} failed {failures} times: {detail}"))
            if not settings.group.wants_switch():
                raise _Ended(Abandoned(f"{name}: {detail}"))
            delay = settings.backoff.delay(attempt)
            attempt += 1
            settings.group.node_failed(
                NodeFailure(name, self.operation, detail, unreachable, delay)
            )
            await asyncio.sleep(delay)

    def _ended_by(self, err: pool.AgentRejected) -> None:
        """Raise :class:`_Ended` if the refusal ends the switch (deposed, refused for good,
        a stale epoch past which the group grants)."""
        name = self.node.name
        if isinstance(err, pool.AgentDeposed) and err.sent:
            # Retrying would only mark a healthy node degraded (an embedded
            # orchestrator, term 0, does get the node degraded with the fix).
            raise _Ended(Deposed(f"{name}: {err.reason}"))
        if err.code in _REFUSED_FOR_GOOD:
            raise _Ended(self._refused_for_good(err))
        mark = _stale_mark(err, self.plan.epoch)
        if mark is not None:
            raise _Ended(StaleEpoch(name, mark, err.reason))

    def _refused_for_good(self, err: pool.AgentRejected) -> Outcome:
        """RESOURCE_EXHAUSTED: the target never fits, or the node cannot park what leaves
        it (the agent refuses both before anything is frozen). The target's footprint is
        known where it was declared: if it fits the node's devices and something of the
        group leaves the node, it is the parking."""
        view = self._views.get(self.node.name)
        leaving = view is not None and bool(self.plan.evictees(view))
        totals = self.client.device_bytes
        fits = not totals or self.plan.footprint_bytes <= min(totals)
        if leaving and fits and view is not None and view.host_budget_bytes > 0:
            return Unparkable(self.node.name, err.reason)
        return Refused(_REFUSED_FOR_GOOD[err.code], err.reason)

    # ---- links.Step -----------------------------------------------------------------------

    def observe(self, operation: str, seconds: float) -> None:
        settings, node = self._settings, self.node.name
        timer = settings.timers.get((node, operation))
        if timer is None:
            timer = settings.timed(node, operation)
        timer.observe(seconds)

    def moved(self, kind: str, job: str, op: pb.GetOperationResponse) -> None:
        if kind == "snapshot":
            size, event = op.storage_bytes, Kind.KIND_SNAPSHOT_DONE
        else:
            size, event = op.snapshot_device_bytes, Kind.KIND_RESTORE_DONE
            if job == self.plan.to_job:
                self.restored = True
        p = self.plan
        self._settings.bus.publish(
            bus.Event(
                event,
                p.group,
                job,
                node=self.node.name,
                duration_ms=op.elapsed_ms,
                from_job=p.from_job or "",
                grant_epoch=p.epoch,
                size_bytes=size,
            )
        )

    async def read(self) -> plans.NodeView:
        view, _ = await self._read()
        return view

    def forget_view(self) -> None:
        self._views.pop(self.node.name, None)

    # ---- the path ----------------------------------------------------------------------

    async def _read(self) -> tuple[plans.NodeView, links.AgentLink]:
        self.operation = "status"
        t0 = time.monotonic()
        resp = await self.client.status()
        self.observe("status", time.monotonic() - t0)
        view = plans.view_from_status(resp, self.plan.group)
        self._views[self.node.name] = view
        return view, chosen(self.client, resp)

    def _converge(self) -> Awaitable[None]:
        """The node's step through its link, from the cached view (else read first)."""
        view, link = self._views.get(self.node.name), self.client.link
        if view is None or not isinstance(link, links.AgentLink):
            return self._read_then_converge()
        return self._converge_on(view, link)

    async def _read_then_converge(self) -> None:
        await self._converge_on(*await self._read())

    def _converge_on(self, view: plans.NodeView, link: links.AgentLink) -> Awaitable[None]:
        unparkable = self.plan.unparkable(self.node.name, view)
        if unparkable:
            raise _Ended(Unparkable(self.node.name, unparkable))
        return link.converge(self, view)


async def prefetch_everywhere(
    agents: pool.AgentPool, nodes: tuple[config.NodeRef, ...], group: str, c: prefetch.Candidate
) -> None:
    """Ask every node to bring ``c.job``'s state in early, through its link (a hint:
    what each node did is logged, a failure changes nothing)."""

    async def one(node: config.NodeRef) -> str:
        client = agents.get(node.address)
        try:
            link = client.link
            if not isinstance(link, links.AgentLink):
                link = chosen(client, await client.status())
            return await link.prefetch(job_id=c.job, group=group, footprint_bytes=c.footprint_bytes)
        except pool.AgentError as err:
            return f"not started: {err.detail}"

    done = await asyncio.gather(*(one(n) for n in nodes))
    log.info(
        "group %s: prefetch of job %s: %s",
        group,
        c.job,
        ", ".join(f"{n.name}: {what}" for n, what in zip(nodes, done, strict=True)),
        extra={"group_id": group, "job_id": c.job},
    )


def _stale_mark(err: pool.AgentRejected, epoch: int) -> int | None:
    """The agent's mark if ``err`` refuses ``epoch`` as stale and the mark can be passed."""
    if err.code != grpc.StatusCode.FAILED_PRECONDITION or err.operation != "grant":
        return None
    mark = grant_marks.mark_of(err.reason)
    if mark is None or mark < epoch or mark >= grant_marks.MAX_ADOPTED:
        return None
    return mark
