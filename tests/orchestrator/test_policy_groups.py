"""Randomized multi-group runs: jobs hold several groups at once, groups share devices.

Group locks are driven as their drivers would drive them, through one
:class:`~tslice.orchestrator.group.overlap.DeviceArbiter` (its callbacks are posted and run
after the batch, as in the drivers' inboxes, some of them a few steps later; the arbiter
hears a group's holder at the end of the group's batch). The topology is a few *pools*:
the groups of a pool share a node's devices, and often one group spans the first two
pools' nodes (sorted between them, so that the order below has no cycle through it); a
job needs a few groups, possibly of
several pools, and takes them in a fixed order (pool by pool), holds them all, yields
them all, pauses, and starts again; sometimes it gives up waiting and lets go of
what it holds. After every step: no two jobs on overlapping groups at once (holders
and switch targets alike), grants only to live waiters, and each group's policy
bound for every grant it chose; a group may also grant the job that the device claim
was granted for (a job already holding a group, overlap's rule that keeps nested
acquires from deadlocking, or the one it last asked for): those are checked to be
such jobs. At the end every waiter is granted.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import random
from collections.abc import Callable

import pytest

from tests.orchestrator.policy_sim import CASES, Bound, Wait
from tslice.orchestrator import config, policy
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.group import overlap


@dataclasses.dataclass
class Job:
    needs: list[str]
    hold: float
    gap: float
    held: list[str] = dataclasses.field(default_factory=list)
    #: The group it waits for ("" = none), and its turn (cancel events of older turns lapse).
    waiting: str = ""
    turn: int = 0


class _Member:
    """A group as the arbiter tells it: what it is told goes to the cluster's inbox."""

    def __init__(self, inbox: collections.deque[tuple[str, str, str]], group: str) -> None:
        self._inbox, self._group = inbox, group

    def claim_granted(self, job: str) -> None:
        self._inbox.append((self._group, "granted", job))

    def claim_contended(self) -> None:
        self._inbox.append((self._group, "contended", ""))

    def devices_shared(self) -> tuple[bool, str | None]:
        return False, None  # (its lock asks for the claim from the start: start_claim(None))

    def holder(self) -> str | None:
        return None  # (the groups join before anything is granted)


class Cluster:
    def __init__(
        self, rng: random.Random, make: Callable[[], policy.PolicySpec], bound: Bound
    ) -> None:
        self.rng = rng
        self.bound = bound
        pools = rng.randint(2, 3)
        self.nodes: dict[str, tuple[config.NodeRef, ...]] = {}
        for p in range(pools):
            for k in range(rng.randint(1, 3)):
                self.nodes[f"p{p}g{k}"] = (config.NodeRef(f"n{p}", f"n{p}:1"),)
        if rng.random() < 0.7:  # across pools 0 and 1 (sorted between them: no cycle)
            self.nodes["p0x"] = (config.NodeRef("n0", "n0:1"), config.NodeRef("n1", "n1:1"))
        names = sorted(self.nodes)
        self.locks: dict[str, lk.GroupLock] = {}
        self.arbiter = overlap.DeviceArbiter()
        self.inbox: collections.deque[tuple[str, str, str]] = collections.deque()
        for g in names:
            lock = lk.GroupLock(reattach_grace_s=1e9)
            lock.use_policy(policy.build(make()), woken=True)
            lock.start_claim(None)
            self.locks[g] = lock
            self.arbiter.join(g, self.nodes[g], _Member(self.inbox, g))
        self.jobs = {
            f"j{i}": Job(
                needs=sorted(rng.sample(names, rng.randint(1, min(3, len(names))))),
                hold=rng.uniform(0.1, 2),
                gap=rng.uniform(0.05, 2),
            )
            for i in range(rng.randint(3, 8))
        }
        self.waits: dict[str, dict[str, Wait]] = {g: {} for g in names}
        self.holder: dict[str, str | None] = dict.fromkeys(names)
        self.target: dict[str, str | None] = dict.fromkeys(names)
        self.asked: dict[str, str] = {}
        self.noted: dict[str, str | None] = {}
        self.now = 0.0
        self.heap: list[tuple[float, int, str, str, str, int]] = []
        self.tick = 0
        self.closed = False
        self.grants = 0
        self.claim_picks = 0

    def at(self, t: float, kind: str, group: str = "", job: str = "", n: int = 0) -> None:
        self.tick += 1
        heapq.heappush(self.heap, (t, self.tick, kind, group, job, n))

    # ---- the drivers' side ----------------------------------------------------------------

    def bind(self, g: str, actions: list[decisions.Action], head: str | None = None) -> None:
        lock = self.locks[g]
        for a in actions:
            if isinstance(a, decisions.Granted):
                assert a.job in self.waits[g], f"{g}: granted {a.job}, which is not waiting"
                if a.held:
                    continue
                if a.zero_cost:
                    self.picked(g, a.job, head)
                self.granted(g, a.job)
            elif isinstance(a, decisions.StartSwitch):
                assert a.to_job in self.waits[g] and not self.waits[g][a.to_job].picked
                self.picked(g, a.to_job, head)
                self.target[g] = a.to_job
                self.at(self.now + self.rng.uniform(0.1, 1), "done", g, a.to_job, a.epoch)
            elif isinstance(a, decisions.NeedClaim):
                self.asked[g] = a.job
                got = self.arbiter.request(g, a.job, a.others)
                if got is None:
                    lock.on_claim_waiting()
                else:
                    self.claim_granted(g, got)
            elif isinstance(a, decisions.ReleaseClaim):
                self.arbiter.release(g)
            else:
                assert not isinstance(a, decisions.Abort), a
        wake = lock.wake_at
        if wake is not None:
            assert wake > self.now, f"{g}: a wake-up asked for a time already past"
            self.at(wake, "wake", g)
        self.applied(g)  # the end of the group's batch

    def claim_granted(self, g: str, job: str) -> None:
        if not self.arbiter.holds(g, job):
            return  # a late grant: the group asked again since (as coordination ignores it)
        lock = self.locks[g]
        head = lock.next_waiter(now=self.now)
        shared = bool(self.arbiter.conflicts(g))
        self.bind(g, lock.on_claim_granted(job, now=self.now, shared=shared), head)

    def applied(self, g: str) -> None:
        """After a batch: the arbiter sees the holder when it changed (the drivers'
        ``applied`` hook)."""
        holder = self.locks[g].holder
        if self.noted.get(g, "") != holder:
            self.noted[g] = holder
            self.arbiter.note_holder(g, holder)

    def pump(self) -> None:
        for g in self.locks:
            self.applied(g)
        while self.inbox:
            if not self.closed and self.rng.random() < 0.3:
                break  # applied in a later batch (FIFO per group: the inbox is one queue)
            g, kind, job = self.inbox.popleft()
            if kind == "granted":
                self.claim_granted(g, job)
            else:
                self.bind(g, self.locks[g].on_contended(now=self.now))
            self.applied(g)
        self.check()

    # ---- the jobs' side ---------------------------------------------------------------------

    def picked(self, g: str, job: str, head: str | None) -> None:
        waits = self.waits[g]
        wait = waits[job]
        wait.picked = True
        if head is not None and head != job:
            # The claim's pick: a job holding another group, or the one it asked for.
            holds = any(self.holder[h] == job for h in self.locks if h != g)
            assert holds or self.asked.get(g) == job, (g, job, head)
            self.claim_picks += 1
            return
        for other, w in waits.items():
            if other != job and not w.picked:
                w.passes.append(self.now)
        self.bound(self.locks[g].policy, len(self.jobs), job, wait)

    def granted(self, g: str, job: str) -> None:
        assert self.holder[g] is None, f"{g}: {job} granted while {self.holder[g]} holds"
        del self.waits[g][job]
        self.holder[g], self.target[g] = job, None
        self.grants += 1
        spec = self.jobs[job]
        spec.held.append(g)
        spec.waiting = ""
        self.next_group(job)

    def next_group(self, job: str) -> None:
        spec = self.jobs[job]
        todo = [g for g in spec.needs if g not in spec.held]
        if not todo:
            self.at(self.now + self.rng.expovariate(1 / spec.hold), "yield", job=job)
            return
        g = todo[0]
        spec.waiting = g
        spec.turn += 1
        lock = self.locks[g]
        self.waits[g][job] = Wait(self.now, lock.attached_waiters)
        self.bind(g, lock.on_acquire(job, now=self.now))
        if job in self.waits[g] and isinstance(lock.policy, policy.FairShare):
            self.waits[g][job].fair_bound = lock.policy.passes_bound(job, self.jobs)
        if self.rng.random() < 0.05 and not self.closed:
            self.at(self.now + self.rng.uniform(0, 3), "cancel", g, job, spec.turn)

    def let_go(self, job: str) -> None:
        spec = self.jobs[job]
        for g in reversed(spec.held):
            self.holder[g] = None
            out = self.locks[g].on_yield(job, now=self.now)
            assert out.ok, (g, job, out)
            self.bind(g, out.actions)
        spec.held.clear()
        if not self.closed:
            self.at(self.now + self.rng.expovariate(1 / spec.gap), "start", job=job)

    def step(self) -> bool:
        if not self.heap:
            return False
        t, _, kind, g, job, n = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        if kind == "start":
            self.next_group(job)
        elif kind == "yield":
            self.let_go(job)
        elif kind == "cancel":
            spec = self.jobs[job]
            wait = self.waits[g].get(job)
            if spec.waiting == g and spec.turn == n and wait is not None and not wait.picked:
                del self.waits[g][job]
                spec.waiting = ""
                self.bind(g, self.locks[g].on_cancel(job, now=self.now))
                self.let_go(job)
        elif kind == "done":
            lock = self.locks[g]
            sw = lock.switching
            if sw is not None and sw.epoch == n:
                self.target[g] = None
                lock.on_switch_measured(sw.from_job, sw.to_job, seconds=0.5)
                self.bind(g, lock.on_switch_done(epoch=n, restored=True, now=self.now))
        elif kind == "wake":
            self.bind(g, self.locks[g].on_expire(now=self.now))
        self.pump()
        return True

    def check(self) -> None:
        busy = {g: self.holder[g] or self.target[g] for g in self.locks}
        for g, job in busy.items():
            lock = self.locks[g]
            assert lock.holder in (None, self.holder[g], self.target[g]), g
            if job is None:
                continue
            for other in self.arbiter.conflicts(g):
                assert busy[other] in (None, job), f"{g}: {job} beside {busy[other]} on {other}"

    def run(self, horizon: float) -> None:
        for job in self.jobs:
            self.at(self.rng.uniform(0, 1), "start", job=job)
        while self.heap and self.now < horizon:
            self.step()
        self.closed = True
        while self.step() or self.inbox:
            self.pump()
        stuck = {g: sorted(w) for g, w in self.waits.items() if w}
        assert not stuck, f"waiters never granted: {stuck}"
        assert self.grants > 0


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("kind", list(CASES))
def test_multi_group_runs_keep_devices_exclusive_and_every_bound(kind: str, seed: int) -> None:
    rng = random.Random(f"groups-{kind}-{seed}")
    make, bound = CASES[kind]
    jobs = 8
    spec = make(rng, jobs)
    Cluster(rng, lambda: spec, bound).run(horizon=rng.uniform(30, 60))
