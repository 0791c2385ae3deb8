"""List-then-watch of the API server (lightkube), feeding a :class:`model.ClusterModel`.

Three streams, each a list followed by a watch from the list's resourceVersion:

- nodes (all of them: a group label can be added to any node);
- job pods (``timeslice.io/job-id`` present), in ``--job-namespace`` or all namespaces;
- agent pods (``--agent-selector`` in ``--agent-namespace``).

Every event's object carries the version the stream has reached, and so do BOOKMARK
events (asked for with ``allowWatchBookmarks``: they move the version on while nothing
selected changes, so a resume seldom finds it compacted). A watch the server ends is
resumed from the version reached (lightkube does that); a dropped connection or any
other error is retried from it after a jittered, growing pause (``switch.Backoff``);
``410 Gone`` (the version was compacted) starts the stream again with a fresh list,
which replaces that kind's objects in the model, so deletions missed meanwhile are seen.

lightkube's public ``watch()`` does not ask for bookmarks, so the requests are built with
its request preparation (``GenericAsyncClient``); that is the only non-public use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.config import kubeconfig
from lightkube.resources.core_v1 import Node, Pod

from tslice.common import kube_labels, tasks
from tslice.orchestrator import config, switch
from tslice.orchestrator.kube import model

log = logging.getLogger(__name__)

ALL_NAMESPACES = "*"
#: The server ends each watch after this long (lightkube resumes it at once), seconds.
WATCH_TIMEOUT_S = 300
#: Objects per page of a list.
LIST_PAGE = 500
_HTTP_GONE = 410
_LIVE_PHASES = frozenset({"Pending", "Running"})

OnEvents = Callable[[list[model.Event]], None]
#: ``(kind, resourceVersion)`` each time a stream's version moves (bookmarks included).
OnProgress = Callable[[model.Kind, str], None]


def connect(settings: config.KubeSettings) -> AsyncClient:
    """A client: ``--kubeconfig`` if given, else in-cluster, then $KUBECONFIG / ~/.kube/config."""
    if settings.kubeconfig is not None:
        cfg = KubeConfig.from_file(settings.kubeconfig)
    else:
        cfg = KubeConfig.from_env(default_config=kubeconfig.DEFAULT_KUBECONFIG)
    return AsyncClient(config=cfg)


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


class _Stream:
    def __init__(
        self,
        kind: model.Kind,
        resource: type[Any],
        convert: Callable[[Any], model.Item],
        *,
        namespace: str | None = None,
        labels: str | None = None,
    ) -> None:
        self.kind, self.resource, self.convert = kind, resource, convert
        self.namespace, self.labels = namespace, labels
        self.synced = asyncio.Event()

    def describe(self) -> str:
        where = "all namespaces" if self.namespace == ALL_NAMESPACES else self.namespace
        what = f"{self.resource.__name__.lower()}s" + (f" ({self.labels})" if self.labels else "")
        return what + (f" in {where}" if where else "")


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
            _Stream("node", Node, node_info),
            _Stream(
                "job",
                Pod,
                job_pod,
                namespace=settings.job_namespace or ALL_NAMESPACES,
                labels=kube_labels.JOB_ID_LABEL,
            ),
            _Stream(
                "agent",
                Pod,
                agent_pod,
                namespace=settings.agent_namespace,
                labels=settings.agent_selector,
            ),
        ]
        self._tasks: list[asyncio.Task[None]] = []
        #: Times a stream started again from a list after its version was gone (for tests).
        self.relists = 0

    def start(self) -> None:
        for s in self._streams:
            self._tasks.append(tasks.spawn(self._run(s), name=f"kube:{s.kind}"))

    async def synced(self) -> None:
        """Until every stream has had its first full list."""
        await asyncio.gather(*(s.synced.wait() for s in self._streams))

    async def close(self) -> None:
        await tasks.cancel_all(list(self._tasks))
        await self._client.close()

    async def _run(self, stream: _Stream) -> None:
        version: str | None = None
        failures = 0
        while True:
            try:
                if version is None:
                    version = await self._list(stream)
                    failures = 0
                # Closed on the way out, whatever ends the loop: the response goes with it.
                async with contextlib.aclosing(self._watch(stream, version)) as events:
                    async for kind, obj in events:
                        failures = 0
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            item = stream.convert(obj)
                            deleted = kind == "DELETED"
                            self._emit(self.model.apply(stream.kind, item, deleted=deleted))
                        version = (obj.metadata and obj.metadata.resourceVersion) or version
                        if self._on_progress is not None:
                            self._on_progress(stream.kind, version)
            except ApiError as err:
                if err.status.code == _HTTP_GONE:
                    log.info(
                        "watch of %s: version %s is gone; listing again", stream.describe(), version
                    )
                    version = None
                    self.relists += 1
                    continue
                failures += 1
                await self._pause(stream, failures, f"{err.status.code} {err.status.message}")
            except Exception as err:  # refused, dropped, undecodable: all retried alike
                failures += 1
                await self._pause(stream, failures, f"{type(err).__name__}: {err}")

    async def _pause(self, stream: _Stream, failures: int, why: str) -> None:
        delay = self._backoff.delay(min(failures - 1, 16))
        log.warning(
            "watch of %s failed (%s); retrying in %.1f s (check the API server address, "
            "the credentials and the RBAC of the orchestrator's ServiceAccount)",
            stream.describe(),
            why,
            delay,
        )
        await asyncio.sleep(delay)

    async def _list(self, stream: _Stream) -> str:
        generic = self._client._client
        br = generic.prepare_request(
            "list",
            res=stream.resource,
            namespace=stream.namespace,
            # Pages of a consistent snapshot (lightkube follows the continue tokens).
            params={"labelSelector": stream.labels, "limit": LIST_PAGE},
        )
        listing = generic.list(br)
        items = [stream.convert(obj) async for obj in listing]
        self._emit(self.model.replace(stream.kind, items))
        if not stream.synced.is_set():
            log.info("listed %d %s", len(items), stream.describe())
            stream.synced.set()
        return str(listing.resourceVersion)

    def _watch(self, stream: _Stream, version: str) -> AsyncGenerator[tuple[str, Any], None]:
        generic = self._client._client
        br = generic.prepare_request(
            "list",
            res=stream.resource,
            namespace=stream.namespace,
            watch=True,
            params={
                "labelSelector": stream.labels,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": self._watch_timeout_s,
            },
        )
        events: AsyncGenerator[tuple[str, Any], None] = generic.watch(br)
        return events

    def _emit(self, events: list[model.Event]) -> None:
        if events:
            self._on_events(events)
