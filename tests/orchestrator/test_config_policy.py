"""The scheduling policy sections of the topology and config files."""

from __future__ import annotations

import pathlib

import pytest

from tslice.common import errors
from tslice.orchestrator import config, policy

NODE = "{name: n, agent: 'h:1'}"


def topology(tmp_path: pathlib.Path, policy_yaml: str) -> pathlib.Path:
    p = tmp_path / "topology.yaml"
    p.write_text(
        f"groups:\n  g: {{nodes: [{NODE}], policy: {policy_yaml}}}\n  h: {{nodes: [{NODE}]}}\n"
    )
    return p


def test_each_group_has_its_policy_and_the_others_the_default(tmp_path: pathlib.Path) -> None:
    p = topology(tmp_path, "{kind: priority, aging_s: 30, priority: {job-a: 10}}")
    cfg = config.build(overrides={"topology_file": str(p), "policy": "fair-share"})
    assert cfg.policy_for("g") == policy.PrioritySpec(30.0, {"job-a": 10}, 0)
    assert cfg.policy_for("h") == policy.FairShareSpec()
    assert config.build(overrides={"topology_file": str(p)}).policy_for("h") == policy.FifoSpec()


@pytest.mark.parametrize(
    ("section", "spec"),
    [
        ("fifo", policy.FifoSpec()),
        (
            "{kind: fair-share, weights: {a: 2, b: 0.5}, quantum_s: 2}",
            policy.FairShareSpec({"a": 2.0, "b": 0.5}, quantum_s=2.0),
        ),
        (
            "{kind: cost-aware, max_defer_s: 5, bandwidth_gb_s: 25, gap_samples: 3}",
            policy.CostAwareSpec(max_defer_s=5.0, bandwidth_bytes_per_s=25e9, gap_samples=3),
        ),
    ],
)
def test_every_kind_loads(tmp_path: pathlib.Path, section: str, spec: policy.PolicySpec) -> None:
    topo = config.load_topology(topology(tmp_path, section))
    assert topo.policies == {"g": spec}
    assert isinstance(policy.build(spec), policy.Policy)


@pytest.mark.parametrize(
    ("section", "fragment"),
    [
        ("{kind: lottery}", "groups.g.policy: unknown policy kind 'lottery'; use one of: fifo,"),
        ("{aging_s: 3}", "groups.g.policy: the policy needs a `kind`"),
        ("3", "groups.g.policy: write `policy: KIND` or `policy: {kind: KIND, ...}`"),
        ("{kind: priority, aging_s: 0}", "groups.g.policy.aging_s: Input should be greater than 0"),
        ("{kind: priority, aging_s: .inf}", "groups.g.policy.aging_s: Input should be less"),
        ("{kind: priority, priority: {'bad id': 1}}", "groups.g.policy.priority: job id 'bad id'"),
        (
            "{kind: fair-share, weights: {a: -1}}",
            "groups.g.policy.weights.a: Input should be greater",
        ),
        ("{kind: fair-share, weight: {a: 1}}", "groups.g.policy.weight: Extra inputs"),
        ("{kind: cost-aware, gap_samples: 0}", "groups.g.policy.gap_samples: Input should be"),
        # Found in issue 21: `true` was taken as level 1, 1e308 made the starvation bound
        # infinite.
        ("{kind: priority, priority: {a: true}}", "groups.g.policy.priority.a: true is not a"),
        ("{kind: priority, default_priority: false}", "policy.default_priority: false is not"),
        ("{kind: priority, aging_s: 1e308}", "groups.g.policy.aging_s: Input should be less"),
        ("{kind: priority, aging_s: 1.0e308}", "groups.g.policy.aging_s: Input should be less"),
        (
            "{kind: priority, aging_s: 60, priority: {a: 1000000}}",
            "groups.g.policy: a waiter at level 0 could wait 694 days before it passes level",
        ),
        ("{kind: fair-share, weights: {a: true}}", "groups.g.policy.weights.a: true is not a"),
        ("{kind: fair-share, quantum_s: 1e308}", "groups.g.policy.quantum_s: Input should be"),
        ("{kind: cost-aware, gap_samples: true}", "groups.g.policy.gap_samples: true is not"),
    ],
)
def test_bad_policies_name_the_field_and_the_fix(
    tmp_path: pathlib.Path, section: str, fragment: str
) -> None:
    with pytest.raises(errors.ConfigError) as info:
        config.load_topology(topology(tmp_path, section))
    assert fragment in str(info.value)


def test_the_default_policy_is_checked_too_and_local_mode_uses_it() -> None:
    with pytest.raises(errors.ConfigError, match="policy: unknown policy kind 'x'"):
        config.build(overrides={"local_agents": ["h:1"], "policy": "x"})
    cfg = config.build(overrides={"local_agents": ["h:1"], "policy": {"kind": "cost-aware"}})
    assert cfg.policy_for("any-group") == policy.CostAwareSpec()


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("port", "true", "port: true is not a number"),
        ("reattach_grace_s", "false", "reattach_grace_s: false is not a number"),
        ("reattach_grace_s", ".inf", "reattach_grace_s: Input should be a finite number"),
        ("backoff_max_s", ".nan", "backoff_max_s: Input should be a finite number"),
    ],
)
def test_the_orchestrators_numbers_are_numbers_and_finite(
    tmp_path: pathlib.Path, key: str, value: str, fragment: str
) -> None:
    path = tmp_path / "orchestrator.yaml"
    path.write_text(f"local_agents: ['h:1']\n{key}: {value}\n")
    with pytest.raises(errors.ConfigError) as info:
        config.build(config_file=path)
    assert fragment in str(info.value)
