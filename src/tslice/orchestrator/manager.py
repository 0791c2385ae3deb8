"""The set of groups: static from the topology, or created on first Acquire in local mode."""

from __future__ import annotations

import asyncio
import logging

from tslice.orchestrator import config, group, records

log = logging.getLogger(__name__)


class GroupManager:
    def __init__(self, services: group.Services) -> None:
        self._services = services
        self._cfg = services.cfg
        self._groups: dict[str, group.GroupDriver] = {}

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
            return
        # Local mode with --group: the named groups, each spanning every local agent.
        configured = topo.groups or {gid: topo.local_nodes for gid in topo.local_groups}
        for gid, nodes in configured.items():
            entry = persisted.get(gid)
            self._add(gid, nodes, entry[1] if entry else None)
        for gid in sorted(set(persisted) - set(configured)):
            log.warning("group %s has persisted state but is not configured; ignoring it", gid)

    def _add(
        self, gid: str, nodes: tuple[config.NodeRef, ...], record: records.LockRecord | None
    ) -> group.GroupDriver:
        driver = group.GroupDriver(
            group_id=gid, nodes=nodes, services=self._services, record=record
        )
        self._groups[gid] = driver
        driver.start()
        return driver

    def get(self, gid: str, *, create: bool = False) -> group.GroupDriver | None:
        driver = self._groups.get(gid)
        if driver is None and create and self.local:
            log.info(
                "group %s created by its first Acquire (local mode)", gid, extra={"group_id": gid}
            )
            driver = self._add(gid, self._cfg.topology.local_nodes, None)
        return driver

    def ids(self) -> list[str]:
        return sorted(self._groups)

    def not_found_message(self, gid: str) -> str:
        if self.local:
            return f"group {gid!r} does not exist yet; it is created by its first Acquire"
        known = ", ".join(self.ids()) or "none"
        if self._cfg.topology.local_groups:
            return f"group {gid!r} is not one of the groups given with --group ({known})"
        return f"group {gid!r} is not in the topology (known groups: {known})"

    async def stop(self, *, grace_s: float) -> None:
        await asyncio.gather(*(d.stop(grace_s=grace_s) for d in self._groups.values()))
