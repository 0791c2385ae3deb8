"""Kubernetes mode's process registry: a process that announces itself (or binds a
workload channel) for a job must be in a pod of that job on this node.

Which pod a process is in: the pod of this node whose UID its cgroup names
(``<proc>/<pid>/cgroup``, matched as :func:`discovery.pids_for_pod` does). The rule on
that pod (its ``timeslice.io/job-id`` and ``timeslice.io/group`` labels) is
``tslice.security.admission.pod_refusal``."""

from __future__ import annotations

import os
from collections.abc import Iterable

from tslice.agent import discovery
from tslice.agent.channel import registration
from tslice.agent.kube import node_pods
from tslice.security import admission
from tslice.server import kube_labels


def pod_of(
    pid: int, pods: node_pods.NodePods, *, proc_root: str | os.PathLike[str] = "/proc"
) -> node_pods.PodInfo | None:
    """The job pod of this node whose UID ``pid``'s cgroup names, if any."""
    for pod in pods.pods():
        if discovery.pids_for_pod(pod.uid, [pid], proc_root=proc_root):
            return pod
    return None


def refusal(
    pid: int,
    job: str,
    group: str,
    pods: node_pods.NodePods,
    *,
    proc_root: str | os.PathLike[str] = "/proc",
) -> str | None:
    """Why process ``pid`` may not register for ``job`` (and ``group``); None: it may
    (``tslice.security.admission.pod_refusal``, for the pod its cgroup names)."""
    return admission.pod_refusal(
        pid,
        job,
        group,
        pod_of(pid, pods, proc_root=proc_root),
        job_label=kube_labels.JOB_ID_LABEL,
        group_label=kube_labels.GROUP_LABEL,
    )


def pids_of_job(
    job: str,
    group: str,
    processes: Iterable[discovery.GpuProcess],
    pods: node_pods.NodePods,
    *,
    proc_root: str | os.PathLike[str] = "/proc",
) -> list[int]:
    """The processes holding device memory (NVML's) in the pods of ``job`` on this node;
    with a ``group``, those of its pods labelled for it or for no group. In PID order."""
    candidates = sorted({p.pid for p in processes})
    found: set[int] = set()
    for pod in pods.of_job(job):
        if group and pod.group is not None and pod.group != group:
            continue
        found.update(discovery.pids_for_pod(pod.uid, candidates, proc_root=proc_root))
    return sorted(found)


class PodCheckedRegistry(registration.ProcessRegistry):
    """Kubernetes mode's registry: a process announcing itself for a job on the register
    socket (the processes the cuda backend checkpoints) must be in a pod of that job."""

    #: Set once the pods of the node are known (until then nothing is accepted).
    check: admission.PodCheck | None = None
    #: The node's job pods, and where their processes are seen (for :meth:`pod_pids`).
    pods: node_pods.NodePods | None = None
    proc_root: str | os.PathLike[str] = "/proc"

    def pod_pids(
        self, job_id: str, group: str, processes: Iterable[discovery.GpuProcess]
    ) -> list[int]:
        """Of NVML's ``processes``, those in the job's pods here (see :func:`pids_of_job`)."""
        if self.pods is None:
            return []
        return pids_of_job(job_id, group, processes, self.pods, proc_root=self.proc_root)

    def register(
        self, *, job_id: str, pid: int, group: str = "", uid: int = -1
    ) -> registration.Registration:
        why = (
            self.check(pid, job_id, group)
            if self.check is not None
            else "the agent has not listed the pods of its node yet; retry in a moment"
        )
        if why is not None:
            raise registration.RegistrationError(why)
        return super().register(job_id=job_id, pid=pid, group=group, uid=uid)
