"""One group's side of an all-or-nothing acquire of several groups (``AcquireSet``).

A job that acquires a set waits in the queue of every group of the set as a *set
member*, tagged with the set's number (``tslice.orchestrator.sets`` numbers sets in the
order they arrive, across every group). When the group would promote a set member it
does not grant it: it *reserves* itself for it and tells the coordinator that it is
ready; only when every group of the set is ready does the coordinator let each of
them grant, so no group of a set is granted while another one still waits.

A reserved group grants nobody else until the set is granted or leaves (so a set that
is complete is never undone by a later arrival), and it reserves itself only for the
*oldest* set among its waiters, whatever the policy's order among sets. Two sets
order the same way in every group they share, so a set can only wait on a reserved
group for an older one: the chain ends at the oldest set, which every group of it
reserves for as soon as it is free. No cycle, no deadlock; the policy still decides
between single waiters and the sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from tslice.orchestrator import decisions as act

if TYPE_CHECKING:  # lock_state keeps a gate: no import back at run time
    from tslice.orchestrator.lock_state import Entry


@dataclasses.dataclass
class SetGate:
    #: Set members waiting here: job -> the number of its set.
    members: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The member this group keeps itself free for (None: none).
    reserved: str | None = None
    #: Members whose whole set is ready: they may be granted.
    ready: set[str] = dataclasses.field(default_factory=set)

    def mark(self, job: str, set_seq: int | None) -> None:
        """An Acquire of ``job`` arrived, alone (None) or as a member of set ``set_seq``."""
        if set_seq is None:
            self.drop(job)
        elif self.members.get(job) != set_seq:
            self.members[job] = set_seq
            self.ready.discard(job)

    def drop(self, job: str) -> None:
        """``job`` no longer waits here as a set member (granted, gone, or alone now)."""
        self.members.pop(job, None)
        self.ready.discard(job)
        if self.reserved == job:
            self.reserved = None

    def choose(self, ranked: Sequence[Entry], queued: Container[str]) -> Entry:
        """The waiter to promote: the reserved member, else the policy's head, except
        that a set member at the head gives way to the oldest set member (reserved)."""
        for job in [j for j in self.members if j not in queued]:
            self.drop(job)
        by_job = {e.job: e for e in ranked}
        if self.reserved is not None and self.reserved in by_job:
            return by_job[self.reserved]
        head = ranked[0]
        if head.job not in self.members:
            return head
        oldest = min(
            (e for e in ranked if e.job in self.members), key=lambda e: self.members[e.job]
        )
        self.reserved = oldest.job
        return oldest

    def waiting(self, job: str) -> act.NeedSet | None:
        """What a member still waits for before it may be granted (None: nothing)."""
        seq = self.members.get(job)
        return None if seq is None or job in self.ready else act.NeedSet(job, seq)

    def on_ready(self, job: str, set_seq: int) -> bool:
        """The coordinator says ``job``'s set ``set_seq`` is ready everywhere."""
        if self.members.get(job) != set_seq:
            return False  # gone, or waiting in another set since
        self.ready.add(job)
        return True
