"""List-then-watch of the API server (lightkube), feeding a :class:`model.ClusterModel`.

Three streams (``tslice.server.kube_watch``: list, watch from the list's version,
bookmarks, backoff, re-list on ``410 Gone``):

- nodes (all of them: a group label can be added to any node);
- job pods (``timeslice.io/job-id`` present), in ``--job-namespace`` or all namespaces;
- agent pods (``--agent-selector`` in ``--agent-namespace``).

A re-list replaces that kind's objects in the model, so deletions missed meanwhile are seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from lightkube import AsyncClient
from lightkube.resources.core_v1 import Node, Pod

from tslice.common import tasks
from tslice.orchestrator import config
from tslice.orchestrator.kube import model
from tslice.orchestrator.switch import step as switch
from tslice.server import kube_labels, kube_watch

log = logging.getLogger(__name__)

ALL_NAMESPACES = kube_watch.ALL_NAMESPACES
WATCH_TIMEOUT_S = kube_watch.WATCH_TIMEOUT_S
_LIVE_PHASES = frozenset({"Pending", "Running"})

OnEvents = Callable[[list[model.Event]], None]
#: ``(kind, resourceVersion)`` each time a stream's version moves (bookmarks included).
OnProgress = Callable[[model.Kind, str], None]


def connect(settings: config.KubeSettings) -> AsyncClient:
    """A client: ``--kubeconfig`` if given, else in-cluster, then $KUBECONFIG / ~/.kube/config."""
    client: AsyncClient = kube_watch.connect(settings.kubeconfig)
    return client


# ---- objects in, model items out ---------------------------------------------------------


def _key(obj: Any) -> str:
    meta = obj.metadata
    return f"{meta.namespace or ''}/{meta.name}"


def node_info(node: Node) -> model.NodeInfo:
    meta, spec, status = node.metadata, node.spec, node.status
    conditions = (status.conditions if status is not None else None) or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return model.NodeInfo(
        name=meta.name if meta is not None and meta.name else "",
        groups=kube_labels.groups_of_node(meta.labels if meta is not None else None),
        ready=ready,
        unschedulable=bool(spec is not None and spec.unschedulable),
    )


def _grpc_port(pod: Pod) -> int:
    for container in pod.spec.containers if pod.spec is not None else []:
        for port in container.ports or []:
            if port.name == kube_labels.AGENT_PORT_NAME:
                return port.containerPort
    return kube_labels.AGENT_PORT


def agent_pod(pod: Pod) -> model.AgentPod:
    status, spec = pod.status, pod.spec
    phase = status.phase if status is not None else None
    ip = status.podIP if status is not None else None
    conditions = (status.conditions if status is not None else None) or []
    node = (spec.nodeName if spec is not None else None) or ""
    address = None
    if phase == "Running" and ip and node:
        host = f"[{ip}]" if ":" in ip else ip
        address = f"{host}:{_grpc_port(pod)}"
    created = pod.metadata.creationTimestamp if pod.metadata is not None else None
    return model.AgentPod(
        key=_key(pod),
        node=node,
        address=address,
        ready=any(c.type == "Ready" and c.status == "True" for c in conditions),
        created=str(created or ""),
    )


def job_pod(pod: Pod) -> model.JobPod:
    labels = pod.metadata.labels if pod.metadata is not None else None
    job = kube_labels.job_of_pod(labels)
    phase = pod.status.phase if pod.status is not None else None
    return model.JobPod(
        key=_key(pod),
        job=job or "",
        group=kube_labels.group_of_pod(labels),
        live=job is not None and phase in _LIVE_PHASES,
    )


# ---- the streams -------------------------------------------------------------------------


class Watcher:
    """Keeps :attr:`model` in step with the API server; ``on_events`` gets its changes."""

    def __init__(
        self,
        client: AsyncClient,
        settings: config.KubeSettings,
        *,
        on_events: OnEvents,
        backoff: switch.Backoff | None = None,
        watch_timeout_s: int = WATCH_TIMEOUT_S,
        on_progress: OnProgress | None = None,
    ) -> None:
        self.model = model.ClusterModel()
        self._client = client
        self._on_events = on_events
        self._on_progress = on_progress
        self._backoff = backoff or switch.Backoff(0.2, 10.0)
        self._watch_timeout_s = watch_timeout_s
        self._streams = [
            self._stream("node", Node, node_info),
            self._stream(
                "job",
                Pod,
                job_pod,
                namespace=settings.job_namespace or ALL_NAMESPACES,
                labels=kube_labels.JOB_ID_LABEL,
            ),
            self._stream(
                "agent",
                Pod,
                agent_pod,
                namespace=settings.agent_namespace,
                labels=settings.agent_selector,
            ),
        ]
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def relists(self) -> int:
        """Times a stream started again from a list after its version was gone (for tests)."""
        return sum(s.relists for s in self._streams)

    def _stream(
        self,
        kind: model.Kind,
        resource: type[Any],
        convert: Callable[[Any], model.Item],
        *,
        namespace: str | None = None,
        labels: str | None = None,
    ) -> kube_watch.Stream:
        def listed(objs: list[Any]) -> None:
            self._emit(self.model.replace(kind, [convert(o) for o in objs]))

        def changed(type_: str, obj: Any) -> None:
            self._emit(self.model.apply(kind, convert(obj), deleted=type_ == "DELETED"))

        def progressed(version: str) -> None:
            if self._on_progress is not None:
                self._on_progress(kind, version)

        return kube_watch.Stream(
            resource,
            on_list=listed,
            on_event=changed,
            on_progress=progressed,
            namespace=namespace,
            labels=labels,
            who="the orchestrator's ServiceAccount",
        )

    def start(self) -> None:
        for s in self._streams:
            run = kube_watch.run(
                self._client, s, backoff=self._backoff, watch_timeout_s=self._watch_timeout_s
            )
            self._tasks.append(tasks.spawn(run, name=f"kube:{s.describe()}"))

    async def synced(self) -> None:
        """Until every stream has had its first full list."""
        await asyncio.gather(*(s.synced.wait() for s in self._streams))

    async def close(self) -> None:
        await tasks.cancel_all(list(self._tasks))
        await self._client.close()

    def _emit(self, events: list[model.Event]) -> None:
        if events:
            self._on_events(events)
