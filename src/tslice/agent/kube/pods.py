"""The stream of this node's job pods (``spec.nodeName=<node>``, ``timeslice.io/job-id``
present, every namespace), kept in a :class:`node_pods.NodePods` (tslice.server.kube_watch:
list, watch, bookmarks, backoff, re-list on 410 Gone)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from lightkube.resources.core_v1 import Pod

from tslice.agent.kube import node_pods
from tslice.common import errors, tasks
from tslice.server import kube_labels, kube_watch

log = logging.getLogger(__name__)


def pod_info(pod: Pod) -> node_pods.PodInfo:
    meta, spec, status = pod.metadata, pod.spec, pod.status
    labels = meta.labels if meta is not None else None
    return node_pods.PodInfo(
        uid=(meta.uid if meta is not None else None) or "",
        key=f"{(meta.namespace if meta else None) or ''}/{(meta.name if meta else None) or ''}",
        job=kube_labels.job_of_pod(labels) or "",
        group=kube_labels.group_of_pod(labels),
        containers=tuple(c.name for c in (spec.containers if spec is not None else [])),
        phase=(status.phase if status is not None else None) or "",
    )


class PodWatcher:
    """Keeps :attr:`pods` in step with the job pods of ``node`` on the API server."""

    def __init__(
        self,
        node: str,
        *,
        kubeconfig: Path | None = None,
        backoff: kube_watch.Backoff | None = None,
        watch_timeout_s: int = kube_watch.WATCH_TIMEOUT_S,
    ) -> None:
        self.node = node
        self.pods = node_pods.NodePods()
        try:
            self._client = kube_watch.connect(kubeconfig)
        except Exception as err:  # lightkube's ConfigError, a missing or unreadable file
            where = kubeconfig or "in-cluster config, $KUBECONFIG, ~/.kube/config"
            raise errors.ConfigError(
                f"cannot load Kubernetes credentials ({where}): {err}; give --kubeconfig FILE "
                "or run in a pod with a ServiceAccount"
            ) from err
        self.stream = kube_watch.Stream(
            Pod,
            on_list=lambda objs: self.pods.replace(pod_info(o) for o in objs),
            on_event=self._changed,
            namespace=kube_watch.ALL_NAMESPACES,
            labels=kube_labels.JOB_ID_LABEL,
            fields=f"spec.nodeName={node}",
            who="the agent's ServiceAccount (get, list, watch on pods)",
        )
        self._backoff, self._watch_timeout_s = backoff, watch_timeout_s
        self._task: asyncio.Task[None] | None = None

    def _changed(self, type_: str, obj: Any) -> None:
        pod = pod_info(obj)
        self.pods.apply(pod, deleted=type_ == "DELETED")
        log.info("pod %s of job %s on this node: %s", pod.key, pod.job, type_.lower())

    def start(self) -> None:
        run = kube_watch.run(
            self._client,
            self.stream,
            backoff=self._backoff,
            watch_timeout_s=self._watch_timeout_s,
        )
        self._task = tasks.spawn(run, name="kube:pods")

    async def synced(self) -> None:
        await self.stream.synced.wait()

    async def close(self) -> None:
        if self._task is not None:
            await tasks.cancel_all([self._task])
        await self._client.close()
