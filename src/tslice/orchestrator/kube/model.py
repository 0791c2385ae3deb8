"""The cluster as Kubernetes mode sees it: pure, no client library, fed by the watcher.

Three kinds of object come in (already reduced to what matters, see ``watch``):

- **nodes**: a node is a member of the groups its labels name
  (``group.timeslice.io/<g>=true``, tslice.server.kube_labels) while it is Ready and not
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
from collections.abc import Set as AbstractSet
from typing import Literal

from tslice.orchestrator import config
from tslice.server import kube_labels

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
    """The cluster, and indexes that make a watch event cost what it touches: a job pod's
    event touches its job, a node's its groups, an agent pod's its node's groups (issue 22
    §5: rebuilding every group and live job per event cost 8 ms at 9,000 objects, and a
    burst stalled the loop for seconds). A full list (:meth:`replace`) rebuilds them."""

    def __init__(self) -> None:
        self._items: dict[Kind, dict[str, Item]] = {"node": {}, "agent": {}, "job": {}}
        #: Node -> the address its agent was last seen at.
        self._last_address: dict[str, str] = {}
        #: Group -> its member nodes (Ready, schedulable) by name.
        self._members: dict[str, dict[str, config.NodeRef]] = {}
        #: Node -> the groups it is a member of now.
        self._member_of: dict[str, frozenset[str]] = {}
        #: Node -> its agent pods by key.
        self._agents_of: dict[str, dict[str, AgentPod]] = {}
        #: Job -> the keys of its live pods (jobs with one only).
        self._live: dict[str, set[str]] = {}

    # ---- changes in ---------------------------------------------------------------------

    def apply(self, kind: Kind, item: Item, *, deleted: bool = False) -> list[Event]:
        """One watch event (ADDED / MODIFIED, or DELETED with ``deleted``)."""
        key = _key(item)
        old = self._items[kind].get(key)
        new = None if deleted else item
        nodes = {n for i in (old, new) if (n := _node_of(i))}
        jobs = {i.job for i in (old, new) if isinstance(i, JobPod)}
        groups = sorted({g for n in nodes for g in self._groups_near(n, new)})
        before = {g: self._group(g) for g in groups}
        was_live = {j for j in jobs if j in self._live}
        self._forget(kind, key, old)
        if new is not None:
            self._items[kind][key] = new
            self._index(new)
        for node in nodes:
            self._place(node)
        after = {g: self._group(g) for g in groups}
        return diff(
            ({g: ns for g, ns in before.items() if ns}, frozenset(was_live)),
            (
                {g: ns for g, ns in after.items() if ns},
                frozenset(j for j in jobs if j in self._live),
            ),
        )

    def replace(self, kind: Kind, items: Iterable[Item]) -> list[Event]:
        """A full list of ``kind`` (the first one, or a re-list after 410 Gone)."""
        before = self._snapshot()
        self._items[kind] = {_key(i): i for i in items}
        self._members, self._member_of, self._agents_of, self._live = {}, {}, {}, {}
        for each in self._items.values():
            for item in each.values():
                self._index(item)
        for node in {*self._items["node"], *self._agents_of}:
            self._place(node)
        return diff(before, self._snapshot())

    def _forget(self, kind: Kind, key: str, old: Item | None) -> None:
        self._items[kind].pop(key, None)
        if isinstance(old, AgentPod):
            self._agents_of.get(old.node, {}).pop(key, None)
        elif isinstance(old, JobPod):
            live = self._live.get(old.job)
            if live is not None:
                live.discard(key)
                if not live:
                    del self._live[old.job]

    def _index(self, item: Item) -> None:
        if isinstance(item, AgentPod):
            self._agents_of.setdefault(item.node, {})[item.key] = item
        elif isinstance(item, JobPod) and item.live:
            self._live.setdefault(item.job, set()).add(item.key)

    def _groups_near(self, node: str, new: Item | None) -> set[str]:
        """The groups whose membership a change at ``node`` may touch."""
        near = set(self._member_of.get(node, ()))
        if isinstance(new, NodeInfo):
            near |= new.groups
        return near

    def _place(self, node: str) -> None:
        """``node``'s agent address and group memberships from its items now."""
        address = self._best_address(node)
        if address is not None:
            self._last_address[node] = address
        for group in self._member_of.pop(node, ()):
            members = self._members[group]
            members.pop(node, None)
            if not members:
                del self._members[group]
        info = self._items["node"].get(node)
        if not isinstance(info, NodeInfo) or not info.schedulable_member or not info.groups:
            return
        ref = config.NodeRef(node, self._last_address.get(node) or no_agent_address(node))
        for group in info.groups:
            self._members.setdefault(group, {})[node] = ref
        self._member_of[node] = info.groups

    def _best_address(self, node: str) -> str | None:
        """The node's agent's address: the ready pod first, then the newest."""
        best: AgentPod | None = None
        for pod in self._agents_of.get(node, {}).values():
            if pod.address is None:
                continue
            if best is None or (pod.ready, pod.created, pod.key) > (
                best.ready,
                best.created,
                best.key,
            ):
                best = pod
        return best.address if best is not None else None

    def _group(self, group: str) -> tuple[config.NodeRef, ...]:
        members = self._members.get(group, {})
        return tuple(members[n] for n in sorted(members))

    # ---- views --------------------------------------------------------------------------

    def groups(self) -> dict[str, tuple[config.NodeRef, ...]]:
        """Group -> its member nodes (sorted by name) with their agent addresses."""
        return {g: self._group(g) for g in sorted(self._members)}

    def agent_addresses(self) -> dict[str, str]:
        """Node -> its agent's address (the ready pod first, then the newest)."""
        found = {node: self._best_address(node) for node in self._agents_of}
        return {node: address for node, address in found.items() if address is not None}

    def live_jobs(self) -> AbstractSet[str]:
        """The jobs with a Pending or Running pod (a live view: no copy)."""
        return self._live.keys()

    def finished_jobs(self) -> frozenset[str]:
        """Jobs whose pods are all Succeeded or Failed (listed, none live)."""
        listed = frozenset(p.job for p in self._items["job"].values() if isinstance(p, JobPod))
        return listed - self._live.keys()

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
        return self.groups(), frozenset(self._live)


def _node_of(item: Item | None) -> str:
    """The node ``item`` sits on ("" for a job pod or none)."""
    if isinstance(item, NodeInfo):
        return item.name
    return item.node if isinstance(item, AgentPod) else ""


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
