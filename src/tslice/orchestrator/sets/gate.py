"""One group's side of an all-or-nothing acquire of several groups (``AcquireSet``).

A job that acquires a set waits in the queue of every group of the set as a *set
member*, tagged with the set's number (``tslice.orchestrator.sets.coordinator`` numbers sets in the
order they arrive, across every group). When the group would promote a set member it
does not grant it: it *reserves* itself for it and tells the coordinator that it is
ready; only when every group of the set is ready does the coordinator let each of
them grant, so no group of a set is granted while another one still waits.

A reserved group grants nobody else until the set is granted or leaves (so a set that
is complete is never undone by a later arrival; only a waiter that holds another group
goes first while the set is not granted: ``SetCoordinator.passer``), and it reserves
itself only for the *oldest* set among its waiters, whatever the policy's order among
sets: an older member that reaches the group later (its Acquire was held up on the
way) takes the reservation over, and the coordinator never counts a group ready for a
set while an older set that names the group may still reach it. So two sets order the
same way in every group they share, and a set can only wait on a group reserved for
an older one: the chain ends at the oldest set, which every group of it reserves for
as soon as it is free. No cycle, no deadlock; the policy still decides between single
waiters and the sets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from typing import Protocol, TypeVar

from tslice.orchestrator.group import effects as act


class _Waiting(Protocol):
    """A queue entry as the gate sees it (state.Entry)."""

    @property
    def job(self) -> str: ...


Entry = TypeVar("Entry", bound=_Waiting)


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
        """The waiter to promote: the policy's head, unless the group is reserved or
        the head is a set member: then the oldest set member, reserved for."""
        for job in [j for j in self.members if j not in queued]:
            self.drop(job)
        head = ranked[0]
        if self.reserved is None and head.job not in self.members:
            return head
        members = [e for e in ranked if e.job in self.members]
        # A member whose set is granted goes first: its other groups grant it now.
        # Otherwise an older member that came since takes the reservation over (the
        # coordinator did not count this group ready for the younger one meanwhile).
        kept = next((e for e in members if e.job in self.ready), None) or min(
            members, key=lambda e: self.members[e.job], default=head
        )
        self.reserved = kept.job if kept.job in self.members else None
        return kept

    def waiting(self, job: str) -> act.NeedSet | None:
        """What a member still waits for before it may be granted (None: nothing)."""
        seq = self.members.get(job)
        return None if seq is None or job in self.ready else act.NeedSet(job, seq)

    def on_ready(self, job: str, set_seq: int) -> bool:
        """The coordinator says ``job``'s set ``set_seq`` is ready everywhere, or, with
        the number negated, that it ended without its grant (True: promote now).

        A closed set's member (another Acquire of the job keeps the entry) waits alone
        from now on. Any other set grants nobody; the member kept for, not ready yet,
        is then reported again (an older set it waited for may be the one closed)."""
        if set_seq < 0 and self.members.get(job) == -set_seq:
            self.drop(job)
            return True
        if self.members.get(job) != set_seq:
            return self.reserved is not None and self.reserved not in self.ready
        self.ready.add(job)
        return True
