"""The pure cluster model: membership rules, agent choice, typed events."""

from __future__ import annotations

import random

import pytest

from tslice.orchestrator import config
from tslice.orchestrator.kube import model


def _node(name: str, *groups: str, ready: bool = True, cordoned: bool = False) -> model.NodeInfo:
    return model.NodeInfo(name, frozenset(groups), ready=ready, unschedulable=cordoned)


def _agent(
    node: str, address: str | None, *, ready: bool = True, created: str = "1"
) -> model.AgentPod:
    return model.AgentPod(f"ns/{node}-{created}", node, address, ready=ready, created=created)


def test_a_labelled_node_counts_with_or_without_its_agent() -> None:
    cluster = model.ClusterModel()
    # No agent yet: the node is there, at an address that resolves nowhere (its group waits).
    nowhere = config.NodeRef("a", model.no_agent_address("a"))
    assert cluster.apply("node", _node("a", "g")) == [model.GroupAppeared("g", (nowhere,))]
    assert cluster.pending_nodes() == {
        "a": "has no agent pod with an IP (its groups wait for it: UNKNOWN)"
    }
    assert cluster.apply("agent", _agent("a", None)) == []  # Pending: no IP yet
    first = config.NodeRef("a", "10.0.0.1:9001")
    assert cluster.apply("agent", _agent("a", "10.0.0.1:9001")) == [
        model.GroupNodesChanged("g", (first,), (nowhere,))
    ]
    # The agent pod goes (a restart): the node stays, at the address it had.
    assert cluster.replace("agent", []) == []
    second = config.NodeRef("a", "10.0.0.2:9001")
    assert cluster.apply("agent", _agent("a", "10.0.0.2:9001", created="2")) == [
        model.GroupNodesChanged("g", (second,), (first,))
    ]


def test_the_ready_then_newest_agent_pod_of_a_node_wins() -> None:
    cluster = model.ClusterModel()
    cluster.apply("node", _node("a", "g"))
    cluster.replace(
        "agent",
        [
            _agent("a", "10.0.0.1:9001", created="1"),
            _agent("a", "10.0.0.2:9001", created="2"),
            _agent("a", "10.0.0.3:9001", created="3", ready=False),
        ],
    )
    assert cluster.agent_addresses() == {"a": "10.0.0.2:9001"}


def test_a_relist_notices_what_went_meanwhile() -> None:
    cluster = model.ClusterModel()
    cluster.replace("node", [_node("a", "g"), _node("b", "g", "h")])
    cluster.replace("agent", [_agent("a", "10.0.0.1:9001"), _agent("b", "10.0.0.2:9001")])
    cluster.replace("job", [model.JobPod("rl/p", "job-a", "g", live=True)])
    events = cluster.replace("node", [_node("a", "g")])
    a = config.NodeRef("a", "10.0.0.1:9001")
    b = config.NodeRef("b", "10.0.0.2:9001")
    assert events == [model.GroupNodesChanged("g", (a,), (a, b)), model.GroupGone("h")]
    assert cluster.replace("job", []) == [model.JobGone("job-a")]


class _Reference:
    """The model as it was before issue 22 §5: every view rebuilt from every object."""

    def __init__(self) -> None:
        self.items: dict[str, dict[str, model.Item]] = {"node": {}, "agent": {}, "job": {}}
        self.last_address: dict[str, str] = {}

    def change(self, kind: model.Kind, item: model.Item, deleted: bool) -> list[model.Event]:
        before = self.snapshot()
        key = item.name if isinstance(item, model.NodeInfo) else item.key
        if deleted:
            self.items[kind].pop(key, None)
        else:
            self.items[kind][key] = item
        return model.diff(before, self.snapshot())

    def snapshot(self) -> tuple[dict[str, tuple[config.NodeRef, ...]], frozenset[str]]:
        best: dict[str, model.AgentPod] = {}
        for pod in self.items["agent"].values():
            assert isinstance(pod, model.AgentPod)
            held = best.get(pod.node)
            rank = (pod.ready, pod.created, pod.key)
            if pod.address is not None and (
                held is None or rank > (held.ready, held.created, held.key)
            ):
                best[pod.node] = pod
        self.last_address.update({n: p.address for n, p in best.items() if p.address})
        members: dict[str, list[config.NodeRef]] = {}
        for node in self.items["node"].values():
            assert isinstance(node, model.NodeInfo)
            if node.schedulable_member:
                address = self.last_address.get(node.name) or model.no_agent_address(node.name)
                for g in node.groups:
                    members.setdefault(g, []).append(config.NodeRef(node.name, address))
        groups = {g: tuple(sorted(ns, key=lambda n: n.name)) for g, ns in sorted(members.items())}
        live = frozenset(
            p.job for p in self.items["job"].values() if isinstance(p, model.JobPod) and p.live
        )
        return groups, live


def _random_item(rng: random.Random) -> tuple[model.Kind, model.Item]:
    node = f"n{rng.randrange(6)}"
    kind: model.Kind = rng.choice(["node", "agent", "job"])
    if kind == "node":
        groups = frozenset(rng.sample(["g", "h", "k"], rng.randrange(3)))
        return kind, model.NodeInfo(node, groups, rng.random() < 0.8, rng.random() < 0.2)
    if kind == "agent":
        address = None if rng.random() < 0.2 else f"10.0.0.{rng.randrange(9)}:9001"
        return kind, model.AgentPod(
            f"ns/agent-{rng.randrange(8)}", node, address, rng.random() < 0.7, str(rng.randrange(3))
        )
    job = f"job-{rng.randrange(4)}"
    return kind, model.JobPod(f"rl/{job}-{rng.randrange(3)}", job, None, rng.random() < 0.7)


@pytest.mark.parametrize("seed", range(20))
def test_the_indexed_model_says_what_rebuilding_every_view_says(seed: int) -> None:
    rng = random.Random(seed)
    indexed, reference = model.ClusterModel(), _Reference()
    for _ in range(300):
        kind, item = _random_item(rng)
        if rng.random() < 0.05:  # now and then a full list of one kind
            kind = rng.choice(["node", "agent", "job"])
            listed = [i for i in (_random_item(rng) for _ in range(6)) if i[0] == kind]
            before = reference.snapshot()
            reference.items[kind] = {
                (i.name if isinstance(i, model.NodeInfo) else i.key): i for _, i in listed
            }
            expected = model.diff(before, reference.snapshot())
            assert indexed.replace(kind, [i for _, i in listed]) == expected
            continue
        deleted = rng.random() < 0.3
        assert indexed.apply(kind, item, deleted=deleted) == reference.change(kind, item, deleted)
        groups, live = reference.snapshot()
        assert indexed.groups() == groups and set(indexed.live_jobs()) == live
