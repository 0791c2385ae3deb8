"""All-or-nothing acquires of several groups (``AcquireSet``): the coordinator.

A set is numbered when it arrives (one counter for the whole orchestrator, so two sets
order the same way in every group they share) and its job joins the queue of each of
its groups as a member of it. A group that would promote the member reserves itself
and reports ready (``decisions.NeedSet``, see ``tslice.orchestrator.sets.gate``); when
every group of the set is ready, :class:`SetCoordinator` tells each one to grant, and
their switches run at once, each in its own group. Nobody holds part of a set while
waiting for the rest: the set's grant is one decision.

A part may reach its group late (its driver first reads a node it never read), so a
group may be free and kept for a set while an older set that names it is still on its
way there. The coordinator does not count such a group ready (the older set, once
there, takes the reservation over: see ``set_gate``). Ready is counted for one set
per group: a group that reports for another set is no longer counted for the one it
reported before.

A job that holds a group and waits for another (a nested acquire) is let past a group
kept for a set that is not granted yet (:meth:`SetCoordinator.passer`): kept out, it
could wait for the set while the set waits for what it holds.

A set that ends without its grant is posted to each of its groups as *closed* (its
ready callback with the set's number negated, :func:`closed`): a group where another
Acquire of the job keeps the queue entry lets that entry wait alone, and a group
kept for a younger set reports again (it was not counted while this one was open).

Like the device arbiter, the coordinator is bookkeeping only: it reaches the groups
through their :class:`Member` method, which posts a command to the group's executor, so
every change of a group still happens in its own batch. Nothing here is persisted: after
a restart each re-issued AcquireSet is numbered anew and its members keep their places in
the groups' queues.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

log = logging.getLogger(__name__)


class Member(Protocol):
    """A group as the coordinator tells it (the method posts a command to the group)."""

    def set_ready(self, job: str, seq: int) -> None:
        """Grant ``job``, the member of set ``seq`` (every group of it is ready); a
        negated ``seq``: that set ended without its grant (:func:`closed`)."""


def closed(seq: int) -> int:
    """What the ready callback carries for set ``seq`` that ended without its grant."""
    return -seq


@dataclasses.dataclass
class _Set:
    job: str
    groups: frozenset[str]
    ready: set[str] = dataclasses.field(default_factory=set)
    granted: bool = False


class SetCoordinator:
    """Which sets wait, which of their groups are ready (see the module docstring)."""

    def __init__(self) -> None:
        self._next = 1
        self._sets: dict[int, _Set] = {}
        self._groups: dict[str, Member] = {}

    def join(self, group: str, member: Member) -> None:
        self._groups[group] = member

    def leave(self, group: str) -> None:
        self._groups.pop(group, None)

    def open(self, job: str, groups: Iterable[str]) -> int:
        """Number a new set of ``job``'s; its members then join the groups' queues."""
        seq = self._next
        self._next += 1
        self._sets[seq] = _Set(job, frozenset(groups))
        return seq

    def close(self, seq: int) -> None:
        """The AcquireSet ended (granted, failed or cancelled)."""
        entry = self._sets.pop(seq, None)
        if entry is None or entry.granted:
            return
        for group in sorted(entry.groups):
            told = self._groups.get(group)
            if told is not None:
                told.set_ready(entry.job, closed(seq))

    def ready(self, group: str, job: str, seq: int) -> None:
        """``group`` is reserved for ``job``'s set ``seq``; the last one grants the set."""
        entry = self._sets.get(seq)
        if entry is None or entry.job != job or group not in entry.groups or entry.granted:
            return
        if any(n < seq and group in s.groups and not s.granted for n, s in self._sets.items()):
            # It may still reach the group, and would take the reservation over; the
            # group reports again when it has, or when that set is closed.
            return
        self.withdraw(group)  # counted for one set at a time
        entry.ready.add(group)
        if entry.ready != entry.groups:
            return
        entry.granted = True
        log.debug("set %d of job %s granted: %s", seq, job, ", ".join(sorted(entry.groups)))
        for member in sorted(entry.groups):
            told = self._groups.get(member)
            if told is not None:  # a group stopping meanwhile fails its own Acquire
                told.set_ready(job, seq)

    def passer(
        self,
        group: str,
        seq: int,
        others: Sequence[str],
        holders: Mapping[str, str | None],
    ) -> str | None:
        """Who of ``others`` (the single waiters behind the member ``group`` is kept
        for set ``seq``, in the policy's order) goes first: the first that holds
        another group (``holders``: group -> holder), while the set is not granted.

        Such a job waits with a group in hand (a nested acquire); kept out, it would
        wait for the set, which may wait for what it holds, directly or through other
        jobs that hold and wait (x holds g2 and waits for g3, kept for a set that waits
        for g1, held by z, which waits for g2): a cycle. Let through, the holders never
        wait for a kept group, and a set holds nothing while it waits: no cycle, where
        the jobs that hold and wait take their groups in one order."""
        entry = self._sets.get(seq)
        if entry is None or entry.granted:
            return None
        holding = {job for g, job in holders.items() if g != group and job is not None}
        return next((job for job in others if job in holding), None)

    def withdraw(self, group: str) -> None:
        """``group`` is counted ready for no set that is not granted yet (it reports
        for another one, or may grant none now: drained)."""
        for entry in self._sets.values():
            if not entry.granted:
                entry.ready.discard(group)

    def waiting(self) -> list[tuple[int, str, frozenset[str], frozenset[str]]]:
        """``(seq, job, groups, ready)`` of every set not granted yet, oldest first."""
        return [
            (seq, s.job, s.groups, frozenset(s.ready))
            for seq, s in sorted(self._sets.items())
            if not s.granted
        ]
