"""Kubernetes objects as the tests put them into the emulator (plain JSON, as kubectl would)."""

from __future__ import annotations

from tests.kube.apistore import Obj

AGENT_LABELS = {"app.kubernetes.io/name": "tslice-agent", "app.kubernetes.io/part-of": "tslice"}


def node(
    name: str, *groups: str, ready: bool = True, unschedulable: bool = False, **labels: str
) -> Obj:
    all_labels = {**labels, **{f"group.timeslice.io/{g}": "true" for g in groups}}
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": {"unschedulable": unschedulable},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def agent_pod(node_name: str, ip: str, port: int = 9001, *, port_name: str = "grpc") -> Obj:
    return {
        "kind": "Pod",
        "metadata": {
            "name": f"tslice-agent-{node_name}",
            "namespace": "timeslice-system",
            "labels": dict(AGENT_LABELS),
        },
        "spec": {
            "nodeName": node_name,
            "containers": [
                {"name": "agent", "ports": [{"name": port_name, "containerPort": port}]}
            ],
        },
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def job_pod(
    name: str, job: str, group: str, *, phase: str = "Running", namespace: str = "rl"
) -> Obj:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"timeslice.io/job-id": job, "timeslice.io/group": group},
        },
        "spec": {"nodeName": "gpu-a", "containers": [{"name": "trainer"}]},
        "status": {"phase": phase},
    }
