"""What a switch's steps on one node share, whichever protocol the node's agent speaks.

A group keeps a per-node view of job states (:class:`NodeView`), read from the agent's
Status and kept up to date from its own operations; every node of a switch is asked
for the same thing (:class:`SwitchPlan`); a step that cannot go on raises
:class:`StepFailed`. The two protocol paths, tslice's one-step Grant
(``tslice.orchestrator.switch.step``) and llm-d's Snapshot/Restore directives
(``tslice.orchestrator.switch.llmd``), use their node's switcher through :class:`Step`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import config
from tslice.orchestrator.switch import pool as agents

log = logging.getLogger(__name__)

#: Job states that hold the devices.
RESIDENT = (pb.JOB_STATE_RUNNING, pb.JOB_STATE_TRANSITIONING)
#: How often a step re-plans on a fresh view before it gives up (states keep changing).
MAX_REPLANS = 20


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


@dataclasses.dataclass
class Reads:
    """One Status read of every node of a group: the views of those that answered."""

    views: dict[str, NodeView]
    #: Why each node that did not answer did not (node -> error).
    failed: dict[str, str]


async def read_all(
    pool: agents.AgentPool,
    nodes: tuple[config.NodeRef, ...],
    group: str,
    *,
    timeout_s: float | None = None,
) -> Reads:
    """Read every node's Status concurrently (recovery, GetGroupStatus)."""
    results = await asyncio.gather(
        *(pool.get(n.address).status(timeout_s=timeout_s) for n in nodes), return_exceptions=True
    )
    reads = Reads({}, {})
    for node, res in zip(nodes, results, strict=True):
        if isinstance(res, Exception):
            if not isinstance(res, agents.AgentError):
                log.error("group %s: reading %s failed", group, node.name, exc_info=res)
            reads.failed[node.name] = str(res)
        elif isinstance(res, BaseException):
            raise res
        else:
            reads.views[node.name] = view_from_status(res, group)
    return reads


@dataclasses.dataclass(frozen=True)
class SwitchPlan:
    group: str
    from_job: str | None
    to_job: str
    epoch: int
    footprint_bytes: int
    #: Per node: the overlapping groups (with no holder) whose residents may give way.
    give_way: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)
    #: ``stray(node, group)``: ``group``'s state on ``node`` is left over (the node left
    #: the group, nobody holds it): it gives way as well (``overlap.DeviceArbiter.stray``).
    stray: Callable[[str, str], bool] = lambda node, group: False

    def may_give_way(self, node: str, group: str) -> bool:
        """Whether ``group``'s resident on ``node`` may be moved out to make room."""
        return group in self.give_way.get(node, ()) or self.stray(node, group)

    def evictees(self, view: NodeView) -> list[str]:
        """Jobs to move out of ``view``: the group's residents other than the target."""
        return [
            job
            for job, jv in view.items()
            if job != self.to_job
            and (jv.group == self.group or job == self.from_job)
            and jv.state in RESIDENT
        ]


class StepFailed(Exception):
    def __init__(self, operation: str, detail: str) -> None:
        super().__init__(f"{operation}: {detail}")
        self.operation = operation
        self.detail = detail


class Step(Protocol):
    """What a protocol path may use of its node's switcher."""

    @property
    def name(self) -> str:
        """The node's name."""

    @property
    def client(self) -> agents.AgentClient: ...

    @property
    def plan(self) -> SwitchPlan: ...

    def calling(self, operation: str) -> None:
        """The next agent call is ``operation`` (named in failure reports)."""

    def observe(self, operation: str, seconds: float) -> None: ...

    def moved(self, kind: str, job: str, op_id: str, op: pb.GetOperationResponse) -> None:
        """A snapshot or restore of ``job``'s state for the plan's group completed:
        report it (events, and whether the target was restored)."""

    async def read(self) -> NodeView:
        """Re-read the node's Status (the view is then fresh)."""

    def forget_view(self) -> None:
        """Drop the cached view: the next switch reads the node's Status first."""
