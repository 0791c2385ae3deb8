"""A topology found outside the orchestrator (Kubernetes, Slurm), applied to the groups.

Both discovered modes keep the group manager in step the same way: the groups wanted now
are compared whole with the groups there are (level-triggered), a group with no member
left stops (its state stays persisted), one whose members changed restarts on them, and
a job whose processes the scheduler reports gone is evicted from every group, with an
event and a log line per group. This module is that one path; each mode only says what
the groups are and which jobs went.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Mapping
from typing import Any, Protocol

from tslice.orchestrator import config
from tslice.orchestrator.group import manager

log = logging.getLogger(__name__)

Groups = Mapping[str, tuple[config.NodeRef, ...]]


class Source(Protocol):
    """Where a discovered mode's topology comes from (``kube.discovery``, ``slurm.discovery``)."""

    async def start(
        self, stop: asyncio.Event | None = None
    ) -> dict[str, tuple[config.NodeRef, ...]] | None:
        """The groups there are now (None: ``stop`` was set first)."""

    def follow(self, groups: manager.GroupManager) -> None:
        """Keep ``groups`` in step from now on."""

    async def close(self) -> None: ...


async def apply_groups(groups: manager.GroupManager, wanted: Groups, *, gone_why: str) -> None:
    """Make the manager's groups those of ``wanted``; a group left out stops (``gone_why``
    says why, in its log line). Raises the first failure once every change was tried."""
    changes: list[Coroutine[Any, Any, None]] = [
        groups.remove_group(gid, gone_why) for gid in groups.ids() if gid not in wanted
    ]
    for gid, nodes in wanted.items():
        driver = groups.get(gid)
        if driver is None:
            changes.append(groups.add_group(gid, nodes))
        elif driver.nodes != nodes:
            changes.append(groups.replace_nodes(gid, nodes))
    # Each touches its own group: side by side, so that one group's shutdown grace does
    # not hold up another's (nor the evictions after them).
    outcomes = await asyncio.gather(*changes, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    if failed:
        raise failed[0]


async def jobs_in(groups: manager.GroupManager, gid: str) -> set[str]:
    """The holder and the waiters of group ``gid`` (none if it is not there)."""
    driver = groups.get(gid)
    if driver is None:
        return set()
    # From the lock, not from a status read: that lists only the first waiters.
    lk = driver.lock
    return {j for j in (lk.holder, *lk.queue) if j}


async def evict_gone(groups: manager.GroupManager, job: str, reason: str, *, by: str) -> None:
    """Take ``job``, whose processes are gone, out of every group (``by``: the mode)."""
    outcomes = await groups.evict(job, reason, by=by)
    for gid, out in outcomes:
        role = out.role.value if out.role is not None else "?"
        log.warning(
            "job %s evicted from group %s (it was %s): %s",
            job,
            gid,
            role,
            reason,
            extra={"group_id": gid, "job_id": job},
        )
