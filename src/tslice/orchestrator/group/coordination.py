"""A group among the others: the device claim it shares with overlapping groups, and the
sets of groups acquired all-or-nothing (AcquireSet).

The lock decides when it needs the claim (``effects.NeedClaim``) or is ready for a set
member (``effects.NeedSet``); the group's executor asks :class:`Coordination` in the
same command (the answer may decide more). The arbiter (``group.overlap``) and the set
coordinator (``sets.coordinator``) tell the group what concerns it through this
object's :class:`~tslice.orchestrator.group.overlap.Member` and
:class:`~tslice.orchestrator.sets.coordinator.Member` methods, which post commands to the
group's executor: every change of a group still happens in its own batch.
"""

from __future__ import annotations

import logging
from typing import Any

from tslice.orchestrator.group import effects as fx
from tslice.orchestrator.group import executor, lock, services
from tslice.orchestrator.switch import plan

log = logging.getLogger(__name__)


class Coordination:
    """One group's side of the device claim and of the sets."""

    def __init__(
        self,
        group_id: str,
        lk: lock.GroupLock,
        shared: services.Services,
        views: dict[str, plan.NodeView],
    ) -> None:
        self._gid = group_id
        self._lock = lk
        self._services = shared
        #: The switch's cache of the nodes: dropped when another group may move what is
        #: on the shared devices.
        self._views = views
        #: The group's executor (set once it is made).
        self.executor: executor.Executor | None = None
        #: The holder the arbiter was last told of ("" = not told yet).
        self._noted_holder: str | None = ""
        #: Whether another group shares the devices (else the group holds them for
        #: anybody: it never asks for the claim, nor tells the arbiter its holder).
        self.shared = False

    def _post(self, command: Any, *args: Any) -> None:
        if self.executor is not None:
            self.executor.post(command, *args)

    # ---- asked by the executor, in the command ------------------------------------------

    def claim(self, need: fx.NeedClaim, now: float) -> list[fx.Action]:
        """Ask for the device claim (see overlap); wait for it if it is not free."""
        arbiter = self._services.arbiter
        granted = arbiter.request(self._gid, need.job, need.others)
        if granted is None:
            self._views.clear()
            self._lock.on_claim_waiting()
            return []
        shared = bool(arbiter.conflicts(self._gid))
        return self._lock.on_claim_granted(granted, now=now, shared=shared)

    def release_claim(self) -> None:
        # Another group may now move what is on the shared devices: re-read first.
        self._views.clear()
        self._services.arbiter.release(self._gid)

    def ready_for_set(self, need: fx.NeedSet, now: float) -> list[fx.Action]:
        """The group is kept for a set member: report it ready (the set's grant comes as
        a command, :meth:`set_ready`, for every group alike), unless a waiter that holds
        another group is behind it: that one goes first, since it would otherwise wait
        for the set, which may wait for what it holds (see coordinator.passer)."""
        sets = self._services.sets
        passing = None
        if need.others:  # (the holders are read only when someone could pass)
            holders = {gid: lk.holder for gid, lk in self._services.locks.items()}
            passing = sets.passer(self._gid, need.set_seq, need.others, holders)
        if passing is None:
            sets.ready(self._gid, need.job, need.set_seq)
            return []
        sets.withdraw(self._gid)
        log.info(
            "group %s: job %s, which holds another group, goes before job %s's set",
            self._gid,
            passing,
            need.job,
            extra={"group_id": self._gid, "job_id": passing},
        )
        return self._lock.on_set_passed(passing, now=now)

    def not_ready_for_set(self) -> None:
        self._services.sets.withdraw(self._gid)

    def applied(self) -> None:
        """After a batch's commands: overlapping groups see who holds this one at once."""
        holder = self._lock.holder
        if holder != self._noted_holder:
            self._noted_holder = holder
            self._services.arbiter.note_holder(self._gid, holder)

    # ---- what the arbiter and the set coordinator tell the group ------------------------

    def holder(self) -> str | None:
        return self._lock.holder

    def devices_shared(self) -> tuple[bool, str | None]:
        # At once, not as a command: from now on the group must ask before it grants, and
        # the change decides nothing else (see lock.on_devices_shared).
        self.shared = True
        return self._lock.on_devices_shared()

    def claim_granted(self, job: str) -> None:
        self._post(self._on_claim_granted, job)

    def _on_claim_granted(self, now: float, job: str) -> list[fx.Action]:
        # Posted when the arbiter granted it. The group may have asked again since, for
        # another job, and be waiting or holding for that one now: then this grant is
        # stale, and the arbiter's later answer is the one that counts.
        if not self._services.arbiter.holds(self._gid, job):
            return []
        return self._lock.on_claim_granted(job, now=now)

    def claim_contended(self) -> None:
        self._post(self._on_contended)

    def _on_contended(self, now: float) -> list[fx.Action]:
        return self._lock.on_contended(now=now)

    def set_ready(self, job: str, seq: int) -> None:
        self._post(self._on_set_ready, job, seq)

    def _on_set_ready(self, now: float, job: str, seq: int) -> list[fx.Action]:
        return self._lock.on_set_ready(job, set_seq=seq, now=now)
