"""Cost-aware: measured switch costs and observed gaps decide."""

from __future__ import annotations

from collections.abc import Sequence

from tslice.orchestrator.policy import base, spec


class CostAware(base.Policy):
    """The waiter whose state is cheapest to bring in goes next, and a short gap of
    the resident is waited out rather than paid for with two switches.

    - *Cheapest first*: waiters go in order of their expected switch-in cost
      (measured by the group's switch runner; before that, footprint / bandwidth or
      ``default_switch_s``); the verified resident costs nothing, so its re-acquire
      goes first. Ties: first come, first served.
    - *Short gaps*: when the resident yields and its expected gap (the average time
      from its yield to its next Acquire, once ``gap_samples`` were seen) is shorter
      than the cheapest waiter's switch-in, the group stays idle for it, for up to
      ``gap_patience`` expected gaps (:meth:`hold_until`); its re-acquire is then
      granted at no cost. Only where the lock's driver wakes the lock at the deadline.
    - *Bounded*: a waiter that has waited ``max_defer_s`` is *overdue*: overdue
      waiters go first, first come first served, and the group is never held for the
      resident past any waiter's ``queued_at + max_defer_s``.

    Starvation bound: once ``W`` has waited ``max_defer_s`` only waiters that were
    already overdue before it (queued before it) go first, each at most once: ``W``
    is granted at the latest on the J-th grant after ``queued_at + max_defer_s`` (J
    jobs in the group), with no idle hold after that moment. When each waiter started
    waiting is in the lock's record (``keeps_wait_times``), so the bound holds across
    a restart where the store keeps it (the measured costs and gaps start again).

    With AcquireSet the bound holds as stated for set members and single waiters alike:
    a group kept for the oldest set serves a set at least as old as a job already
    waiting then, each once (jobs let past a kept group, ``sets.passer``, aside).
    """

    kind = "cost-aware"
    keeps_wait_times = True

    def __init__(self, settings: spec.CostAwareSpec, phases: base.Phases | None = None) -> None:
        super().__init__(
            phases
            or base.Phases(
                default_switch_s=settings.default_switch_s,
                bandwidth_bytes_per_s=settings.bandwidth_bytes_per_s,
            )
        )
        self.settings = settings

    def overdue(self, waiter: base.Waiter, now: float) -> bool:
        return now - waiter.queued_at >= self.settings.max_defer_s

    def cost(self, job: str, view: base.View) -> float:
        """Expected seconds to bring ``job``'s state in (0 for the verified resident)."""
        if job == view.resident:
            return 0.0
        return self.phases.switch_in_s(job, view.footprints)

    def rank(self, waiters: Sequence[base.W], view: base.View) -> list[base.W]:
        late = [w for w in waiters if self.overdue(w, view.now)]
        rest = [w for w in waiters if not self.overdue(w, view.now)]
        return [*late, *sorted(rest, key=lambda w: (self.cost(w.job, view), w.seq))]

    def expected_gap(self, job: str) -> float | None:
        return self.phases.expected(self.phases.gaps, job, samples=self.settings.gap_samples)

    def hold_until(
        self, resident: str, waiters: Sequence[base.Waiter], view: base.View
    ) -> float | None:
        gap = self.expected_gap(resident)
        since = self.phases.released_at.get(resident)
        if gap is None or since is None or not waiters:
            return None
        if gap >= min(self.cost(w.job, view) for w in waiters):
            return None  # the device would otherwise sit idle longer than a switch costs
        deadline = min(
            since + gap * self.settings.gap_patience,
            min(w.queued_at for w in waiters) + self.settings.max_defer_s,
        )
        return deadline if deadline > view.now else None

    def describe(self) -> str:
        return f"cost-aware (max defer {self.settings.max_defer_s:g} s)"
