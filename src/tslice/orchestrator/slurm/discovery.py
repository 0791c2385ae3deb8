"""Slurm mode's topology and job liveness, kept applied to the group manager.

At start the controller is read until it answers (the orchestrator serves once the
groups are known). Afterwards it is read every ``poll_s``: the groups become those of
the nodes as they are now (``tslice.orchestrator.group.discovered``, as in Kubernetes mode: a
drained node leaves its groups, a resumed one comes back), and every Slurm job that
ended since the last read (``jobs.JobBook``; at the first read, those that ended while
no orchestrator watched; in a group that comes back, those that ended while it was away)
is evicted from every group: it loses its lock (the next
waiter is granted) or leaves the queue, and the group's event stream says so. A
controller that does not answer changes nothing: the groups stay as they were, and the
failure is logged once until it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tslice.common import errors, tasks
from tslice.orchestrator import config
from tslice.orchestrator.group import discovered, manager
from tslice.orchestrator.slurm import controller, jobs, model
from tslice.orchestrator.slurm import settings as slurm_settings

log = logging.getLogger(__name__)

BY = "Slurm mode"
GONE_WHY = "none of its nodes is usable (drained, down or not responding nodes do not count)"


class Discovery:
    def __init__(
        self, settings: slurm_settings.SlurmSettings, *, book: jobs.JobBook | None = None
    ) -> None:
        self._settings = settings
        self._book = book if book is not None else jobs.book()
        self._gone: list[jobs.Gone] = []
        self._left_out: dict[str, str] = {}
        self._failing = ""
        self._follower: asyncio.Task[None] | None = None

    async def start(
        self, stop: asyncio.Event | None = None
    ) -> dict[str, tuple[config.NodeRef, ...]] | None:
        """The groups there are now (read until the controller answers); None if ``stop``
        was set first."""
        missing = controller.missing_commands(self._settings)
        if missing:
            raise errors.ConfigError(
                f"Slurm mode runs {' and '.join(missing)}, not found on $PATH: install "
                "Slurm's client commands (Debian: slurm-client) and munge, or give their "
                "paths (slurm.scontrol, slurm.squeue in the config file)"
            )
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                groups = await self._read()
            except controller.ControllerError as err:
                self._failed(err)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._settings.poll_s)
                continue
            log.info(
                "Slurm topology: %d group(s)%s",
                len(groups),
                f"; {model.describe(groups)}" if groups else "",
            )
            return groups
        return None

    def follow(self, groups: manager.GroupManager) -> None:
        """Keep ``groups`` in step with the controller from now on."""
        self._follower = tasks.spawn(self._follow(groups), name="slurm:follow")

    async def close(self) -> None:
        if self._follower is not None:
            await tasks.cancel_all([self._follower])

    async def _read(self) -> dict[str, tuple[config.NodeRef, ...]]:
        """Read nodes and jobs; the groups wanted now (gone jobs are queued for eviction)."""
        nodes, rows = await asyncio.gather(
            controller.read_nodes(self._settings), controller.read_jobs(self._settings)
        )
        if self._failing:
            log.info("the Slurm controller answers again")
            self._failing = ""
        self._note_left_out(model.left_out(nodes, self._settings))
        self._gone.extend(self._book.update(rows))
        return model.groups(nodes, self._settings)

    def _note_left_out(self, left_out: dict[str, str]) -> None:
        for node, why in left_out.items():
            if self._left_out.get(node) != why:
                log.warning("Slurm node %s counts for no group: it %s", node, why)
        for node in sorted(set(self._left_out) - set(left_out)):
            log.info("Slurm node %s counts for its groups again", node)
        self._left_out = left_out

    def _failed(self, err: controller.ControllerError) -> None:
        if str(err) != self._failing:
            log.warning(
                "cannot read the Slurm controller (retrying every %g s): %s",
                self._settings.poll_s,
                err,
            )
            self._failing = str(err)

    async def _evict_ended(self, groups: manager.GroupManager, gid: str) -> None:
        """A group that is back (its node resumed) resumes its persisted queue: a job
        that ended while the group was away is evicted now, not kept as a ghost holder."""
        for job in sorted(await discovered.jobs_in(groups, gid)):
            reason = self._book.gone_reason(job)
            if reason is not None:
                await discovered.evict_gone(groups, job, reason, by=BY)

    async def _follow(self, groups: manager.GroupManager) -> None:
        wanted: dict[str, tuple[config.NodeRef, ...]] | None = None  # start()'s are applied
        while True:
            try:
                if wanted is not None:
                    before = set(groups.ids())
                    await discovered.apply_groups(groups, wanted, gone_why=GONE_WHY)
                    for gid in sorted(set(groups.ids()) - before):
                        await self._evict_ended(groups, gid)
                while self._gone:
                    gone = self._gone[0]
                    await discovered.evict_gone(groups, gone.job, gone.reason, by=BY)
                    self._gone.pop(0)
            except Exception:
                # What is left (the topology is compared whole, the jobs stay queued) is
                # tried again after the next read.
                log.exception(
                    "applying a Slurm change failed; retrying in %g s", self._settings.poll_s
                )
            await asyncio.sleep(self._settings.poll_s)
            try:
                wanted = await self._read()
            except controller.ControllerError as err:
                self._failed(err)
                wanted = None
