"""Topology and orchestrator config validation: errors name the path and the fix."""

from __future__ import annotations

import pathlib

import pytest

from tslice.common import errors
from tslice.orchestrator import config


def write(tmp_path: pathlib.Path, text: str, name: str = "topology.yaml") -> pathlib.Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_topology_example_loads(tmp_path: pathlib.Path) -> None:
    p = write(
        tmp_path,
        """
groups:
  sampler: {nodes: [{name: node-a, agent: 127.0.0.1:9001}]}
  trainer: {nodes: [{name: node-b, agent: 127.0.0.1:9002}, {name: node-c, agent: "10.0.0.3:9001"}]}
""",
    )
    topo = config.load_topology(p)
    assert not topo.local
    assert list(topo.groups) == ["sampler", "trainer"]
    assert topo.groups["trainer"][1] == config.NodeRef("node-c", "10.0.0.3:9001")


def test_a_node_may_appear_in_several_groups(tmp_path: pathlib.Path) -> None:
    p = write(
        tmp_path,
        """
groups:
  a: {nodes: [{name: n1, agent: "h:1"}]}
  b: {nodes: [{name: n1, agent: "h:1"}]}
""",
    )
    assert len(config.load_topology(p).groups) == 2


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (
            "groups:\n  trainer: {nodes: [{name: a, agent: 'h:1'}, {name: b, agent: nohost}]}\n",
            "groups.trainer.nodes[1].agent: 'nohost' is not an agent address; write host:port",
        ),
        (
            "groups:\n  t: {nodes: [{name: a, agent: 'h:1'}, {name: a, agent: 'h:2'}]}\n",
            "groups.t.nodes: node name 'a' appears twice",
        ),
        (
            # One node, two agents: refused (it was accepted, and the groups disagreed).
            "groups:\n  a: {nodes: [{name: n1, agent: 'h:1'}]}\n"
            "  b: {nodes: [{name: n1, agent: 'h:2'}]}\n",
            "node 'n1' has two agent addresses, h:1 and h:2 (group b)",
        ),
        ("groups:\n  t: {nodes: []}\n", "groups.t.nodes: List should have at least 1 item"),
        ("groups: {}\n", "no groups defined"),
        (
            "groups:\n  'bad id': {nodes: [{name: a, agent: 'h:1'}]}\n",
            "group id 'bad id' is malformed",
        ),
        ("groups:\n  t: {nodes: [{name: '', agent: 'h:1'}]}\n", "groups.t.nodes[0].name"),
        ("groups:\n  t: {nodes: [{name: a, agent: 'h:99999'}]}\n", "groups.t.nodes[0].agent"),
        ("groups:\n  t: {nodes: [{name: a, agnt: 'h:1'}]}\n", "groups.t.nodes[0].agnt: Extra"),
        ("mode: local\n", "`mode: local` needs `nodes"),
        ("- a\n", "must be a YAML mapping"),
        ("groups: [\n", "not valid YAML"),
    ],
)
def test_topology_errors_name_the_path(tmp_path: pathlib.Path, text: str, fragment: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(errors.ConfigError) as info:
        config.load_topology(p)
    assert fragment in str(info.value)


def test_missing_topology_file_is_clear(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.ConfigError, match="cannot read topology file"):
        config.load_topology(tmp_path / "nope.yaml")


def test_local_mode_from_flags_and_names() -> None:
    cfg = config.build(overrides={"local_agents": ["127.0.0.1:9001", "b=127.0.0.1:9002"]})
    assert cfg.topology.local
    assert cfg.topology.local_nodes == (
        config.NodeRef("127.0.0.1:9001", "127.0.0.1:9001"),
        config.NodeRef("b", "127.0.0.1:9002"),
    )
    assert cfg.port == 50051 and cfg.agent_rpc_timeout_s == 10 and cfg.reattach_grace_s == 30


def test_local_mode_from_topology_file(tmp_path: pathlib.Path) -> None:
    p = write(tmp_path, "mode: local\nnodes: [{name: n1, agent: '127.0.0.1:1'}]\n")
    cfg = config.build(overrides={"topology_file": str(p)})
    assert cfg.topology.local_nodes == (config.NodeRef("n1", "127.0.0.1:1"),)


def test_config_file_with_relative_topology_and_overrides(tmp_path: pathlib.Path) -> None:
    write(tmp_path, "groups:\n  g: {nodes: [{name: n, agent: 'h:1'}]}\n")
    cfg_file = write(
        tmp_path,
        "topology_file: topology.yaml\nport: 6000\nagent_rpc_timeout_s: 3\nlog_level: DEBUG\n",
        "orch.yaml",
    )
    cfg = config.build(config_file=cfg_file, overrides={"port": 0})
    assert cfg.port == 0 and cfg.agent_rpc_timeout_s == 3 and cfg.log_level == "debug"
    assert list(cfg.topology.groups) == ["g"]


def test_config_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.ConfigError, match="no topology"):
        config.build()
    with pytest.raises(errors.ConfigError, match="agent_rpc_timeout_s: Input should be greater"):
        config.build(overrides={"local_agents": ["h:1"], "agent_rpc_timeout_s": 0})
    with pytest.raises(errors.ConfigError, match="--local-agent 'x': 'x' is not an agent"):
        config.build(overrides={"local_agents": ["x"]})
    with pytest.raises(errors.ConfigError, match="used twice"):
        config.build(overrides={"local_agents": ["a=h:1", "a=h:2"]})
    p = write(tmp_path, "groups:\n  g: {nodes: [{name: n, agent: 'h:1'}]}\n")
    with pytest.raises(errors.ConfigError, match="cannot be combined with a static topology"):
        config.build(overrides={"local_agents": ["h:1"], "topology_file": str(p)})
    bad = write(tmp_path, "prot: 1\n", "bad.yaml")
    with pytest.raises(errors.ConfigError, match=r"bad.yaml: prot: Extra inputs"):
        config.build(config_file=bad)
