"""Randomized runs of AcquireSet on the pure locks: no deadlock, no violation, every bound.

A few groups, each a :class:`~tslice.orchestrator.group.lock.GroupLock` with its own policy,
share one :class:`~tslice.orchestrator.sets.coordinator.SetCoordinator`, wired as the group
drivers wire them: a lock's ``NeedSet`` is handed to the coordinator at once, and its
answer is posted to each group's inbox, to run later as
``lock.on_set_ready``. Every group has an inbox: what is posted to it runs in order,
a little later. Jobs repeatedly take one group, a set of 2-3 groups, or 2-3 groups
one after the other in the groups' order, holding the earlier ones (a nested acquire,
which a group kept for a set lets go first: ``SetCoordinator.passer``), hold them,
yield them all, pause and start again. A part of a set reaches its group after a
random delay (the driver reads a node never read before it queues the Acquire), so
two sets may reach two groups in opposite orders. Some jobs give up waiting, and an
operator now and then evicts a waiter (its part fails, so its set does) or drains a
group for a while (no new turn, except a set granted before the drain): as
``set_acquire`` does, the parts still waiting leave, the parts granted are yielded,
then the set is closed. Switches take time.

Checked after every step: at most one holder per group; a set's part is granted (a
switch to it started, or a zero-cost grant) only once the coordinator granted the set,
when every group of the set was free and kept for it, and a group kept for a granted
set grants nobody else before it; no departed waiter is granted. When arrivals stop,
every waiter is granted and no group is left reserved (no deadlock). A job let past
a kept group is checked to hold another group; like the device claim's exception
(docs/operations.md), those grants are not counted in the bounds below.

Starvation bounds, from ``set_gate``'s rule. At a group, a set member waiting there
passes to a single waiter only when that waiter is the policy's head (no group is
reserved then); it passes to another set member only when that member's set is
*older* (a group reserves for the oldest set member among its waiters). Each older
set is granted once (a job that comes back opens a younger set), so for a member
``M`` of set ``s`` at group ``g``, the grants to others while it waits there are at
most the policy's own bound plus ``older(M)``: the sets older than ``s`` that name
``g`` and were still open when ``M`` reached ``g``. Per policy:

- FIFO: at most the waiters ahead of it when it arrived, plus the older sets whose
  part for ``g`` was still on its way then. The same holds for a single waiter, with
  "older" meaning older than the youngest set member ahead of it (a reservation
  goes only to a set at least as old as the member at the head).
- priority with aging, cost-aware: once ``W`` (member or not) has waited the policy's
  bound (``aging_bound_s``, ``max_defer_s``), at most J - 1 grants to others (J jobs):
  from then on the head is a job that waited then, each granted once, and a
  reservation goes to a set at least as old as such a job's, which was open then,
  granted once too; a job is counted once across both.
- fair share: at most the policy's ``passes_bound`` plus ``older(M)``. A single waiter
  under fair share has no such bound: each time a set member with less usage reaches
  the head, the group serves the older sets first, whatever their usage (checked:
  the grants that the policy ranked ahead of it stay within ``passes_bound``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import random
from collections.abc import Callable

import pytest

from tests.orchestrator import policy_sim as bounds
from tslice.orchestrator import policy
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.group import state
from tslice.orchestrator.sets import coordinator as sets


class _Member:
    """A group as the set coordinator tells it: recorded by the test."""

    def __init__(self, posted: Callable[[str, str, int], None], group: str) -> None:
        self._posted, self._group = posted, group

    def set_ready(self, job: str, seq: int) -> None:
        self._posted(self._group, job, seq)


@dataclasses.dataclass
class Request:
    """One Acquire (``seq`` None) or AcquireSet of a job."""

    id: int
    job: str
    groups: tuple[str, ...]
    seq: int | None
    #: Parts that reached their group's lock / were granted there (group -> epoch).
    arrived: set[str] = dataclasses.field(default_factory=set)
    granted: dict[str, int] = dataclasses.field(default_factory=dict)
    departed: set[str] = dataclasses.field(default_factory=set)
    cancelled: bool = False
    yields_left: int = 0
    #: Single Acquires one after the other, in the groups' order, holding the earlier.
    nested: bool = False


@dataclasses.dataclass
class Wait(bounds.Wait):
    """A part waiting at one group, with what its bound needs."""

    #: Its set (None: a single Acquire).
    set_seq: int | None = None
    #: Sets older than it (see the module docstring) naming the group, open when it
    #: arrived: those whose part for the group was still on its way, and all of them.
    older_on_way: int = 0
    older_all: int = 0
    #: Of its passes, the grants that the policy itself ranked ahead of it.
    ranked_passes: int = 0


@dataclasses.dataclass
class Job(bounds.Job):
    request: Request | None = None


Bound = Callable[["Cluster", str, str, Wait], None]
Event = Callable[[], None]


class Cluster:
    def __init__(self, rng: random.Random, spec: policy.PolicySpec, bound: Bound) -> None:
        self.rng = rng
        self.bound = bound
        self.groups = [f"g{i}" for i in range(rng.randint(3, 5))]
        self.coordinator = sets.SetCoordinator()
        self.locks: dict[str, lk.GroupLock] = {}
        for g in self.groups:
            lock = lk.GroupLock(reattach_grace_s=1e9)
            lock.use_policy(policy.build(spec), woken=True)
            self.locks[g] = lock
            self.coordinator.join(g, _Member(self.set_posted, g))
        self.jobs = {
            f"j{i}": Job(
                hold=rng.uniform(0.1, 2), gap=rng.uniform(0.05, 6), switch=rng.uniform(0.05, 1)
            )
            for i in range(rng.randint(6, 12))
        }
        self.now = 0.0
        self.heap: list[tuple[float, int, Event]] = []
        self.tick = 0
        self.last: dict[str, float] = dict.fromkeys(self.groups, 0.0)
        self.requests: dict[int, Request] = {}
        #: group -> job -> its part waiting there.
        self.waits: dict[str, dict[str, Wait]] = {g: {} for g in self.groups}
        #: group -> job -> its request, from the part's arrival until it leaves.
        self.parts: dict[str, dict[str, Request]] = {g: {} for g in self.groups}
        self.holder: dict[str, str | None] = dict.fromkeys(self.groups)
        self.target: dict[str, str | None] = dict.fromkeys(self.groups)
        self.open_sets: dict[int, Request] = {}
        self.granted_sets: set[int] = set()
        #: group -> the job of a granted set it has not granted yet.
        self.committed: dict[str, str] = {}
        self.closed = False
        self.set_grants = 0
        self.cancels = 0
        self.out_of_order = 0
        self.closes = 0
        self.held_back = 0
        self.evictions = 0
        self.let_through = 0
        #: group -> the waiter let past the set it is kept for (on_set_passed).
        self.passing: dict[str, str] = {}

    # ---- plumbing ---------------------------------------------------------------------------

    def at(self, t: float, event: Event) -> None:
        self.tick += 1
        heapq.heappush(self.heap, (t, self.tick, event))

    def post(self, g: str, event: Event, delay: float = -1.0) -> None:
        """Into ``g``'s inbox: runs after everything posted to it before."""
        if delay < 0:
            # A busy worker now and then runs its inbox late.
            delay = self.rng.uniform(0, 0.05 if self.rng.random() < 0.9 else 0.5)
        t = max(self.now + delay, self.last[g])
        self.last[g] = t
        self.at(t, event)

    def bind(self, g: str, actions: list[decisions.Action]) -> None:
        lock = self.locks[g]
        for a in actions:
            if isinstance(a, decisions.Granted):
                if not a.held:
                    self.granted(g, a)
            elif isinstance(a, decisions.StartSwitch):
                self.picked(g, a.to_job)
                self.target[g] = a.to_job
                self.post(
                    g,
                    functools.partial(self.switch_done, g, a.epoch),
                    delay=self.jobs[a.to_job].switch,
                )
            elif isinstance(a, decisions.NeedSet):
                self.kept(g, a)
            elif isinstance(a, decisions.NotReady):
                self.coordinator.withdraw(g)
            elif isinstance(a, decisions.NeedClaim):
                self.bind(g, lock.on_claim_granted(a.job, now=self.now))
            elif isinstance(a, decisions.Abort):
                self.aborted(g, a.job)
        wake = lock.wake_at
        if wake is not None:
            assert wake > self.now, f"{g}: a wake-up asked for a time already past"
            self.post(g, lambda: self.bind(g, lock.on_expire(now=self.now)), delay=wake - self.now)

    def kept(self, g: str, need: decisions.NeedSet) -> None:
        """As the driver: report ready, or let a waiter that holds a group go first."""
        holders = {h: lock.holder for h, lock in self.locks.items()}
        passing = self.coordinator.passer(g, need.set_seq, need.others, holders)
        if passing is not None:
            self.coordinator.withdraw(g)
            self.passing[g] = passing
            self.bind(g, self.locks[g].on_set_passed(passing, now=self.now))
            return
        self.coordinator.ready(g, need.job, need.set_seq)
        counted = (r for n, _, _, r in self.coordinator.waiting() if n == need.set_seq)
        if g not in next(counted, {g}):
            self.held_back += 1  # an older set may still reach g

    # ---- what the groups and the coordinator decide ----------------------------------------

    def picked(self, g: str, job: str) -> None:
        """``g`` gives its next turn to ``job`` (a switch to it, or a zero-cost grant)."""
        wait = self.waits[g].get(job)
        assert wait is not None and not wait.picked, f"{g}: picked {job}, which does not wait"
        req = self.parts[g][job]
        assert g not in req.departed, f"{g}: picked {job}, which left"
        assert self.holder[g] is None and self.target[g] is None, f"{g}: two holders"
        if req.seq is not None:
            assert req.seq in self.granted_sets, f"{g}: part of set {req.seq} before the set"
        kept = self.committed.pop(g, None)
        assert kept in (None, job), f"{g}: granted {job} while kept for the granted set of {kept}"
        wait.picked = True
        if self.passing.pop(g, None) == job:
            # Let past the set this group is kept for: not in the bounds (see above).
            held = (h for h in self.groups if job in (self.holder[h], self.target[h]))
            assert any(h != g for h in held), f"{g}: {job} let through, holding nothing"
            self.let_through += 1
            return
        others = {j: w for j, w in self.waits[g].items() if j != job and not w.picked}
        entries = [state.Entry(j, n, w.since, 1) for n, (j, w) in enumerate(self.waits[g].items())]
        live = [e for e in entries if e.job == job or e.job in others]
        order = [e.job for e in self.locks[g].policy.rank(live, self.view(g))]
        for other, w in others.items():
            w.passes.append(self.now)
            if order.index(job) < order.index(other):
                w.ranked_passes += 1
            else:
                self.out_of_order += 1
        self.bound(self, g, job, wait)

    def view(self, g: str) -> policy.View:
        lock = self.locks[g]
        return policy.View(self.now, lock.resident if lock.verified else None, {})

    def granted(self, g: str, a: decisions.Granted) -> None:
        if a.zero_cost:
            self.picked(g, a.job)
        del self.waits[g][a.job]
        req = self.parts[g][a.job]
        assert g not in req.departed, (g, a)
        if req.seq is not None:  # its switch, if any, was started for another request
            assert req.seq in self.granted_sets, f"{g}: part of set {req.seq} before the set"
        assert self.holder[g] is None, f"{g}: {a.job} granted while {self.holder[g]} holds"
        self.holder[g], self.target[g] = a.job, None
        req.granted[g] = a.epoch
        if req.cancelled:
            return  # its departure comes: an undelivered grant
        if len(req.granted) == len(req.groups):
            hold = self.rng.expovariate(1 / self.jobs[a.job].hold)
            self.at(self.now + hold, functools.partial(self.release, req))
        elif req.nested:  # the next group, holding this one
            after = req.groups[len(req.granted)]
            self.post(after, functools.partial(self.arrive, after, req))

    def set_posted(self, g: str, job: str, seq: int) -> None:
        """The coordinator posts "grant set ``seq``" to ``g``; at its first post every
        group of the set must be free and kept for it."""
        self.post(g, functools.partial(self.set_ready, g, job, seq))
        if seq < 0:
            self.closes += 1  # a set closed without its grant
            return
        if seq in self.granted_sets:
            return
        req = self.open_sets[seq]
        assert req.job == job
        self.granted_sets.add(seq)
        self.set_grants += 1
        for h in req.groups:
            lock = self.locks[h]
            assert lock.holder is None and lock.switching is None, f"{h} busy at set {seq}"
            assert self.parts[h].get(job) is req, f"{h}: set {seq} not queued there"
            assert lock.reserved_for == (job, seq), (h, lock.reserved_for, job, seq)
            assert h not in self.committed, (h, self.committed)
            self.committed[h] = job

    def set_ready(self, g: str, job: str, seq: int) -> None:
        """``lock.on_set_ready`` runs in ``g``'s inbox: a part still there is granted."""
        actions = self.locks[g].on_set_ready(job, set_seq=seq, now=self.now)
        req = self.parts[g].get(job)
        if req is not None and req.seq == seq and g not in req.granted:
            picked = [
                a
                for a in actions
                if (isinstance(a, decisions.StartSwitch) and a.to_job == job)
                or (isinstance(a, decisions.Granted) and a.job == job)
            ]
            assert picked, f"{g}: set {seq} of {job} ready, not granted: {actions}"
        self.bind(g, actions)

    # ---- the jobs' side ---------------------------------------------------------------------

    def start(self, job: str) -> None:
        kind = self.rng.random()
        size = 1 if kind < 0.3 else self.rng.randint(2, 3)
        groups = tuple(sorted(self.rng.sample(self.groups, size)))
        nested = size > 1 and kind < 0.5
        seq = self.coordinator.open(job, groups) if size > 1 and not nested else None
        req = Request(len(self.requests), job, groups, seq, nested=nested)
        self.requests[req.id] = req
        self.jobs[job].request = req
        if seq is not None:
            self.open_sets[seq] = req
        for g in groups[:1] if nested else self.rng.sample(groups, size):
            # A node never read is read first (check_fits): the part is queued later.
            fits = 0.0 if self.rng.random() < 0.5 else self.rng.uniform(0, 1.5)
            queue = functools.partial(self.post, g, functools.partial(self.arrive, g, req))
            self.at(self.now + fits, queue)
        if self.rng.random() < 0.2 and not self.closed:
            self.at(self.now + self.rng.uniform(0, 2), functools.partial(self.cancel, req))

    def arrive(self, g: str, req: Request) -> None:
        if req.cancelled:
            return  # cancelled before it was queued
        job = req.job
        req.arrived.add(g)
        self.parts[g][job] = req
        lock = self.locks[g]
        cap = req.seq
        if cap is None:  # a single waiter: the youngest set member ahead of it
            live = (w.set_seq or 0 for w in self.waits[g].values() if not w.picked)
            cap = max(live, default=0)
        older = [r for s, r in self.open_sets.items() if s < cap and g in r.groups]
        on_way = sum(1 for r in older if g not in r.arrived and not r.cancelled)
        queued = sum(1 for r in older if r.job in self.waits[g])
        wait = Wait(self.now, lock.attached_waiters, set_seq=req.seq)
        wait.older_on_way, wait.older_all = on_way, on_way + queued
        self.waits[g][job] = wait
        self.bind(g, lock.on_acquire(job, set_seq=req.seq, now=self.now))
        if job in self.waits[g] and isinstance(lock.policy, policy.FairShare):
            wait.fair_bound = lock.policy.passes_bound(job, self.jobs)

    def cancel(self, req: Request) -> None:
        """The caller goes away: as ``set_acquire._withdraw``."""
        if req.cancelled or len(req.granted) == len(req.groups):
            return  # granted everything already
        self.cancels += 1
        req.cancelled = True
        for g in req.groups:
            if g in req.granted:
                req.yields_left += 1
                self.post(g, functools.partial(self.yielded, g, req))
            elif g in req.arrived and g not in req.departed:
                self.post(g, functools.partial(self.depart, g, req))
        if req.yields_left == 0:
            self.finish(req)

    def evict(self) -> None:
        """An operator evicts a waiter: its part fails, so its whole set does."""
        g = self.rng.choice(self.groups)
        waiting = [j for j, w in self.waits[g].items() if not w.picked]
        if waiting:
            out = self.locks[g].on_evict(self.rng.choice(waiting), why="operator", now=self.now)
            assert out.role is decisions.Role.WAITER, out
            self.bind(g, out.actions)
        if not self.closed:
            self.at(self.now + self.rng.expovariate(1 / 8), self.evict)

    def aborted(self, g: str, job: str) -> None:
        del self.waits[g][job]
        req = self.left(g, job)
        self.evictions += 1
        self.cancel(req)  # set_acquire withdraws the other parts

    def left(self, g: str, job: str) -> Request:
        """``job``'s part leaves ``g`` (cancelled or evicted), kept for or not."""
        req = self.parts[g].pop(job)
        req.departed.add(g)
        if self.committed.get(g) == job:
            del self.committed[g]
        return req

    def depart(self, g: str, req: Request) -> None:
        job = req.job
        if g in req.departed:
            return  # evicted meanwhile
        self.left(g, job)
        lock = self.locks[g]
        epoch = req.granted.get(g)
        if epoch is not None:  # granted before its departure ran: never delivered
            self.holder[g] = None
            self.bind(g, lock.on_undelivered(job, epoch=epoch, now=self.now))
        else:  # still waiting, or its own switch runs
            del self.waits[g][job]
            self.bind(g, lock.on_cancel(job, now=self.now))

    def release(self, req: Request) -> None:
        assert not req.cancelled
        for g in req.groups:
            req.yields_left += 1
            self.post(g, functools.partial(self.yielded, g, req))

    def yielded(self, g: str, req: Request) -> None:
        job = req.job
        assert self.holder[g] == job, (g, job, self.holder[g])
        self.holder[g] = None
        del self.parts[g][job]
        out = self.locks[g].on_yield(job, now=self.now)
        assert out.ok, (g, job, out)
        self.bind(g, out.actions)
        req.yields_left -= 1
        if req.yields_left == 0:
            self.finish(req)

    def finish(self, req: Request) -> None:
        """The request is over (released, or withdrawn): close its set, pause."""
        if req.seq is not None:
            self.coordinator.close(req.seq)
            del self.open_sets[req.seq]
        self.jobs[req.job].request = None
        if not self.closed:
            pause = self.rng.expovariate(1 / self.jobs[req.job].gap)
            self.at(self.now + pause, functools.partial(self.start, req.job))

    # ---- the run ----------------------------------------------------------------------------

    def drain(self, g: str, drain: bool) -> None:
        """An operator drains ``g`` for a while (no new turn), then resumes it."""
        self.bind(g, self.locks[g].on_drain(drain, now=self.now))
        if drain:
            self.post(g, functools.partial(self.drain, g, False), delay=self.rng.uniform(0.5, 3))
        elif not self.closed:
            self.at(self.now + self.rng.expovariate(1 / 15), functools.partial(self.drain, g, True))

    def switch_done(self, g: str, epoch: int) -> None:
        lock = self.locks[g]
        sw = lock.switching
        assert sw is not None and sw.epoch == epoch, (g, sw, epoch)  # nothing else ends one
        self.target[g] = None
        lock.on_switch_measured(sw.from_job, sw.to_job, seconds=self.jobs[sw.to_job].switch)
        self.bind(g, lock.on_switch_done(epoch=epoch, restored=True, now=self.now))

    def step(self) -> bool:
        if not self.heap:
            return False
        t, _, event = heapq.heappop(self.heap)
        self.now = max(self.now, t)
        event()
        self.check()
        return True

    def check(self) -> None:
        for g, lock in self.locks.items():
            assert lock.holder in (None, self.holder[g], self.target[g]), g
            sw = lock.switching
            assert sw is None or sw.to_job == self.target[g], (g, sw, self.target[g])

    def run(self, horizon: float) -> None:
        for job in self.jobs:
            self.at(self.rng.uniform(0, 1), functools.partial(self.start, job))
        self.at(self.rng.expovariate(1 / 8), self.evict)
        for g in self.groups:
            self.at(self.rng.expovariate(1 / 15), functools.partial(self.drain, g, True))
        while self.heap and self.now < horizon:
            self.step()
        self.closed = True  # no new requests: everybody waiting must be granted
        while self.step():
            pass
        stuck = {g: lock.waiting_jobs for g, lock in self.locks.items() if lock.waiting_jobs}
        assert not stuck, f"waiters never granted (deadlock): {stuck}"
        assert not self.coordinator.waiting(), self.coordinator.waiting()
        assert all(lock.reserved_for is None for lock in self.locks.values())
        assert all(j.request is None for j in self.jobs.values())
        assert self.set_grants > 0


def is_member(wait: Wait) -> bool:
    return wait.set_seq is not None


def fifo_bound(c: Cluster, g: str, job: str, wait: Wait) -> None:
    assert len(wait.passes) <= wait.ahead + wait.older_on_way, (g, job, wait)


def after(limit: float, wait: Wait) -> int:
    return sum(1 for t in wait.passes if t >= limit)


def priority_bound(c: Cluster, g: str, job: str, wait: Wait) -> None:
    pol = c.locks[g].policy
    assert isinstance(pol, policy.Priority)
    late = after(wait.since + pol.aging_bound_s(job), wait)
    assert late <= len(c.jobs) - 1, (g, job, pol.priority(job), wait)


def fair_bound(c: Cluster, g: str, job: str, wait: Wait) -> None:
    assert wait.ranked_passes <= wait.fair_bound, (g, job, wait)
    if is_member(wait):
        assert len(wait.passes) <= wait.fair_bound + wait.older_all, (g, job, wait)


def cost_bound(c: Cluster, g: str, job: str, wait: Wait) -> None:
    pol = c.locks[g].policy
    assert isinstance(pol, policy.CostAware)
    assert after(wait.since + pol.settings.max_defer_s, wait) <= len(c.jobs) - 1, (g, job, wait)


def tight_weights(rng: random.Random, jobs: int) -> policy.FairShareSpec:
    """Weights with little credit for a job that comes back: its bound is tight."""
    spec = bounds.CASES["fair-share"][0](rng, jobs)
    assert isinstance(spec, policy.FairShareSpec)
    return dataclasses.replace(spec, credit_s=rng.uniform(0, 2))


SPECS: dict[str, Callable[[random.Random, int], policy.PolicySpec]] = {
    **{kind: make for kind, (make, _) in bounds.CASES.items()},
    "fair-share": tight_weights,
}

BOUNDS: dict[str, Bound] = {
    "fifo": fifo_bound,
    "priority": priority_bound,
    "fair-share": fair_bound,
    "cost-aware": cost_bound,
}


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("kind", list(BOUNDS))
def test_random_sets_never_deadlock_nor_break_a_bound(kind: str, seed: int) -> None:
    rng = random.Random(f"sets-{kind}-{seed}")
    spec = SPECS[kind](rng, 12)
    cluster = Cluster(rng, spec, BOUNDS[kind])
    cluster.run(horizon=rng.uniform(40, 80))


def test_the_random_runs_reach_what_they_check() -> None:
    """The runs above are not passed vacuously: sets give up, groups serve older sets
    ahead of the policy's order, and a group free for a set is not counted while an
    older set's part is still on its way."""
    totals = {"cancels": 0, "evictions": 0, "out_of_order": 0, "held_back": 0, "let_through": 0}
    for kind, bound in BOUNDS.items():
        rng = random.Random(f"sets-{kind}-0")
        cluster = Cluster(rng, SPECS[kind](rng, 12), bound)
        cluster.run(horizon=40)
        for name in totals:
            totals[name] += getattr(cluster, name)
    assert all(totals.values()), totals
