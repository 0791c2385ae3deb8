"""Prefetch (issue 9 §2): should the next waiter's state start coming in before the holder
yields?

After a grant, and when a job queues behind a holder, the group asks
:func:`next_to_prefetch` whether someone is worth bringing in now: the group has a holder,
no switch runs, and the next waiter announced a footprint. The group then asks every node
(``effects.Prefetch``): only agents that declare the feature get the directive, through
their link (``switch.links``), and only where the footprint fits in the free memory of
every device. The agent copies into free memory only and drops the copy whenever that
memory is needed, so a prefetch never costs the holder anything; the switch that follows
finds the state there (a short restore). It is a hint: a failure is logged, nothing more.

:func:`should_prefetch` is the finer rule (a cost-aware policy's: just in time, never at
the holder's expense), which :meth:`tslice.orchestrator.group.state.LockState.prefetch_advice`
fills in from what the lock knows.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class LockView(Protocol):
    """What the rule reads of a group's lock."""

    holder: str | None
    grant_epoch: int

    def footprint(self, job: str) -> int: ...

    def next_waiter(self, *, now: float) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Bring ``job``'s state (``footprint_bytes`` per device) in while ``epoch`` holds."""

    job: str
    footprint_bytes: int
    epoch: int


def next_to_prefetch(lock: LockView, *, switching: bool, now: float) -> Candidate | None:
    """The waiter to prefetch now, or ``None``: the group has a holder, no switch is
    running, and the next waiter (the policy's choice, which is not always the first in
    the queue) declared its footprint (without one, nobody can tell whether it fits)."""
    holder, job = lock.holder, lock.next_waiter(now=now)
    if holder is None or switching or job is None or job == holder:
        return None
    footprint = lock.footprint(job)
    if footprint <= 0:
        return None
    return Candidate(job=job, footprint_bytes=footprint, epoch=lock.grant_epoch)


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """The advice: bring ``job`` in now (``start``), and why (or why not)."""

    #: The waiter the group will switch to next ("" = nobody waits).
    job: str
    start: bool
    reason: str


def should_prefetch(
    *,
    switch_in_s: float,
    holder_left_s: float | None,
    free_bytes: int,
    footprint_bytes: int,
    reserve_bytes: int = 0,
) -> tuple[bool, str]:
    """Start bringing a waiter's state in now? ``(start, reason)``.

    ``switch_in_s``: the waiter's expected switch-in; ``holder_left_s``: how long the
    holder is expected to keep the group (None: unknown); ``free_bytes``: device memory
    free beside the holder on the tightest node; ``footprint_bytes``: the waiter's
    state; ``reserve_bytes``: what the holder may still allocate. Never at the cost of
    the holder's memory: the state must fit in what is free beyond the reserve. It
    starts just in time: once the holder's expected rest is no longer than the
    switch-in (so the state is in when the holder yields), or at once when the
    holder's turn length is not known yet.
    """
    if footprint_bytes <= 0:
        return False, "the waiter announced no footprint: cannot tell whether it fits"
    room = free_bytes - reserve_bytes
    if room < footprint_bytes:
        return False, f"does not fit beside the holder ({footprint_bytes} B needed, {room} B free)"
    if holder_left_s is None:
        return True, "fits beside the holder; the holder's turn length is not known yet"
    if holder_left_s > switch_in_s:
        return False, (
            f"too early: the holder is expected for {holder_left_s:.3g} s more, the "
            f"switch-in takes {switch_in_s:.3g} s"
        )
    return True, "fits beside the holder and the holder is expected to yield before it is in"
