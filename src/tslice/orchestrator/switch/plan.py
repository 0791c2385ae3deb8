"""What every node of a switch is asked, and what the group knows of its nodes.

Every node of a switch is asked for the same thing (:class:`SwitchPlan`): only the
target resident among the group's jobs, the grant recorded. A group keeps a per-node
view of job states (:class:`NodeView`), read from the agent's Status and kept up to date
from its own operations, so that a hand-over needs no Status read; a view is dropped
(and the Status read again) after any error. A node's view also says what its host
memory for parked states holds (issue 20 §2), so that a switch whose snapshot the node
cannot park is not started (:meth:`SwitchPlan.unparkable`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import operator
from collections.abc import Callable, Mapping

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import config
from tslice.orchestrator.switch import pool

log = logging.getLogger(__name__)

#: Job states that hold the devices.
RESIDENT = (pb.JOB_STATE_RUNNING, pb.JOB_STATE_TRANSITIONING)
_JOB_AND_GROUP = operator.attrgetter("job_id", "group")
#: How often a step re-plans on a fresh view before it gives up (states keep changing).
MAX_REPLANS = 20
#: Backends whose states hold no host memory when parked: the agents do not count them
#: against their budget (``tslice.agent.parking``), so neither does a switch's check.
SIMULATED_BACKENDS = frozenset({"sim", "noop"})


@dataclasses.dataclass
class JobView:
    state: pb.JobState
    group: str = ""
    operation_id: str = ""
    #: What the job holds on the node's devices (0: unknown), as the agent reports it.
    device_bytes: int = 0
    #: The backend that moves its state there ("" = not reported).
    backend: str = ""


class NodeView(dict[str, JobView]):
    """A group's records on one node by job id (its own group's, or made without a group);
    ``others`` holds the other groups' records by (job, group)."""

    def __init__(self, own: dict[str, JobView] | None = None) -> None:
        super().__init__(own or {})
        self.others: dict[tuple[str, str], JobView] = {}
        #: The node's host memory for parked states, and what parked states hold (bytes;
        #: 0 budget: the agent reports none, so nothing is checked here).
        self.host_budget_bytes = 0
        self.host_parked_bytes = 0


def view_from_status(resp: pb.StatusResponse, group: str) -> NodeView:
    """The node's records as ``group`` sees them; its own record wins over an ungrouped one."""
    view = NodeView()
    view.host_budget_bytes = resp.host_budget_bytes
    view.host_parked_bytes = resp.host_parked_bytes
    for js in resp.job_statuses:
        jv = JobView(js.state, js.group, js.operation_id, js.device_bytes, js.backend)
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
    agents: pool.AgentPool,
    nodes: tuple[config.NodeRef, ...],
    group: str,
    *,
    timeout_s: float | None = None,
) -> Reads:
    """Read every node's Status concurrently (recovery, GetGroupStatus)."""
    results = await asyncio.gather(
        *(agents.get(n.address).status(timeout_s=timeout_s) for n in nodes),
        return_exceptions=True,
    )
    reads = Reads({}, {})
    for node, res in zip(nodes, results, strict=True):
        if isinstance(res, Exception):
            if not isinstance(res, pool.AgentError):
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
    #: Per node, the groups it belongs to, whose state there is never stray
    #: (``overlap.DeviceArbiter.homes``; none: ``stray`` is asked for every group).
    homes: Mapping[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def may_give_way(self, node: str, group: str) -> bool:
        """Whether ``group``'s resident on ``node`` may be moved out to make room."""
        if group in self.give_way.get(node, ()):
            return True
        return group not in self.homes.get(node, ()) and self.stray(node, group)

    def giving_way(self, node: str, others: Mapping[tuple[str, str], JobView]) -> list[pb.JobRef]:
        """The residents among ``others`` (the other groups' records on ``node``) that may
        be moved out to make room, sorted. A node holds the residents of many groups:
        only a group ``node`` is no home of is asked whether its state there is stray."""
        may = self.give_way.get(node, frozenset())
        homed = self.homes.get(node, frozenset())
        found: list[pb.JobRef] = []
        for (job, group), jv in others.items():
            if jv.state in RESIDENT and (
                group in may or (group not in homed and self.stray(node, group))
            ):
                found.append(pb.JobRef(job_id=job, group=group))
        found.sort(key=_JOB_AND_GROUP)
        return found

    def evictees(self, view: NodeView) -> list[str]:
        """Jobs to move out of ``view``: the group's residents other than the target."""
        out: list[str] = []
        for job, jv in view.items():
            if (
                job != self.to_job
                and (jv.group == self.group or job == self.from_job)
                and jv.state in RESIDENT
            ):
                out.append(job)
        return out

    def unparkable(self, node: str, view: NodeView) -> str:
        """Why the node's host memory cannot park what this switch moves out of it ("" =
        it can, or the node reports no budget). What a resident holds on the devices is
        what its snapshot parks (the agent refuses the same snapshot, nothing frozen)."""
        budget = view.host_budget_bytes
        if budget <= 0:
            return ""
        leaving: dict[str, int] = {}
        for job in self.evictees(view):
            if view[job].backend not in SIMULATED_BACKENDS:
                leaving[job] = view[job].device_bytes
        needed = sum(leaving.values())
        free = max(0, budget - view.host_parked_bytes)
        if needed <= free:
            return ""
        who = ", ".join(f"{job} {n} bytes" for job, n in sorted(leaving.items()))
        return (
            f"node {node} cannot park the state switched out of group {self.group} ({who}): "
            f"its host memory for parked states is {budget} bytes, {view.host_parked_bytes} "
            f"of them held by parked states, so {free} are available; the holder keeps "
            "running. Restore or end a parked job there, or raise the node's host_budget"
        )


class StepFailed(Exception):
    def __init__(self, operation: str, detail: str) -> None:
        super().__init__(f"{operation}: {detail}")
        self.operation = operation
        self.detail = detail
