"""Kubernetes mode's settings: defaults from the llm-d conventions, clear refusals."""

from __future__ import annotations

import pathlib

import pytest
from typer.testing import CliRunner

from tslice.cli.main import app
from tslice.common import errors
from tslice.orchestrator import config
from tslice.server import kube_labels


def test_kubernetes_mode_defaults() -> None:
    cfg = config.build(overrides={"kubernetes": True})
    assert cfg.kubernetes == config.KubeSettings(
        kubeconfig=None,
        agent_namespace=kube_labels.NAMESPACE,
        agent_selector=kube_labels.AGENT_SELECTOR,
        job_namespace=None,
    )
    assert dict(cfg.topology.groups) == {} and not cfg.topology.local


def test_kubernetes_settings_from_a_file(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "orchestrator.yaml"
    file.write_text(
        "kubernetes: true\nkubeconfig: kube/config\nagent_namespace: agents\n"
        "agent_selector: app=agent\njob_namespace: rl\n"
    )
    kube = config.build(config_file=file).kubernetes
    assert kube is not None
    assert kube.kubeconfig == tmp_path / "kube" / "config"  # beside the file, as topology_file
    assert (kube.agent_namespace, kube.agent_selector, kube.job_namespace) == (
        "agents",
        "app=agent",
        "rl",
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"kubernetes": True, "topology_file": "/etc/topology.yaml"},
            "--topology cannot be combined with it",
        ),
        ({"kubernetes": True, "local_agents": ["127.0.0.1:9001"]}, "--local-agent cannot"),
        ({"kubeconfig": "/root/.kube/config"}, "--kubeconfig is an option of Kubernetes mode"),
        ({"kubernetes": True, "agent_namespace": "Bad_NS"}, "is not a namespace name"),
        ({"kubernetes": True, "agent_selector": "  "}, "--agent-selector is empty"),
    ],
)
def test_refusals_name_the_fix(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        config.build(overrides=overrides)


def test_the_command_refuses_kubernetes_with_a_topology(tmp_path: pathlib.Path) -> None:
    topology = tmp_path / "topology.yaml"
    topology.write_text("groups: {g: {nodes: [{name: n, agent: '127.0.0.1:9001'}]}}\n")
    result = CliRunner().invoke(app, ["orchestrator", "--kubernetes", "--topology", str(topology)])
    assert result.exit_code == 2
    assert "--kubernetes takes the topology from the API server" in result.output
