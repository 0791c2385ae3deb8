"""The job pods on this node, by UID and by job, as the agent's pod stream last saw them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class PodInfo:
    uid: str
    #: ``namespace/name``, for messages.
    key: str
    #: ``timeslice.io/job-id``, ``timeslice.io/group`` (None: the pod has no such label).
    job: str
    group: str | None
    containers: tuple[str, ...]
    phase: str


class NodePods:
    """Job pods by UID; :meth:`replace` with a full list, :meth:`apply` each event."""

    def __init__(self) -> None:
        self._by_uid: dict[str, PodInfo] = {}

    def replace(self, pods: Iterable[PodInfo]) -> None:
        self._by_uid = {p.uid: p for p in pods if p.uid}

    def apply(self, pod: PodInfo, *, deleted: bool) -> None:
        if deleted:
            self._by_uid.pop(pod.uid, None)
        elif pod.uid:
            self._by_uid[pod.uid] = pod

    def pods(self) -> list[PodInfo]:
        return sorted(self._by_uid.values(), key=lambda p: p.key)

    def of_job(self, job: str) -> list[PodInfo]:
        return [p for p in self.pods() if p.job == job]

    def jobs(self) -> dict[str, list[PodInfo]]:
        found: dict[str, list[PodInfo]] = {}
        for pod in self.pods():
            found.setdefault(pod.job, []).append(pod)
        return found
