"""The interface between a group's lock and its scheduling policy, and FIFO.

The lock (``tslice.orchestrator.group.lock``) stays the only one that changes who holds
the group; a policy only *orders* the live waiters when the lock promotes one
(:meth:`Policy.rank`) and may ask it to keep an idle group for its resident a little
longer (:meth:`Policy.hold_until`). It learns what happens through the lock's calls
(a job arrives, is granted, releases; a switch took so long) and keeps what it
measured in :class:`Phases`. Like the lock, a policy is pure: no I/O, no clock of
its own (``now`` comes from the lock's caller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import ClassVar, Protocol, TypeVar


class Waiter(Protocol):
    """A live queue entry as a policy sees it (the lock's entries are these)."""

    @property
    def job(self) -> str: ...

    @property
    def seq(self) -> int: ...

    @property
    def queued_at(self) -> float: ...


W = TypeVar("W", bound=Waiter)


@dataclasses.dataclass(frozen=True)
class View:
    """What the lock knows that a ranking may use."""

    now: float
    #: The job verified on every device: granting it again costs no switch (None: none).
    resident: str | None = None
    #: Footprints (bytes) the jobs announced in Acquire.
    footprints: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Average:
    """An exponentially weighted moving average (None until the first sample)."""

    value: float | None = None
    count: int = 0

    def add(self, sample: float, weight: float) -> None:
        self.value = sample if self.value is None else self.value + weight * (sample - self.value)
        self.count += 1


@dataclasses.dataclass
class Phases:
    """What the lock has seen of each job: turn lengths, gaps, switch-in costs.

    Kept in memory only: after a restart the averages start again (the first turns
    are scheduled on the defaults).
    """

    #: Weight of the newest sample in every average.
    smoothing: float = 0.3
    #: Switch-in cost of a job never measured, seconds; a footprint with a known
    #: bandwidth gives a better first guess.
    default_switch_s: float = 1.0
    bandwidth_bytes_per_s: float = 0.0
    holds: dict[str, Average] = dataclasses.field(default_factory=dict)
    gaps: dict[str, Average] = dataclasses.field(default_factory=dict)
    switch_in: dict[str, Average] = dataclasses.field(default_factory=dict)
    granted_at: dict[str, float] = dataclasses.field(default_factory=dict)
    released_at: dict[str, float] = dataclasses.field(default_factory=dict)

    def arrived(self, job: str, now: float) -> None:
        since = self.released_at.pop(job, None)
        if since is not None:
            self._add(self.gaps, job, max(0.0, now - since))

    def granted(self, job: str, now: float) -> None:
        self.granted_at[job] = now

    def released(self, job: str, now: float) -> float | None:
        """Record the end of ``job``'s turn; its length (None: its start is unknown)."""
        self.released_at[job] = now
        since = self.granted_at.pop(job, None)
        if since is None:
            return None
        held = max(0.0, now - since)
        self._add(self.holds, job, held)
        return held

    def switched(self, to_job: str, seconds: float) -> None:
        self._add(self.switch_in, to_job, max(0.0, seconds))

    def switch_in_s(self, job: str, footprints: Mapping[str, int]) -> float:
        """The expected cost of bringing ``job``'s state in, seconds."""
        measured = self.switch_in.get(job)
        if measured is not None and measured.value is not None:
            return measured.value
        footprint = footprints.get(job, 0)
        if footprint > 0 and self.bandwidth_bytes_per_s > 0:
            return footprint / self.bandwidth_bytes_per_s
        return self.default_switch_s

    def expected(self, series: dict[str, Average], job: str, *, samples: int = 1) -> float | None:
        seen = series.get(job)
        if seen is None or seen.count < samples:
            return None
        return seen.value

    def _add(self, series: dict[str, Average], job: str, sample: float) -> None:
        series.setdefault(job, Average()).add(sample, self.smoothing)


class Policy:
    """First come, first served; the base every policy extends.

    Starvation bound (FIFO): a live waiter is passed by at most the waiters ahead
    of it when it queued (fewer than the number of jobs), since a job granted and
    queued again goes to the back. The only exception is the device claim's rule
    for jobs that already hold an overlapping group (``tslice.orchestrator.group.overlap``),
    which applies under every policy.

    With AcquireSet (``set_gate``) a waiter is also passed, at most once each, by the
    sets older than itself (a set member) or than the youngest set member ahead of it (a
    single waiter) whose part had not reached the group when it queued; jobs let past a
    group kept for a set (they hold another group: ``sets.passer``) are, like the device
    claim's exception, outside the bound.
    """

    kind: ClassVar[str] = "fifo"
    #: The policy's bound needs when waiters started waiting to survive a restart
    #: (the lock then writes them into its record).
    keeps_wait_times: ClassVar[bool] = False

    def __init__(self, phases: Phases | None = None) -> None:
        self.phases = phases if phases is not None else Phases()

    def rank(self, waiters: Sequence[W], view: View) -> list[W]:
        """The live waiters (in queue order) in the order they should be granted."""
        return list(waiters)

    def hold_until(self, resident: str, waiters: Sequence[Waiter], view: View) -> float | None:
        """Keep the idle group for ``resident`` (verified, it yielded) until then
        instead of switching to ``waiters`` now (None: switch now). Only asked when the
        lock's driver wakes it at :attr:`~tslice.orchestrator.group.state.LockState.wake_at`."""
        return None

    # ---- what the lock tells it ------------------------------------------------------------

    def arrived(self, job: str, *, now: float, active: Collection[str]) -> None:
        """``job`` asks for the group anew (``active``: the others holding or waiting)."""
        self.phases.arrived(job, now)

    def granted(self, job: str, *, now: float) -> None:
        self.phases.granted(job, now)

    def released(self, job: str, *, now: float) -> None:
        self.phases.released(job, now)

    def switched(self, from_job: str | None, to_job: str, *, seconds: float) -> None:
        """A switch that brought ``to_job`` in took ``seconds`` (measured by its runner)."""
        self.phases.switched(to_job, seconds)

    def describe(self) -> str:
        """One line for an operator: the policy and its settings."""
        return self.kind


Fifo = Policy
