"""The Kubernetes conventions of llm-d's time-slicing project (``WIRE.md``), in one place.

Clusters already labelled for llm-d work unchanged: a node is in group ``<group>`` when
it carries the label ``group.timeslice.io/<group>=true`` (the value exactly ``"true"``);
a pod belongs to job ``<job>`` through ``timeslice.io/job-id=<job>``, in a group through
``timeslice.io/group=<group>``. The orchestrator's discovery (``tslice.orchestrator.kube``)
and the manifests' test both read these strings from here. Pure: no Kubernetes client.
"""

from __future__ import annotations

from collections.abc import Mapping

#: Node label prefix: ``group.timeslice.io/<group>=true`` puts a node in ``<group>``.
GROUP_NODE_LABEL_PREFIX = "group.timeslice.io/"
#: The only value of a group node label that makes the node a member.
GROUP_NODE_LABEL_VALUE = "true"
#: Pod label naming the job a pod is part of.
JOB_ID_LABEL = "timeslice.io/job-id"
#: Pod label naming the group a job's pod runs in.
GROUP_LABEL = "timeslice.io/group"
#: Taint of shared accelerator nodes (agents and RL job pods tolerate it).
SHARED_TAINT_KEY = "timeslice.io/shared"
SHARED_TAINT_VALUE = "true"
SHARED_TAINT_EFFECT = "NoSchedule"
#: Namespace of the orchestrator and the agent DaemonSet.
NAMESPACE = "timeslice-system"
#: Ports: orchestrator gRPC and metrics, agent gRPC.
ORCHESTRATOR_PORT = 50051
METRICS_PORT = 8080
AGENT_PORT = 9001
#: Container port name under which an agent pod serves gRPC.
AGENT_PORT_NAME = "grpc"
#: Label selector of the agent DaemonSet's pods (tslice's manifests).
AGENT_SELECTOR = "app.kubernetes.io/name=tslice-agent"


def group_node_label(group: str) -> str:
    """The node label that puts a node in ``group``."""
    return GROUP_NODE_LABEL_PREFIX + group


def groups_of_node(labels: Mapping[str, str] | None) -> frozenset[str]:
    """The groups a node's labels put it in (``group.timeslice.io/<g>`` = exactly "true")."""
    return frozenset(
        key[len(GROUP_NODE_LABEL_PREFIX) :]
        for key, value in (labels or {}).items()
        if key.startswith(GROUP_NODE_LABEL_PREFIX)
        and len(key) > len(GROUP_NODE_LABEL_PREFIX)
        and value == GROUP_NODE_LABEL_VALUE
    )


def job_of_pod(labels: Mapping[str, str] | None) -> str | None:
    """The job a pod belongs to (``None``: no or empty ``timeslice.io/job-id``)."""
    return (labels or {}).get(JOB_ID_LABEL) or None


def group_of_pod(labels: Mapping[str, str] | None) -> str | None:
    """The group a pod runs in (``None``: no or empty ``timeslice.io/group``)."""
    return (labels or {}).get(GROUP_LABEL) or None
