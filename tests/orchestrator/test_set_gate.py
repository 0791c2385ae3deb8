"""AcquireSet on the pure locks: set_gate (each group's side) and sets.SetCoordinator.

The groups are wired as their drivers wire them: a lock's ``NeedSet`` goes to
``coordinator.ready`` at once, the coordinator's answer is posted to the group's
inbox and runs later (``pump``) as ``lock.on_set_ready``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest

from tslice.orchestrator import policy
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock as lk
from tslice.orchestrator.sets import coordinator as sets


class _Member:
    """A group as the set coordinator tells it: recorded by the test."""

    def __init__(self, posted: Callable[[str, str, int], None], group: str) -> None:
        self._posted, self._group = posted, group

    def set_ready(self, job: str, seq: int) -> None:
        self._posted(self._group, job, seq)


class Groups:
    def __init__(self, *names: str, build: policy.PolicySpec | None = None) -> None:
        self.coordinator = sets.SetCoordinator()
        self.locks: dict[str, lk.GroupLock] = {}
        self.inbox: collections.deque[tuple[str, str, int]] = collections.deque()
        #: Every action the locks decided, per group.
        self.log: dict[str, list[decisions.Action]] = {g: [] for g in names}
        self.now = 0.0
        for g in names:
            pol = policy.build(build) if build is not None else None
            self.locks[g] = lk.GroupLock(policy=pol)
            self.coordinator.join(g, _Member(self.posted, g))

    def posted(self, g: str, job: str, seq: int) -> None:
        self.inbox.append((g, job, seq))

    def bind(self, g: str, actions: list[decisions.Action]) -> list[decisions.Action]:
        """As the driver: a group kept for a set reports ready, or lets a waiter that
        holds another group go first (``SetCoordinator.passer``)."""
        self.log[g] += actions
        out = list(actions)
        for a in actions:
            if isinstance(a, decisions.NeedSet):
                holders = {h: lock.holder for h, lock in self.locks.items()}
                passing = self.coordinator.passer(g, a.set_seq, a.others, holders)
                if passing is None:
                    self.coordinator.ready(g, a.job, a.set_seq)
                else:
                    self.coordinator.withdraw(g)
                    out += self.bind(g, self.locks[g].on_set_passed(passing, now=self.tick()))
        return out

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def acquire(self, g: str, job: str, seq: int | None = None) -> list[decisions.Action]:
        return self.bind(g, self.locks[g].on_acquire(job, set_seq=seq, now=self.tick()))

    def done(self, g: str) -> list[decisions.Action]:
        """The switch in progress at ``g`` completes."""
        sw = self.locks[g].switching
        assert sw is not None, g
        return self.bind(
            g, self.locks[g].on_switch_done(epoch=sw.epoch, restored=True, now=self.tick())
        )

    def hold(self, g: str, job: str) -> None:
        """``job`` acquires the free group ``g`` alone and is granted."""
        self.acquire(g, job)
        self.done(g)
        assert self.locks[g].holder == job

    def yield_(self, g: str, job: str) -> list[decisions.Action]:
        out = self.locks[g].on_yield(job, now=self.tick())
        assert out.ok
        return self.bind(g, out.actions)

    def cancel(self, g: str, job: str) -> list[decisions.Action]:
        return self.bind(g, self.locks[g].on_cancel(job, now=self.tick()))

    def pump(self) -> dict[str, list[decisions.Action]]:
        """Run what the coordinator posted, in order; the actions per group."""
        out: dict[str, list[decisions.Action]] = collections.defaultdict(list)
        while self.inbox:
            g, job, seq = self.inbox.popleft()
            out[g] += self.bind(g, self.locks[g].on_set_ready(job, set_seq=seq, now=self.tick()))
        return dict(out)

    def switching_to(self, g: str) -> str | None:
        sw = self.locks[g].switching
        return None if sw is None else sw.to_job

    def open(self, job: str, *groups: str) -> int:
        return self.coordinator.open(job, groups)


def switches(actions: list[decisions.Action]) -> list[str]:
    return [a.to_job for a in actions if isinstance(a, decisions.StartSwitch)]


def needs(actions: list[decisions.Action]) -> list[tuple[str, int]]:
    """The sets this group reported ready for."""
    return [(a.job, a.set_seq) for a in actions if isinstance(a, decisions.NeedSet)]


def grants(actions: list[decisions.Action]) -> list[str]:
    return [a.job for a in actions if isinstance(a, decisions.Granted) and not a.held]


def test_a_member_is_not_granted_before_every_group_is_ready() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    seq = gs.open("a", "g1", "g2")
    first = gs.acquire("g1", "a", seq)
    assert needs(first) == [("a", seq)]
    assert not switches(first) and not grants(first)
    assert gs.locks["g1"].reserved_for == ("a", seq)
    gs.acquire("g2", "a", seq)
    assert gs.pump() == {} and gs.switching_to("g1") is None  # g2 is still held
    gs.yield_("g2", "x")
    out = gs.pump()
    assert switches(out["g1"]) == ["a"] and switches(out["g2"]) == ["a"]
    gs.done("g1")
    gs.done("g2")
    assert gs.locks["g1"].holder == gs.locks["g2"].holder == "a"


def test_a_reserved_group_grants_no_later_single_waiter() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    seq = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", seq)
    gs.acquire("g2", "a", seq)
    single = gs.acquire("g1", "s")
    assert not switches(single) and gs.switching_to("g1") is None
    assert gs.locks["g1"].reserved_for == ("a", seq)
    gs.yield_("g2", "x")
    gs.pump()
    assert gs.switching_to("g1") == "a"
    gs.done("g1")
    assert switches(gs.yield_("g1", "a")) == ["s"]  # then the single waiter


def test_the_group_reserves_for_the_oldest_set_even_when_the_policy_ranks_a_younger_first() -> None:
    spec = policy.PrioritySpec(aging_s=1e6, priorities={"b": 9})
    gs = Groups("g1", "g2", "g3", build=spec)
    gs.hold("g1", "x")
    gs.hold("g3", "y")
    old = gs.open("a", "g1", "g2")
    young = gs.open("b", "g1", "g3")
    gs.acquire("g1", "a", old)
    gs.acquire("g1", "b", young)
    assert gs.locks["g1"].next_waiter(now=gs.now) == "b"  # the policy's head
    out = gs.yield_("g1", "x")
    assert needs(out) == [("a", old)] and gs.locks["g1"].reserved_for == ("a", old)
    gs.acquire("g2", "a", old)
    assert switches(gs.pump()["g1"]) == ["a"]


def test_a_member_that_leaves_frees_the_reservation_and_the_next_is_promoted() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    a = gs.open("a", "g1", "g2")
    b = gs.open("b", "g1", "g2")
    gs.acquire("g1", "a", a)
    gs.acquire("g1", "b", b)
    gs.acquire("g1", "s")
    assert gs.locks["g1"].reserved_for == ("a", a)
    out = gs.cancel("g1", "a")
    assert needs(out) == [("b", b)] and gs.locks["g1"].reserved_for == ("b", b)
    evicted = gs.locks["g1"].on_evict("b", why="operator", now=gs.tick())
    gs.bind("g1", evicted.actions)
    assert evicted.role is decisions.Role.WAITER
    assert switches(evicted.actions) == ["s"]  # nobody kept for: the single waiter
    assert gs.locks["g1"].reserved_for is None


def test_a_member_that_is_the_yielded_resident_is_not_granted_at_no_cost_before_its_set() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g1", "a")
    gs.yield_("g1", "a")
    assert gs.locks["g1"].loaded_job == "a"  # granting it again would cost nothing
    gs.hold("g2", "x")
    seq = gs.open("a", "g1", "g2")
    out = gs.acquire("g1", "a", seq)
    assert not grants(out) and needs(out) == [("a", seq)]
    gs.acquire("g2", "a", seq)
    gs.yield_("g2", "x")
    ready = gs.pump()
    assert grants(ready["g1"]) == ["a"]  # now at no cost, with the set
    assert next(a for a in ready["g1"] if isinstance(a, decisions.Granted)).zero_cost


def test_on_set_ready_for_a_stale_set_grants_nobody() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    old = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", old)
    gs.cancel("g1", "a")
    gs.coordinator.close(old)
    new = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", new)
    lock = gs.locks["g1"]
    for job, stale in (("a", old), ("a", new + 1), ("a", sets.closed(old)), ("b", -1)):
        out = gs.bind("g1", lock.on_set_ready(job, set_seq=stale, now=gs.tick()))
        assert not switches(out) and not grants(out) and lock.switching is None
    assert lock.reserved_for == ("a", new)


@pytest.mark.parametrize(
    ("busy", "arrivals"),
    [
        # g1 is held meanwhile: every part is queued before it is free.
        (True, [("g1", "a"), ("g2", "a"), ("g2", "b"), ("g1", "b")]),
        # Parts held up on the way (a node read first): b reaches g1 before a does,
        # a reaches g2 before b does. Before the fix g1 stayed kept for b, g2 for a.
        (False, [("g1", "b"), ("g2", "a"), ("g1", "a"), ("g2", "b")]),
    ],
    ids=["queued", "reaching-groups-in-opposite-orders"],
)
def test_two_sets_naming_the_same_groups_in_opposite_orders_both_complete(
    busy: bool, arrivals: list[tuple[str, str]]
) -> None:
    gs = Groups("g1", "g2")
    if busy:
        gs.hold("g1", "x")
    seqs = {"a": gs.open("a", "g1", "g2"), "b": gs.open("b", "g2", "g1")}
    for g, job in arrivals:
        gs.acquire(g, job, seqs[job])
    if busy:
        gs.yield_("g1", "x")
    for job in ("a", "b"):  # the older set first
        out = gs.pump()
        assert switches(out["g1"]) == [job] and switches(out["g2"]) == [job]
        for g in ("g1", "g2"):
            gs.done(g)
        gs.coordinator.close(seqs[job])
        for g in ("g1", "g2"):
            gs.yield_(g, job)


def test_a_group_kept_for_a_younger_set_waits_until_an_older_one_closes() -> None:
    """g1 is free for b, but a (older, naming g1) has not reached it yet: g1 is not
    counted ready for b while a may still come; when a ends without coming, g1 is."""
    gs = Groups("g1", "g2")
    a = gs.open("a", "g1", "g2")
    b = gs.open("b", "g1", "g2")
    gs.acquire("g2", "a", a)
    gs.acquire("g1", "b", b)
    gs.acquire("g2", "b", b)
    assert gs.pump() == {}
    assert [(s, j, sorted(r)) for s, j, _, r in gs.coordinator.waiting()] == [
        (a, "a", ["g2"]),
        (b, "b", []),
    ]
    gs.cancel("g2", "a")  # a gives up before its part reached g1
    gs.coordinator.close(a)
    out = gs.pump()
    assert switches(out["g1"]) == ["b"] and switches(out["g2"]) == ["b"]


def test_a_set_that_ends_ungranted_lets_another_acquire_of_its_job_wait_alone() -> None:
    """w waits for g1 alone and in a set (one entry, kept for the set); the set is
    cancelled: g1 is kept for it no longer and w's own Acquire is granted (before the
    fix g1 stayed kept for the closed set forever)."""
    gs = Groups("g1", "g2")
    gs.hold("g1", "h1")
    gs.hold("g2", "h2")
    gs.acquire("g1", "w")  # w's own Acquire of g1 ...
    seq = gs.open("w", "g1", "g2")
    gs.acquire("g1", "w", seq)  # ... and its set's part there: the same entry
    gs.acquire("g2", "w", seq)
    gs.yield_("g1", "h1")
    assert gs.pump() == {} and gs.locks["g1"].reserved_for == ("w", seq)
    gs.cancel("g1", "w")  # set_acquire withdraws the set's parts, then closes it
    gs.cancel("g2", "w")
    gs.coordinator.close(seq)
    assert gs.inbox == collections.deque([("g1", "w", sets.closed(seq)), ("g2", "w", -seq)])
    out = gs.pump()
    assert switches(out["g1"]) == ["w"] and gs.locks["g1"].reserved_for is None


def test_a_job_that_holds_a_group_goes_past_a_group_kept_for_a_set() -> None:
    """z takes g1 then g2, x takes g2 then g3 (one order); the set of s waits for g1.
    Kept out of g3, x would wait for s, s for z, z for x: let through, x goes on."""
    gs = Groups("g1", "g2", "g3")
    gs.hold("g1", "z")
    gs.hold("g2", "x")
    seq = gs.open("s", "g1", "g3")
    gs.acquire("g1", "s", seq)
    gs.acquire("g3", "s", seq)  # g3 is free: kept for s
    assert gs.locks["g3"].reserved_for == ("s", seq)
    assert switches(gs.acquire("g3", "x")) == ["x"]  # x holds g2 (no group of the set)
    assert switches(gs.acquire("g3", "y")) == []  # one that holds nothing waits
    gs.done("g3")
    gs.acquire("g2", "z")
    gs.yield_("g3", "x")  # g3 is kept for s again, ahead of y
    assert gs.locks["g3"].reserved_for == ("s", seq)
    assert switches(gs.yield_("g2", "x")) == ["z"]
    gs.done("g2")
    gs.yield_("g1", "z")
    out = gs.pump()
    assert switches(out["g1"]) == ["s"] and switches(out["g3"]) == ["s"]


def test_nobody_goes_past_a_set_once_it_is_granted() -> None:
    gs = Groups("g1", "g2")
    seq = gs.open("s", "g1", "g2")
    holders = {"g1": None, "g2": "x"}
    assert gs.coordinator.passer("g1", seq, ("y", "x"), holders) == "x"
    assert gs.coordinator.passer("g2", seq, ("x",), holders) is None  # x holds only g2
    gs.acquire("g1", "s", seq)
    gs.acquire("g2", "s", seq)  # granted now
    assert gs.coordinator.passer("g1", seq, ("x",), holders) is None


def test_a_group_drained_after_it_was_counted_ready_does_not_split_its_set() -> None:
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    seq = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", seq)  # g1 is free: kept for a, counted ready
    gs.acquire("g2", "a", seq)
    for a in gs.bind("g1", gs.locks["g1"].on_drain(True, now=gs.tick())):
        if isinstance(a, decisions.NotReady):  # as the driver does
            gs.coordinator.withdraw("g1")
    gs.yield_("g2", "x")
    out = gs.pump()
    assert not switches(out.get("g1", [])) and not switches(out.get("g2", []))
    gs.bind("g1", gs.locks["g1"].on_drain(False, now=gs.tick()))  # resumed: both at once
    out = gs.pump()
    assert switches(out["g1"]) == ["a"] and switches(out["g2"]) == ["a"]


def test_a_set_granted_before_the_drain_is_still_granted_by_the_drained_group() -> None:
    gs = Groups("g1", "g2")
    seq = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", seq)
    gs.acquire("g2", "a", seq)  # granted: on its way to both inboxes
    gs.bind("g1", gs.locks["g1"].on_drain(True, now=gs.tick()))
    out = gs.pump()
    assert switches(out["g1"]) == ["a"] and switches(out["g2"]) == ["a"]


def test_a_set_part_reaching_its_jobs_abandoned_switch_waits_for_its_set() -> None:
    """a's Acquire of g1 left during its own switch; a's AcquireSet comes back before
    that switch ends: the part must not take the switch over (g1 would be a's alone)."""
    gs = Groups("g1", "g2")
    gs.hold("g2", "x")
    gs.acquire("g1", "a")
    assert gs.switching_to("g1") == "a"
    gs.cancel("g1", "a")  # left during its own switch
    seq = gs.open("a", "g1", "g2")
    gs.acquire("g1", "a", seq)
    gs.acquire("g2", "a", seq)
    assert not grants(gs.done("g1")) and gs.locks["g1"].holder is None
    assert gs.locks["g1"].reserved_for == ("a", seq)
    gs.yield_("g2", "x")
    out = gs.pump()
    assert grants(out["g1"]) == ["a"] and switches(out["g2"]) == ["a"]
