"""A discrete-event simulation of jobs taking turns on one group's pure lock, and each
scheduling policy's starvation bound (shared by the policy and set tests)."""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Callable

from tslice.orchestrator import policy
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk


@dataclasses.dataclass
class Wait:
    since: float
    #: Waiters ahead of it when it arrived (FIFO's bound).
    ahead: int
    #: Grants to others that fair share allows before it (computed at its arrival).
    fair_bound: int = 0
    passes: list[float] = dataclasses.field(default_factory=list)
    picked: bool = False


@dataclasses.dataclass
class Job:
    hold: float
    gap: float
    switch: float
    #: A bursty job comes back after short gaps (what cost-aware waits out).
    bursty: bool = False


Bound = Callable[[policy.Policy, int, str, Wait], None]


class Sim:
    def __init__(self, rng: random.Random, build: Callable[[], policy.Policy], jobs: int) -> None:
        self.rng = rng
        self.build = build
        self.lock = lk.GroupLock(reattach_grace_s=1e9, policy=build())
        self.lock.use_policy(self.lock.policy, woken=True)
        self.jobs = {
            f"j{i}": Job(
                hold=rng.uniform(0.1, 3.0),
                gap=rng.uniform(0.05, 4.0),
                switch=rng.uniform(0.2, 2.0),
                bursty=rng.random() < 0.4,
            )
            for i in range(jobs)
        }
        self.now = 0.0
        self.heap: list[tuple[float, int, str, str, int]] = []
        self.tick = 0
        self.waits: dict[str, Wait] = {}
        self.holder: str | None = None
        self.switch_to: str | None = None
        self.version: dict[str, int] = dict.fromkeys(self.jobs, 0)
        self.wake_version = 0
        self.picks = 0
        self.closed = False
        self.holds_off = 0

    # ---- events -----------------------------------------------------------------------------

    def at(self, t: float, kind: str, job: str = "", version: int = 0) -> None:
        self.tick += 1
        heapq.heappush(self.heap, (t, self.tick, kind, job, version))

    def arrive(self, job: str) -> None:
        lock = self.lock
        ahead = lock.attached_waiters
        self.waits[job] = Wait(self.now, ahead)
        self.apply(lock.on_acquire(job, now=self.now))
        if isinstance(lock.policy, policy.FairShare) and job in self.waits:
            self.waits[job].fair_bound = lock.policy.passes_bound(job, self.jobs)

    def apply(self, actions: list[decisions.Action]) -> None:
        for a in actions:
            if isinstance(a, decisions.Granted):
                assert a.job in self.waits, f"granted {a.job}, which is not waiting"
                assert self.holder in (None, a.job), f"{a.job} granted while {self.holder} holds"
                if a.held:
                    continue
                if a.zero_cost:
                    self.picked(a.job)
                del self.waits[a.job]
                self.holder = a.job
                self.version[a.job] += 1
                spec = self.jobs[a.job]
                self.at(self.now + self.rng.expovariate(1 / spec.hold), "yield", a.job)
            elif isinstance(a, decisions.StartSwitch):
                assert a.to_job in self.waits and not self.waits[a.to_job].picked
                self.picked(a.to_job)
                self.switch_to = a.to_job
                self.at(self.now + self.jobs[a.to_job].switch, "done", a.to_job, a.epoch)
            else:
                assert not isinstance(a, (decisions.Abort, decisions.NeedClaim)), a
        self.check()

    def picked(self, job: str) -> None:
        self.picks += 1
        wait = self.waits[job]
        wait.picked = True
        for other, w in self.waits.items():
            if other != job and not w.picked:
                w.passes.append(self.now)
        self.bound(self.lock.policy, len(self.jobs), job, wait)

    def check(self) -> None:
        lock = self.lock
        assert lock.holder in (None, self.holder, self.switch_to)
        live = [j for j, w in self.waits.items() if not w.picked]
        wake = lock.wake_at
        if lock.holder is None and lock.switching is None and live and not lock.recovering:
            assert wake is not None and wake > self.now, "a live waiter was left on a free group"
            self.holds_off += 1
        if wake is not None:
            assert wake > self.now, "a wake-up asked for a time already past"
            self.wake_version += 1
            self.at(wake, "wake", version=self.wake_version)
            pol = lock.policy
            if isinstance(pol, policy.CostAware):
                oldest = min(self.waits[j].since for j in live)
                assert wake <= oldest + pol.settings.max_defer_s + 1e-9

    def step(self) -> bool:
        if not self.heap:
            return False
        t, _, kind, job, version = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        lock, spec = self.lock, self.jobs.get(job)
        if kind == "arrive":
            if job not in self.waits and self.holder != job and not self.closed:
                self.arrive(job)
                if self.rng.random() < 0.1:
                    self.at(self.now + self.rng.uniform(0, 5), "cancel", job, self.version[job])
        elif kind == "cancel":
            wait = self.waits.get(job)
            if wait is not None and version == self.version[job] and not wait.picked:
                del self.waits[job]
                self.apply(lock.on_cancel(job, now=self.now))
                self.again(job)
        elif kind == "yield":
            if self.holder == job:
                self.holder = None
                self.apply(lock.on_yield(job, now=self.now).actions)
                self.again(job)
        elif kind == "done":
            sw = lock.switching
            if sw is not None and sw.epoch == version:
                self.switch_to = None
                lock.on_switch_measured(sw.from_job, sw.to_job, seconds=self.jobs[job].switch)
                self.apply(lock.on_switch_done(epoch=version, restored=True, now=self.now))
        elif kind == "wake":
            if version == self.wake_version:
                self.apply(lock.on_expire(now=self.now))
        elif kind == "restart" and lock.switching is None:
            self.restart()
        assert spec is None or spec.hold > 0
        return True

    def again(self, job: str) -> None:
        spec = self.jobs[job]
        gap = self.rng.uniform(0.01, 0.3) if spec.bursty else self.rng.expovariate(1 / spec.gap)
        self.at(self.now + gap, "arrive", job)

    def restart(self) -> None:
        """The orchestrator restarts: the lock comes back from its record."""
        old = self.lock
        lock = lk.GroupLock.from_record(
            old.record(), now=self.now, reattach_grace_s=1e9, policy=self.build()
        )
        lock.use_policy(lock.policy, woken=True)
        self.lock = lock
        for job in old.waiting_jobs:
            self.apply(lock.on_acquire(job, now=self.now))
        if isinstance(lock.policy, policy.FairShare):
            # Usage is not kept: the bound counts again from the restart.
            for job, wait in self.waits.items():
                wait.fair_bound = len(wait.passes) + lock.policy.passes_bound(job, self.jobs)
        if not lock.policy.keeps_wait_times:
            for wait in self.waits.values():
                wait.since = self.now
        self.apply(
            lock.on_recovered(
                resident=old.resident, verified=old.verified, rollback=False, now=self.now
            )
        )

    def run(self, bound: Bound, horizon: float) -> None:
        self.bound = bound
        for job in self.jobs:
            self.at(self.rng.uniform(0, 2), "arrive", job)
        for _ in range(3):
            self.at(self.rng.uniform(0, horizon), "restart")
        while self.heap and self.now < horizon:
            self.step()
        self.closed = True  # no new arrivals: everybody waiting must be granted
        while self.step():
            pass
        assert not self.waits, f"waiters never granted: {sorted(self.waits)}"
        assert self.picks > 0


def fifo_bound(pol: policy.Policy, jobs: int, job: str, wait: Wait) -> None:
    assert len(wait.passes) <= wait.ahead, (job, wait)


def after(limit: float, wait: Wait) -> int:
    return sum(1 for t in wait.passes if t >= limit)


def priority_bound(pol: policy.Policy, jobs: int, job: str, wait: Wait) -> None:
    assert isinstance(pol, policy.Priority)
    late = after(wait.since + pol.aging_bound_s(job), wait)
    assert late <= jobs - 1, (job, pol.priority(job), wait)


def fair_bound(pol: policy.Policy, jobs: int, job: str, wait: Wait) -> None:
    assert len(wait.passes) <= wait.fair_bound, (job, wait)


def cost_bound(pol: policy.Policy, jobs: int, job: str, wait: Wait) -> None:
    assert isinstance(pol, policy.CostAware)
    assert after(wait.since + pol.settings.max_defer_s, wait) <= jobs - 1, (job, wait)


def priorities(rng: random.Random, jobs: int) -> policy.PrioritySpec:
    named = {f"j{i}": rng.randint(-3, 5) for i in range(jobs) if rng.random() < 0.7}
    return policy.PrioritySpec(aging_s=rng.uniform(0.5, 5), priorities=named)


def weights(rng: random.Random, jobs: int) -> policy.FairShareSpec:
    named = {f"j{i}": rng.uniform(0.2, 5) for i in range(jobs) if rng.random() < 0.7}
    return policy.FairShareSpec(named, quantum_s=rng.uniform(0.2, 1), memory_s=rng.uniform(1, 20))


def costs(rng: random.Random, jobs: int) -> policy.CostAwareSpec:
    return policy.CostAwareSpec(max_defer_s=rng.uniform(1, 10), default_switch_s=1.0)


CASES: dict[str, tuple[Callable[[random.Random, int], policy.PolicySpec], Bound]] = {
    "fifo": (lambda rng, n: policy.FifoSpec(), fifo_bound),
    "priority": (priorities, priority_bound),
    "fair-share": (weights, fair_bound),
    "cost-aware": (costs, cost_bound),
}
