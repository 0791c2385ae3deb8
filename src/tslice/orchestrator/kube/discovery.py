"""Kubernetes mode's topology: the watcher's model, kept applied to the group manager.

At start the groups are those of the first full list of every stream (the orchestrator
serves once they are known). Afterwards every batch of changes wakes one follower task,
which makes the manager's groups those of the model (level-triggered: it compares the
whole topology, so a burst of events is one pass; and only after the topology changed,
so that a job pod's event costs what it touches) and evicts, from every group, each
job whose pods all went (Succeeded, Failed or deleted) and have not come back: it loses
its lock (the next waiter is granted) or leaves the queue, and the group's event stream
says so. A job never seen with a live pod is left alone (a client outside the cluster).
The same holds for what changed while no orchestrator watched (a restart, a failover):
a job whose pods are all listed as Succeeded or Failed at start is evicted once the
groups have their state back; one whose pods were *deleted* meanwhile cannot be told
from a client outside the cluster and keeps its place until its holder lease lapses.
"""

from __future__ import annotations

import asyncio
import logging

from tslice.common import errors, tasks
from tslice.orchestrator import config
from tslice.orchestrator.group import discovered, manager
from tslice.orchestrator.kube import model, watch

log = logging.getLogger(__name__)

#: Pause before a change that failed to apply is tried again, seconds.
_RETRY_S = 1.0


class Discovery:
    def __init__(self, settings: config.KubeSettings) -> None:
        self._settings = settings
        self._changed = asyncio.Event()
        self._gone_jobs: list[str] = []
        #: A group appeared, changed or went since the last pass (a pod's event alone
        #: does not make the pass compare the whole topology).
        self._topology_changed = True
        self._watcher: watch.Watcher | None = None
        self._follower: asyncio.Task[None] | None = None

    async def start(
        self, stop: asyncio.Event | None = None
    ) -> dict[str, tuple[config.NodeRef, ...]] | None:
        """Connect, list everything once, start watching; the groups there are now.
        ``None`` if ``stop`` was set first (an API server that does not answer must not
        keep a SIGTERM waiting)."""
        try:
            client = watch.connect(self._settings)
        except Exception as err:  # lightkube's ConfigError, a missing or unreadable file
            where = self._settings.kubeconfig or "in-cluster config, $KUBECONFIG, ~/.kube/config"
            raise errors.ConfigError(
                f"cannot load Kubernetes credentials ({where}): {err}; give --kubeconfig FILE "
                "or run in a pod with a ServiceAccount"
            ) from err
        self._watcher = watch.Watcher(client, self._settings, on_events=self._on_events)
        self._watcher.start()
        synced = asyncio.ensure_future(self._watcher.synced())
        stopped = asyncio.ensure_future(stop.wait() if stop is not None else asyncio.Event().wait())
        try:
            await asyncio.wait({synced, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiting in (synced, stopped):
                waiting.cancel()
        if not synced.done() or synced.cancelled():
            return None
        found = self._watcher.model
        for name, why in sorted(found.pending_nodes().items()):
            log.warning("node %s is labelled for a group but %s", name, why)
        groups = found.groups()
        log.info(
            "Kubernetes topology: %d group(s)%s",
            len(groups),
            "".join(f"; {model.describe(model.GroupAppeared(g, ns))}" for g, ns in groups.items()),
        )
        self._gone_jobs.clear()
        return groups

    def follow(self, groups: manager.GroupManager) -> None:
        """Keep ``groups`` in step with the cluster from now on."""
        assert self._watcher is not None
        # Jobs that finished while no orchestrator watched are gone as well.
        self._gone_jobs.extend(sorted(self._watcher.model.finished_jobs()))
        self._follower = tasks.spawn(self._follow(groups), name="kube:follow")
        self._changed.set()  # what changed between the first list and now

    async def close(self) -> None:
        if self._follower is not None:
            await tasks.cancel_all([self._follower])
        if self._watcher is not None:
            await self._watcher.close()

    def _on_events(self, events: list[model.Event]) -> None:
        for event in events:
            if self._follower is not None:  # the first lists' are summed up by start()
                log.info("Kubernetes: %s", model.describe(event))
            if isinstance(event, model.JobGone):
                self._gone_jobs.append(event.job)
            else:
                self._topology_changed = True
        self._changed.set()

    async def _follow(self, groups: manager.GroupManager) -> None:
        assert self._watcher is not None
        cluster = self._watcher.model
        while True:
            await self._changed.wait()
            self._changed.clear()
            try:
                groups.revoke_evictions(cluster.live_jobs())
                if self._topology_changed:
                    self._topology_changed = False
                    await discovered.apply_groups(
                        groups,
                        cluster.groups(),
                        gone_why="no Ready, schedulable node is labelled for it",
                    )
                while self._gone_jobs:
                    job = self._gone_jobs[0]
                    if job not in cluster.live_jobs():  # its pods may be back meanwhile
                        reason = f"every pod of job {job} is gone (Succeeded, Failed or deleted)"
                        await discovered.evict_gone(groups, job, reason, by="Kubernetes mode")
                    self._gone_jobs.pop(0)
            except Exception:
                # What is left (the topology is compared whole, the jobs stay listed) is
                # tried again shortly.
                log.exception("applying a Kubernetes change failed; retrying in %g s", _RETRY_S)
                await asyncio.sleep(_RETRY_S)
                self._topology_changed = True
                self._changed.set()
