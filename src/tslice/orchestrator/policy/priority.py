"""Priority with aging."""

from __future__ import annotations

from collections.abc import Sequence

from tslice.orchestrator.policy import base, spec


class Priority(base.Policy):
    """Higher effective priority first; ties first come, first served.

    A waiter's effective priority is ``priority + waited / aging_s``: it rises by one
    level per ``aging_s`` waited. Since every waiter ages at the same rate, the order
    does not change while they wait: ``priority * aging_s - queued_at``, greater
    first, decides it.

    Starvation bound: a job ``X`` that starts waiting after ``W`` is granted before
    it only if it started less than ``(p_X - p_W) * aging_s`` after ``W``. So once
    ``W`` has waited ``(P_max - p_W) * aging_s`` (``P_max`` the highest priority
    configured, or the default if higher), only jobs that were already waiting then
    may still go before it, each at most once: ``W`` is granted at the latest on the
    J-th grant after that moment (J jobs in the group), or, in time, within
    ``(P_max - p_W) * aging_s`` plus J - 1 turns and their switches.

    With AcquireSet the bound holds as stated for set members and single waiters alike:
    a group kept for the oldest set serves a set at least as old as a job already
    waiting then, each once (jobs let past a kept group, ``sets.passer``, aside).

    When each waiter started waiting is in the lock's record (``keeps_wait_times``),
    so the bound holds across a restart where the store keeps it; otherwise the
    waits count from the restart.
    """

    kind = "priority"
    keeps_wait_times = True

    def __init__(self, settings: spec.PrioritySpec, phases: base.Phases | None = None) -> None:
        super().__init__(phases)
        self.settings = settings

    def priority(self, job: str) -> int:
        return self.settings.priorities.get(job, self.settings.default_priority)

    def effective(self, waiter: base.Waiter, now: float) -> float:
        """The waiter's priority with its aging, now (for an operator: its place)."""
        return self.priority(waiter.job) + (now - waiter.queued_at) / self.settings.aging_s

    def aging_bound_s(self, job: str) -> float:
        """How long ``job`` waits at most before no newcomer passes it, seconds."""
        top = max([self.settings.default_priority, *self.settings.priorities.values()])
        return max(0, top - self.priority(job)) * self.settings.aging_s

    def rank(self, waiters: Sequence[base.W], view: base.View) -> list[base.W]:
        aging = self.settings.aging_s
        return sorted(waiters, key=lambda w: (w.queued_at - self.priority(w.job) * aging, w.seq))

    def describe(self) -> str:
        named = ", ".join(f"{j}={p}" for j, p in sorted(self.settings.priorities.items()))
        return f"priority (aging {self.settings.aging_s:g} s{'; ' + named if named else ''})"
