"""The set of groups: static from the topology, or created on first Acquire in local mode.

In local mode without ``--group`` anyone can name a new group, so their number is
bounded (``max_local_groups``) and idle ones are collected: a group with no holder, no
waiter, no switch and no open Hold stream for ``idle_group_ttl_s``, whose state is
resident on no node (the agents are asked: a yielded resident still on the devices
keeps its group), is forgotten, rows, metrics series and all. Its jobs' saved states
stay on the agents, so a later Acquire of the same id restores them. Sweeps run
periodically and whenever a new group would pass the bound. Declared groups (a
topology, or ``--group``) are never collected.

In Kubernetes mode the groups of the first full list are the topology at start; later
the discovery (``tslice.orchestrator.kube``) adds a group that appears
(:meth:`add_group`), takes away one whose nodes are all gone (:meth:`remove_group`: its
state stays persisted, so it resumes if its nodes come back), restarts one whose
nodes changed on the new ones (:meth:`replace_nodes`: as after a crash of the
orchestrator, for that group alone) and evicts a job whose pods are all gone from
every group (:meth:`evict`). What comes for a group while it is stopped (a Yield of its
holder, the eviction of a job it names) is kept and applied when it is back
(``tslice.orchestrator.group.held_over``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import tasks
from tslice.orchestrator import config
from tslice.orchestrator.group import admin, held_over
from tslice.orchestrator.group import driver as group
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.persistence import records
from tslice.rpc import refusals
from tslice.server import kube_labels

log = logging.getLogger(__name__)

#: Job states that hold a node's devices (or may: FAULTED) and keep a group alive.
_HOLDING = frozenset({pb.JOB_STATE_RUNNING, pb.JOB_STATE_TRANSITIONING, pb.JOB_STATE_FAULTED})
#: Longest pause between two periodic sweeps, seconds.
_MAX_SWEEP_INTERVAL_S = 60.0


class GroupManager:
    def __init__(self, services: group.Services) -> None:
        self._services = services
        self._cfg = services.cfg
        self._groups: dict[str, group.GroupDriver] = {}
        #: The groups running, by id (read-only: what each call of the servicer looks up).
        self.by_id: Mapping[str, group.GroupDriver] = self._groups
        #: One creation (with its sweep) at a time.
        self._creating = asyncio.Lock()
        self._collector: asyncio.Task[None] | None = None
        #: Groups removed (their nodes all gone) whose state stays persisted, and what
        #: came for them meanwhile.
        self._stopped: set[str] = set()
        self._held_over = held_over.HeldOver()

    @property
    def local(self) -> bool:
        """Whether a group is created by its first Acquire (local mode without ``--group``)."""
        topo = self._cfg.topology
        return topo.local and not topo.local_groups

    async def start(self) -> None:
        """Create every configured group, resuming persisted state (recovery starts here)."""
        persisted = await self._services.db.load()
        topo = self._cfg.topology
        if self.local:
            for gid, (_, record) in persisted.items():
                self._add(gid, topo.local_nodes, record)
            self._collector = tasks.spawn(self._collect_periodically(), name="groups:collector")
            return
        # Local mode with --group: the named groups, each spanning every local agent.
        configured = topo.groups or {gid: topo.local_nodes for gid in topo.local_groups}
        for gid, nodes in configured.items():
            entry = persisted.get(gid)
            self._add(gid, nodes, entry[1] if entry else self._services.db.unrecorded(gid))
        for gid in sorted(set(persisted) - set(configured)):
            log.warning("group %s has persisted state but is not configured; ignoring it", gid)

    def _add(
        self, gid: str, nodes: tuple[config.NodeRef, ...], record: records.LockRecord | None
    ) -> group.GroupDriver:
        driver = group.GroupDriver(
            group_id=gid, nodes=nodes, services=self._services, record=record
        )
        self._groups[gid] = driver
        self._stopped.discard(gid)
        driver.start()
        return driver

    def get(self, gid: str) -> group.GroupDriver | None:
        return self._groups.get(gid)

    # ---- discovered topology (Kubernetes mode) ------------------------------------------

    async def add_group(self, gid: str, nodes: tuple[config.NodeRef, ...]) -> None:
        """A group that appeared (its nodes were labelled); it resumes its persisted state."""
        if gid in self._groups:
            await self.replace_nodes(gid, nodes)
            return
        entry = (await self._services.db.load()).get(gid)
        driver = self._add(gid, nodes, entry[1] if entry else self._services.db.unrecorded(gid))
        log.info(
            "group %s appeared with %d node(s): %s",
            gid,
            len(nodes),
            ", ".join(n.name for n in nodes),
            extra={"group_id": gid},
        )
        await self._apply_held_over(driver)

    async def _apply_held_over(self, driver: group.GroupDriver) -> None:
        """What came while the group was stopped, before it grants anything (it is still
        reading its agents)."""
        for kept in self._held_over.take(driver.group_id):
            log.warning(
                "group %s is back: applying the %s of job %s that came while it was stopped",
                driver.group_id,
                "yield" if isinstance(kept, held_over.Yield) else "eviction",
                kept.job,
                extra={"group_id": driver.group_id, "job_id": kept.job},
            )
            if isinstance(kept, held_over.Yield):
                await driver.yield_(kept.job)
            else:
                await driver.evict(kept.job, kept.reason, by=kept.by)

    async def remove_group(self, gid: str, why: str) -> None:
        """A group whose nodes are all gone: it stops (its waiters are told to retry, an
        in-flight switch has ``shutdown_grace_s`` to finish); its rows stay."""
        driver = self._groups.pop(gid, None)
        if driver is None:
            return
        log.warning("group %s is gone (%s); it stops", gid, why, extra={"group_id": gid})
        self._stopped.add(gid)
        await driver.stop(grace_s=self._cfg.shutdown_grace_s)
        # Its state left on nodes of other groups gives way to them, unless it is held.
        self._services.arbiter.stopped(gid, driver.lock.holder)
        self._services.metrics.forget_group(gid)

    async def replace_nodes(self, gid: str, nodes: tuple[config.NodeRef, ...]) -> None:
        """The group's nodes changed: it stops (an in-flight switch has the shutdown grace
        to finish) and starts again on ``nodes`` from its persisted state, recovering as
        after a restart (the agents are read; a switch intent is rolled forward or back)."""
        driver = self._groups.get(gid)
        if driver is None:
            await self.add_group(gid, nodes)
            return
        if driver.nodes == nodes:
            return
        log.warning(
            "group %s: nodes changed (%s -> %s); the group restarts on its new nodes",
            gid,
            ", ".join(f"{n.name}@{n.address}" for n in driver.nodes) or "none",
            ", ".join(f"{n.name}@{n.address}" for n in nodes),
            extra={"group_id": gid},
        )
        # Listed while it stops: calls meanwhile are told UNAVAILABLE (retry), not NOT_FOUND.
        # It keeps its device claim meanwhile (a waiter of a group sharing its devices
        # must not be granted while its holder uses them); which groups it shares devices
        # with is worked out again from its new nodes when it joins.
        await driver.stop(grace_s=self._cfg.shutdown_grace_s, restarting=True)
        entry = (await self._services.db.load()).get(gid)
        restarted = self._add(gid, nodes, entry[1] if entry else self._services.db.unrecorded(gid))
        await self._apply_held_over(restarted)

    async def evict(
        self, job: str, reason: str = "", *, by: str = admin.BY_ADMIN
    ) -> list[tuple[str, decisions.EvictOutcome]]:
        """Take ``job`` out of every group where it holds or waits (``by``: who does); a
        stopped group is told when it is back."""
        outcomes = await group.evict_everywhere(list(self._groups.values()), job, reason, by=by)
        for gid in await self._stopped_naming(job, held_over.names):
            log.warning(
                "group %s is stopped: the eviction of job %s is applied when it is back (%s)",
                gid,
                job,
                reason,
                extra={"group_id": gid, "job_id": job},
            )
            self._held_over.keep(gid, held_over.Eviction(job, reason, by))
        return outcomes

    def revoke_evictions(self, live: Collection[str]) -> None:
        """Jobs ``live`` again (a pod of theirs came back) keep their place in the stopped
        groups."""
        self._held_over.revoke(live)

    async def keep_yield(self, gid: str, job: str) -> decisions.YieldOutcome | None:
        """A Yield for a group that is not running: kept if the group is stopped and
        ``job`` holds it (applied when it is back); None otherwise (no such group)."""
        if gid in self._groups or gid not in await self._stopped_naming(job, held_over.holds):
            return None
        log.warning(
            "group %s is stopped: the yield of job %s is applied when it is back",
            gid,
            job,
            extra={"group_id": gid, "job_id": job},
        )
        self._held_over.keep(gid, held_over.Yield(job))
        return decisions.YieldOutcome(True, None, 0, False, [])

    async def _stopped_naming(
        self, job: str, test: Callable[[records.LockRecord, str], bool]
    ) -> list[str]:
        """The stopped groups whose persisted record ``test`` says names ``job``, and the
        groups restarting on new nodes (skipped by an eviction) whose lock does."""
        found = [
            gid for gid, d in self._groups.items() if d.stopping and test(d.lock.record(), job)
        ]
        if self._stopped - set(self._groups):
            persisted = await self._services.db.load()
            found += [
                gid
                for gid in self._stopped - set(self._groups)
                if gid in persisted and test(persisted[gid][1], job)
            ]
        return sorted(found)

    async def get_or_create(self, gid: str) -> group.GroupDriver | None:
        """The group, created first in local mode (``None``: no such group); raises
        ``refusals.Refused`` (RESOURCE_EXHAUSTED) when local mode is full."""
        driver = self._groups.get(gid)
        if driver is not None or not self.local:
            return driver
        async with self._creating:
            driver = self._groups.get(gid)
            if driver is not None:
                return driver
            limit = self._cfg.max_local_groups
            if len(self._groups) >= limit:
                await self.collect()
            if len(self._groups) >= limit:
                raise refusals.Refused(
                    refusals.Code.RESOURCE_EXHAUSTED,
                    f"local mode serves at most {limit} groups at once (max_local_groups) "
                    f"and none of them is idle with nothing resident; cannot create group "
                    f"{gid!r}: yield or finish the jobs of other groups, raise "
                    "max_local_groups, or declare the groups with --group",
                )
            log.info(
                "group %s created by its first Acquire (local mode)", gid, extra={"group_id": gid}
            )
            return self._add(gid, self._cfg.topology.local_nodes, None)

    async def collect(self) -> list[str]:
        """Forget the groups idle for ``idle_group_ttl_s`` with nothing resident on any node;
        their ids. Nothing is collected while a node does not answer."""
        now = time.monotonic()
        ttl = self._cfg.idle_group_ttl_s
        candidates: list[tuple[group.GroupDriver, int]] = []
        for driver in self._groups.values():
            idle = driver.idle_since()
            if idle is not None and now - idle[1] >= ttl:
                candidates.append((driver, idle[0]))
        if not candidates:
            return []
        holding = await self._groups_holding_devices()
        if holding is None:
            return []
        collected: list[group.GroupDriver] = []
        for driver, activity in candidates:
            if driver.group_id in holding or self._groups.get(driver.group_id) is not driver:
                continue
            if await driver.retire(activity):
                del self._groups[driver.group_id]
                collected.append(driver)
        for driver in collected:
            await driver.stop(grace_s=0.0)
            self._services.arbiter.forget(driver.group_id)
            self._services.metrics.forget_group(driver.group_id)
        if collected:
            gone = sorted(d.group_id for d in collected)
            log.info(
                "collected %d idle group(s) (local mode): %s; %d left",
                len(gone),
                ", ".join(gone),
                len(self._groups),
            )
        return sorted(d.group_id for d in collected)

    async def _groups_holding_devices(self) -> set[str] | None:
        """The groups with a job state on some node's devices; ``None`` if a node did not
        answer (then nobody knows, and nothing may go)."""
        nodes = self._cfg.topology.local_nodes
        timeout_s = min(1.0, self._cfg.status_timeout_s)
        pool = self._services.pool
        replies = await asyncio.gather(
            *(pool.get(n.address).status(timeout_s=timeout_s) for n in nodes),
            return_exceptions=True,
        )
        holding: set[str] = set()
        for reply in replies:
            if isinstance(reply, BaseException):
                return None
            holding.update(js.group for js in reply.job_statuses if js.state in _HOLDING)
        return holding

    async def _collect_periodically(self) -> None:
        interval = min(max(self._cfg.idle_group_ttl_s, 1.0), _MAX_SWEEP_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.collect()
            except Exception:
                log.exception("collecting idle groups failed; retrying at the next sweep")

    def ids(self) -> list[str]:
        return sorted(self._groups)

    def not_found_message(self, gid: str) -> str:
        if self.local:
            return f"group {gid!r} does not exist yet; it is created by its first Acquire"
        known = ", ".join(self.ids()) or "none"
        if self._cfg.kubernetes is not None:
            return (
                f"group {gid!r} has no nodes (known groups: {known}); label its nodes "
                f"{kube_labels.group_node_label(gid)}=true (Ready, not cordoned, with an "
                "agent pod on each)"
            )
        if self._cfg.slurm is not None:
            return (
                f"group {gid!r} has no usable Slurm node (known groups: {known}); a group "
                "is a GPU node (named after it) or one of the config's slurm.groups, with "
                "at least one node that is not drained, down or unresponsive (sinfo -R "
                "lists why; scontrol update nodename=NODE state=resume brings one back)"
            )
        if self._cfg.topology.local_groups:
            return f"group {gid!r} is not one of the groups given with --group ({known})"
        return f"group {gid!r} is not in the topology (known groups: {known})"

    async def stop(self, *, grace_s: float) -> None:
        if self._collector is not None:
            await tasks.cancel_all([self._collector])
        await asyncio.gather(*(d.stop(grace_s=grace_s) for d in self._groups.values()))
