"""The pure cluster model: membership rules, agent choice, typed events."""

from __future__ import annotations

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
