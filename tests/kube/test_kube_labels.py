"""The llm-d Kubernetes conventions (shared WIRE.md "Kubernetes conventions") are pinned."""

from __future__ import annotations

import pathlib

import pytest

from tslice.server import kube_labels as kl

#: WIRE.md's section, as written there (the strings clusters labelled for llm-d carry).
WIRE_SECTION = """\
Pod labels `timeslice.io/job-id`, `timeslice.io/group`; node label
`group.timeslice.io/<group>=true`; taint `timeslice.io/shared=true:NoSchedule`;
namespace `timeslice-system`; ports: orchestrator gRPC 50051, metrics 8080, agent 9001."""


def test_the_constants_are_the_wire_strings() -> None:
    assert f"`{kl.JOB_ID_LABEL}`, `{kl.GROUP_LABEL}`" in WIRE_SECTION
    assert f"`{kl.group_node_label('<group>')}={kl.GROUP_NODE_LABEL_VALUE}`" in WIRE_SECTION
    taint = f"{kl.SHARED_TAINT_KEY}={kl.SHARED_TAINT_VALUE}:{kl.SHARED_TAINT_EFFECT}"
    assert f"taint `{taint}`" in WIRE_SECTION
    assert f"namespace `{kl.NAMESPACE}`" in WIRE_SECTION
    ports = (kl.ORCHESTRATOR_PORT, kl.METRICS_PORT, kl.AGENT_PORT)
    assert "orchestrator gRPC {}, metrics {}, agent {}".format(*ports) in WIRE_SECTION


def test_the_section_is_wire_md_s_own() -> None:
    wire = pathlib.Path(__file__).resolve().parents[3] / "shared" / "WIRE.md"
    if not wire.is_file():
        pytest.skip("shared/WIRE.md not beside this checkout")
    text = wire.read_text(encoding="utf-8")
    assert WIRE_SECTION in text, "WIRE.md's Kubernetes conventions changed: update kube_labels"


def test_a_node_is_in_the_groups_labelled_exactly_true() -> None:
    labels = {
        "group.timeslice.io/trainer": "true",
        "group.timeslice.io/sampler": "True",  # not exactly "true": not a member
        "group.timeslice.io/": "true",  # no group name
        "group.timeslice.io/rollout": "true",
        "kubernetes.io/hostname": "gpu-a",
    }
    assert kl.groups_of_node(labels) == {"trainer", "rollout"}
    assert kl.groups_of_node(None) == frozenset()


def test_job_and_group_of_a_pod() -> None:
    pod = {"timeslice.io/job-id": "grpo-7b", "timeslice.io/group": "trainer"}
    assert (kl.job_of_pod(pod), kl.group_of_pod(pod)) == ("grpo-7b", "trainer")
    assert kl.job_of_pod({"timeslice.io/job-id": ""}) is None
    assert kl.group_of_pod({}) is None
