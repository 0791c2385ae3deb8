"""The cluster as Kubernetes mode sees it: pure, no client library, fed by the watcher.

Three kinds of object come in (already reduced to what matters, see ``watch``):

- **nodes**: a node is a member of the groups its labels name
  (``group.timeslice.io/<g>=true``, tslice.common.kube_labels) while it is Ready and not
  cordoned (``spec.unschedulable``);
- **agent pods** (the DaemonSet's, by the agent selector): the agent of a node is
  reached at its pod IP and its container port named ``grpc`` (9001 when unnamed);
  with several on one node (a rolling update) the ready one, then the newest, wins.
  A member whose agent pod is gone keeps the address it had (the agent is unreachable
  there: the group says UNKNOWN and does not switch until it is back, rather than act
  as if the node were not there); one that never had an agent gets an address that
  resolves nowhere (:func:`no_agent_address`), to the same effect;
- **job pods** (labelled ``timeslice.io/job-id``): a job is live while one of its pods
  is Pending or Running; Succeeded, Failed and deleted pods do not count.

After every change the topology (groups -> nodes) and the live jobs are compared with
what they were, and the differences come out as typed events: :class:`GroupAppeared`,
:class:`GroupNodesChanged`, :class:`GroupGone`, :class:`JobGone`. A re-list (after 410
Gone) replaces a kind's objects at once, so what was deleted meanwhile is noticed too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Literal

from tslice.common import kube_labels
from tslice.orchestrator import config

Kind = Literal["node", "agent", "job"]


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    groups: frozenset[str]
    ready: bool
    unschedulable: bool

    @property
    def schedulable_member(self) -> bool:
        return self.ready and not self.unschedulable


@dataclasses.dataclass(frozen=True)
class AgentPod:
    key: str  # namespace/name
    node: str
    #: ``ip:port``; None while the pod has no IP or is not Running.
    address: str | None
    ready: bool = False
    created: str = ""


@dataclasses.dataclass(frozen=True)
class JobPod:
    key: str  # namespace/name
    job: str
    group: str | None
    #: Pending or Running (a Succeeded or Failed pod does not keep its job alive).
    live: bool


Item = NodeInfo | AgentPod | JobPod


@dataclasses.dataclass(frozen=True)
class GroupAppeared:
    group: str
    nodes: tuple[config.NodeRef, ...]


@dataclasses.dataclass(frozen=True)
class GroupNodesChanged:
    group: str
    nodes: tuple[config.NodeRef, ...]
    before: tuple[config.NodeRef, ...]


@dataclasses.dataclass(frozen=True)
class GroupGone:
    group: str


@dataclasses.dataclass(frozen=True)
class JobGone:
    job: str


Event = GroupAppeared | GroupNodesChanged | GroupGone | JobGone
Groups = Mapping[str, tuple[config.NodeRef, ...]]


def _key(item: Item) -> str:
    return item.name if isinstance(item, NodeInfo) else item.key


def no_agent_address(node: str) -> str:
    """Where a node's agent is while no agent pod was ever seen on it: nowhere (``.invalid``
    never resolves), so the node's group waits instead of switching without it."""
    return f"{node}.no-agent-pod.invalid:{kube_labels.AGENT_PORT}"


class ClusterModel:
    def __init__(self) -> None:
        self._items: dict[Kind, dict[str, Item]] = {"node": {}, "agent": {}, "job": {}}
        #: Node -> the address its agent was last seen at.
        self._last_address: dict[str, str] = {}

    # ---- changes in ---------------------------------------------------------------------

    def apply(self, kind: Kind, item: Item, *, deleted: bool = False) -> list[Event]:
        """One watch event (ADDED / MODIFIED, or DELETED with ``deleted``)."""
        before = self._snapshot()
        if deleted:
            self._items[kind].pop(_key(item), None)
        else:
            self._items[kind][_key(item)] = item
        self._last_address.update(self.agent_addresses())
        return diff(before, self._snapshot())

    def replace(self, kind: Kind, items: Iterable[Item]) -> list[Event]:
        """A full list of ``kind`` (the first one, or a re-list after 410 Gone)."""
        before = self._snapshot()
        self._items[kind] = {_key(i): i for i in items}
        self._last_address.update(self.agent_addresses())
        return diff(before, self._snapshot())

    # ---- views --------------------------------------------------------------------------

    def groups(self) -> dict[str, tuple[config.NodeRef, ...]]:
        """Group -> its member nodes (sorted by name) with their agent addresses."""
        members: dict[str, list[config.NodeRef]] = {}
        for node in self._items["node"].values():
            assert isinstance(node, NodeInfo)
            if not node.schedulable_member:
                continue
            address = self._last_address.get(node.name) or no_agent_address(node.name)
            for group in node.groups:
                members.setdefault(group, []).append(config.NodeRef(node.name, address))
        return {g: tuple(sorted(ns, key=lambda n: n.name)) for g, ns in sorted(members.items())}

    def agent_addresses(self) -> dict[str, str]:
        """Node -> its agent's address (the ready pod first, then the newest)."""
        best: dict[str, AgentPod] = {}
        for pod in self._items["agent"].values():
            assert isinstance(pod, AgentPod)
            if pod.address is None:
                continue
            held = best.get(pod.node)
            if held is None or (pod.ready, pod.created, pod.key) > (
                held.ready,
                held.created,
                held.key,
            ):
                best[pod.node] = pod
        return {node: pod.address for node, pod in best.items() if pod.address is not None}

    def live_jobs(self) -> frozenset[str]:
        return frozenset(
            p.job for p in self._items["job"].values() if isinstance(p, JobPod) and p.live
        )

    def finished_jobs(self) -> frozenset[str]:
        """Jobs whose pods are all Succeeded or Failed (listed, none live)."""
        listed = frozenset(p.job for p in self._items["job"].values() if isinstance(p, JobPod))
        return listed - self.live_jobs()

    def pending_nodes(self) -> dict[str, str]:
        """Labelled nodes that do not count, or whose groups cannot switch, with why: for
        the logs."""
        agents = self.agent_addresses()
        why: dict[str, str] = {}
        for node in self._items["node"].values():
            assert isinstance(node, NodeInfo)
            if not node.groups:
                continue
            if not node.ready:
                why[node.name] = "is not Ready"
            elif node.unschedulable:
                why[node.name] = "is cordoned"
            elif node.name not in agents:
                why[node.name] = "has no agent pod with an IP (its groups wait for it: UNKNOWN)"
        return why

    def _snapshot(self) -> tuple[dict[str, tuple[config.NodeRef, ...]], frozenset[str]]:
        return self.groups(), self.live_jobs()


def describe(event: Event) -> str:
    """One line for the logs."""

    def nodes(refs: tuple[config.NodeRef, ...]) -> str:
        return ", ".join(f"{n.name}@{n.address}" for n in refs) or "none"

    if isinstance(event, GroupAppeared):
        return f"group {event.group} appeared: {nodes(event.nodes)}"
    if isinstance(event, GroupNodesChanged):
        return f"group {event.group}: nodes {nodes(event.before)} -> {nodes(event.nodes)}"
    if isinstance(event, GroupGone):
        return f"group {event.group} is gone (no Ready, schedulable node is labelled for it)"
    return f"job {event.job} is gone (no Pending or Running pod left)"


def diff(
    before: tuple[Groups, frozenset[str]], after: tuple[Groups, frozenset[str]]
) -> list[Event]:
    """The events that turn ``before`` (groups, live jobs) into ``after``."""
    (old_groups, old_jobs), (new_groups, new_jobs) = before, after
    events: list[Event] = []
    for group, nodes in new_groups.items():
        if group not in old_groups:
            events.append(GroupAppeared(group, nodes))
        elif old_groups[group] != nodes:
            events.append(GroupNodesChanged(group, nodes, old_groups[group]))
    events += [GroupGone(g) for g in old_groups if g not in new_groups]
    events += [JobGone(j) for j in sorted(old_jobs - new_jobs)]
    return events
