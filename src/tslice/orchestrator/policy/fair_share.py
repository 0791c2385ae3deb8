"""Weighted fair share of device time."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tslice.orchestrator.policy import base, spec


class FairShare(base.Policy):
    """The waiter with the least device time per unit of weight goes next.

    A job's *usage* is the seconds it held the group (each turn charged at least
    ``quantum_s``) divided by its weight. A job is not given a huge credit when it
    asks again: the *virtual time* ``V`` is the least usage among the jobs holding
    or waiting (it never goes down); a new job starts at ``V``, a job coming back
    keeps at most ``credit_s`` of what it is owed (its usage is raised to at least
    ``V - credit_s``: a job that yields and asks again at once keeps its due, one
    that was away long is not owed the time it did not ask for), and a lead beyond
    ``memory_s`` over ``V`` is forgiven. Usage is kept in memory: a restart starts
    every job at zero (documented reset: the bound below counts from the restart).

    Starvation bound: while ``W`` waits its usage ``u_W`` stays fixed, every other
    active job's usage is at least ``V - credit_s`` (``V`` at ``W``'s arrival), and
    each turn of ``X`` raises ``X``'s by at least ``quantum_s / w_X``; ``X`` goes first
    only while its usage is at most ``u_W``. So ``W`` is passed by at most
    ``sum over X != W of (floor((u_W - V + credit_s) * w_X / quantum_s) + 1)``
    grants, with ``u_W - V <= memory_s`` (:meth:`passes_bound`).

    With AcquireSet a set member is passed, besides this bound, at most once by each
    older set naming the group that was waiting or on its way when it queued; a single
    waiter is not bounded against sets (when a set member with less usage reaches the
    head, the group serves the older sets first, whatever their usage).
    """

    kind = "fair-share"

    def __init__(self, settings: spec.FairShareSpec, phases: base.Phases | None = None) -> None:
        super().__init__(phases)
        self.settings = settings
        self._usage: dict[str, float] = {}
        self._vtime = 0.0

    def weight(self, job: str) -> float:
        return self.settings.weights.get(job, self.settings.default_weight)

    def usage(self, job: str) -> float:
        """Weighted device time of ``job``, seconds per unit of weight."""
        return self._usage.get(job, self._vtime)

    @property
    def virtual_time(self) -> float:
        return self._vtime

    def passes_bound(self, job: str, others: Collection[str]) -> int:
        """How many grants to ``others`` may still go before ``job`` (waiting now)."""
        lead = self.usage(job) - self._vtime + self.settings.credit_s
        quantum = self.settings.quantum_s
        return sum(int(lead * self.weight(x) / quantum) + 1 for x in others if x != job)

    def rank(self, waiters: Sequence[base.W], view: base.View) -> list[base.W]:
        return sorted(waiters, key=lambda w: (self.usage(w.job), w.seq))

    def arrived(self, job: str, *, now: float, active: Collection[str]) -> None:
        super().arrived(job, now=now, active=active)
        others = [self.usage(j) for j in active if j != job]
        if others:
            self._vtime = max(self._vtime, min(others))
        floor = self._vtime
        owed = self.settings.credit_s
        self._usage[job] = min(max(self.usage(job), floor - owed), floor + self.settings.memory_s)

    def released(self, job: str, *, now: float) -> None:
        held = self.phases.released(job, now)
        turn = max(held or 0.0, self.settings.quantum_s)
        self._usage[job] = self.usage(job) + turn / self.weight(job)

    def describe(self) -> str:
        named = ", ".join(f"{j}={w:g}" for j, w in sorted(self.settings.weights.items()))
        return f"fair-share{' (' + named + ')' if named else ''}"
