"""The device claim of groups that share devices (orchestrator/group/overlap.py) and the lock."""

from __future__ import annotations

import logging
import random
import types
from typing import Any

import pytest

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import config
from tslice.orchestrator.group import coordination, lock, overlap
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.switch import plan
from tslice.rpc import refusals


def node(name: str, *devices: int) -> config.NodeRef:
    return config.NodeRef(name, f"{name}:9001", tuple(devices) if devices else None)


def test_groups_overlap_where_a_node_is_shared_and_the_devices_intersect() -> None:
    assert overlap.overlap([node("a")], [node("a")]) == ("a",)
    assert overlap.overlap([node("a", 0, 1)], [node("a", 1, 2)]) == ("a",)
    assert overlap.overlap([node("a", 0, 1)], [node("a", 2, 3)]) == ()
    assert overlap.overlap([node("a", 0)], [node("a")]) == ("a",)  # no indices: all of them
    assert overlap.overlap([node("a"), node("b")], [node("b"), node("c")]) == ("b",)
    assert overlap.overlap([node("a")], [node("b")]) == ()


class Member:
    """A group as the arbiter tells it: what it is told is recorded, not posted."""

    def __init__(self, arbiter: Arbiter, group: str) -> None:
        self._arbiter, self._group = arbiter, group

    def claim_granted(self, job: str) -> None:
        self._arbiter.granted.append((self._group, job))

    def claim_contended(self) -> None:
        self._arbiter.contended.append(self._group)

    def devices_shared(self) -> tuple[bool, str | None]:
        self._arbiter.shared.append(self._group)
        return False, None  # (the groups join before anything is granted)

    def holder(self) -> str | None:
        return None  # (the groups join before anything is granted)


class Arbiter:
    """A DeviceArbiter whose members record what they are told."""

    def __init__(self, groups: dict[str, tuple[config.NodeRef, ...]]) -> None:
        self.arbiter = overlap.DeviceArbiter()
        self.granted: list[tuple[str, str]] = []
        self.contended: list[str] = []
        self.shared: list[str] = []
        for group, nodes in groups.items():
            self.arbiter.join(group, nodes, Member(self, group))


def test_overlapping_groups_take_turns_and_an_idle_holder_is_asked_to_let_go() -> None:
    a = Arbiter({"s": (node("n"),), "t": (node("n"),), "u": (node("m"),)})
    arb = a.arbiter
    assert arb.conflicts("s") == {"t"} and arb.conflicts("u") == set()
    assert arb.request("s", "job-1") == "job-1"
    assert arb.request("u", "job-2") == "job-2"  # shares nothing: side by side
    assert arb.request("t", "job-2") is None
    assert a.contended == ["s"]
    arb.note_holder("s", None)  # s's holder yielded; it keeps the claim idle
    assert arb.request("t", "job-2") is None  # an idle claim blocks too, until let go
    arb.release("s")
    assert a.granted == [("t", "job-2")]
    assert arb.released("s") == set()  # t holds now: nothing of t's may give way to s
    assert arb.released("t") == {"s"}  # s let go: its residents may give way to t


def test_one_job_may_hold_overlapping_groups_together() -> None:
    a = Arbiter({"s": (node("n"),), "t": (node("n"),)})
    assert a.arbiter.request("s", "job-1") == "job-1"
    assert a.arbiter.request("t", "job-1") == "job-1"
    assert a.contended == []


def test_a_job_that_holds_a_group_passes_waiters_it_would_otherwise_deadlock_on() -> None:
    # g1 and g3 share nothing; g2 shares devices with both.
    groups = {"g1": (node("n1"), node("n2")), "g2": (node("n2"), node("n3")), "g3": (node("n3"),)}
    a = Arbiter(groups)
    arb = a.arbiter
    assert arb.request("g1", "job-2") == "job-2"
    arb.note_holder("g3", None)
    assert arb.request("g2", "job-1") is None  # waits for g1 (job-2)
    # job-2 holds g1 and asks for g3: behind g2's waiter it would wait forever.
    assert arb.request("g3", "job-2") == "job-2"


def test_a_waiting_group_gets_the_claim_once_its_blocker_holds_it_for_the_same_job() -> None:
    # A set's two groups share devices: the second asks first, while the first still
    # keeps its claim idle for its last holder; the first then takes it for the same
    # job (its own part of the set). Nothing else would wake the second: the first lets
    # go only when the job yields, which waits for the second (a deadlock).
    a = Arbiter({"o1": (node("n", 0, 1),), "o2": (node("n", 1),)})
    arb = a.arbiter
    assert arb.request("o1", "job-2") == "job-2"
    arb.note_holder("o1", None)  # job-2 yielded: o1 keeps its claim idle
    assert arb.request("o2", "job-3") is None  # blocked by o1's idle claim
    assert arb.request("o1", "job-3") == "job-3"
    assert a.granted == [("o2", "job-3")]


def test_fifo_among_overlapping_waiters_for_jobs_that_hold_nothing() -> None:
    a = Arbiter({"s": (node("n"),), "t": (node("n"),), "u": (node("n"),)})
    arb = a.arbiter
    assert arb.request("s", "job-1") == "job-1"
    assert arb.request("t", "job-2") is None
    assert arb.request("u", "job-3") is None
    arb.release("s")
    assert a.granted == [("t", "job-2")]
    # t's new claim is wanted by u: t is told, so it lets go at its next release.
    assert "t" in a.contended
    arb.release("t")
    assert a.granted == [("t", "job-2"), ("u", "job-3")]


def test_random_requests_never_give_two_jobs_overlapping_claims() -> None:
    rng = random.Random(7)
    names = ["g1", "g2", "g3", "g4"]
    groups = {g: (node(f"n{i}"), node(f"n{(i + 1) % 4}")) for i, g in enumerate(names)}
    a = Arbiter(groups)
    arb = a.arbiter
    holding: dict[str, str] = {}
    for _ in range(2000):
        group, job = rng.choice(names), rng.choice(["a", "b", "c"])
        if group in holding and rng.random() < 0.5:
            arb.release(group)
            del holding[group]
        elif group not in holding:
            got = arb.request(group, job)
            if got is not None:
                holding[group] = got
        for g, j in a.granted:
            holding[g] = j
        a.granted.clear()
        for g, j in holding.items():
            for other in arb.conflicts(g):
                assert holding.get(other) in (None, j), (g, j, other, holding)


def test_a_group_that_takes_its_idle_claim_for_a_new_job_lets_go_for_an_earlier_waiter() -> None:
    # Seen in a chaos run: p3 (both nodes) waits, blocked by p1; p2 holds its claim for
    # a job p3 does not wait on, then takes it for another job of its own queue. That
    # claim blocks p3 now: p2 must hear it (and let go at its next release), or p3
    # waits for ever, and every group behind p3 with it (FIFO).
    a = Arbiter({"p1": (node("n1"),), "p2": (node("n2"),), "p3": (node("n1"), node("n2"))})
    arb = a.arbiter
    assert arb.request("p2", "job-1") == "job-1"
    assert arb.request("p1", "job-0") == "job-0"
    assert arb.request("p3", "job-1") is None  # blocked by p1's claim for job-0
    arb.note_holder("p2", None)  # job-1 left p2; its claim idle
    a.contended.clear()
    assert arb.request("p2", "job-2") == "job-2"  # nothing holds what p2 needs
    assert a.contended == ["p2"]  # but p3, waiting, needs p2's devices now
    arb.release("p1")
    assert a.granted == []
    arb.release("p2")  # job-2 yielded; p2 was told: it lets go
    assert a.granted == [("p3", "job-1")]


class ClaimingGroups:
    """Groups that do with the claim what the lock does: keep it idle after their job
    yields, let go at once when told they are contended while idle, and at their
    holder's release when told while held."""

    def __init__(self, groups: dict[str, tuple[config.NodeRef, ...]]) -> None:
        self.told = Arbiter(groups)
        self.arbiter = self.told.arbiter
        self.holding: dict[str, str] = {}
        self.claimed: set[str] = set()  # held for its holder, or idle
        self.waiting: set[str] = set()
        self.contended: set[str] = set()

    def acquire(self, group: str, job: str) -> None:
        got = self.arbiter.request(group, job)
        if got is None:
            self.waiting.add(group)
            self.claimed.discard(group)
        else:
            self.holding[group] = got
            self.claimed.add(group)
        self._settle()

    def yield_(self, group: str) -> None:
        del self.holding[group]
        self.arbiter.note_holder(group, None)
        if group in self.contended:
            self._release(group)
        self._settle()

    def _release(self, group: str) -> None:
        self.claimed.discard(group)
        self.contended.discard(group)
        self.arbiter.release(group)

    def _settle(self) -> None:
        told = self.told
        while told.granted or told.contended:
            for g, j in told.granted:
                self.holding[g] = j
                self.claimed.add(g)
                self.waiting.discard(g)
            told.granted.clear()
            contended, told.contended[:] = list(told.contended), []
            for g in contended:
                if g in self.claimed and g not in self.holding:
                    self._release(g)
                elif g in self.claimed:
                    self.contended.add(g)


def test_waiting_groups_are_granted_once_every_job_has_yielded() -> None:
    # Liveness, on random requests: once every job has yielded, no group may still wait.
    names = ["g1", "g2", "g3", "g4"]
    groups = {g: (node(f"n{i}"), node(f"n{(i + 1) % 4}")) for i, g in enumerate(names)}
    for seed in range(40):
        rng = random.Random(seed)
        model = ClaimingGroups(groups)
        for _ in range(300):
            group = rng.choice(names)
            if group in model.holding:
                model.yield_(group)
            elif group not in model.waiting:
                model.acquire(group, rng.choice(["a", "b", "c"]))
        for _ in range(len(names) * 4):  # every job yields, and whoever is granted too
            for group in list(model.holding):
                model.yield_(group)
        assert not model.waiting, (seed, model.waiting)


class Inbox:
    """A group's executor as the arbiter posts to it: commands kept, applied by the test."""

    def __init__(self) -> None:
        self.posted: list[tuple[Any, tuple[Any, ...]]] = []

    def post(self, command: Any, *args: Any) -> None:
        self.posted.append((command, args))


class Groups:
    """Real locks with their real ``Coordination`` on one arbiter; claims asked at once."""

    def __init__(self, groups: dict[str, tuple[config.NodeRef, ...]]) -> None:
        self.arbiter = overlap.DeviceArbiter()
        services = types.SimpleNamespace(arbiter=self.arbiter)
        self.locks: dict[str, lock.GroupLock] = {}
        self.coords: dict[str, coordination.Coordination] = {}
        self.inboxes: dict[str, Inbox] = {}
        for gid, nodes in groups.items():
            lk = lock.GroupLock()
            coord = coordination.Coordination(gid, lk, services, {})  # type: ignore[arg-type]
            self.inboxes[gid] = coord.executor = Inbox()  # type: ignore[assignment]
            coord.shared = self.arbiter.join(gid, nodes, coord)
            lk.start_claim(None, exclusive=not coord.shared)
            self.locks[gid], self.coords[gid] = lk, coord

    def apply(self, gid: str, actions: list[Any]) -> list[Any]:
        """The lock's actions, with its claim asked for as the executor asks."""
        out = []
        for action in actions:
            if isinstance(action, decisions.NeedClaim):
                out += self.apply(gid, self.coords[gid].claim(action, 0.0))
            else:
                out.append(action)
        return out


def test_a_claim_grant_that_arrives_after_the_group_asked_again_is_ignored() -> None:
    # The arbiter grants g the claim for J (a posted command); before g applies it, J
    # leaves, K comes and goes (g asks for K and waits behind h). The late grant for J
    # must not make g's lock believe it holds the claim: J coming back would be
    # switched in while the arbiter counts g as waiting, and m (sharing n2 with g) could
    # be given the claim for a job that holds o meanwhile: two jobs on n2's devices.
    net = Groups(
        {
            "h": (node("n1"),),
            "g": (node("n1"), node("n2")),
            "m": (node("n2"),),
            "o": (node("n3"),),  # shares nothing: L holds it without asking
        }
    )
    arb, locks = net.arbiter, net.locks
    assert arb.request("h", "J") == "J"
    assert arb.request("m", "X") == "X"
    net.apply("o", locks["o"].on_acquire("L", now=0.0))
    locks["o"].on_switch_done(epoch=1, restored=False, now=0.0)
    net.apply("g", locks["g"].on_acquire("J", now=0.0))  # waits: m holds for X
    arb.release("m")  # g's turn: granted for J, posted
    late = list(net.inboxes["g"].posted)
    assert [args for _, args in late] == [("J",)]
    net.apply("g", locks["g"].on_cancel("J", now=0.0))
    net.apply("g", locks["g"].on_acquire("K", now=0.0))  # asks for K: waits behind h
    net.apply("g", locks["g"].on_cancel("K", now=0.0))
    for command, args in late:
        net.apply("g", command(0.0, *args))
    net.apply("g", locks["g"].on_acquire("J", now=0.0))
    net.apply("m", locks["m"].on_acquire("L", now=0.0))
    busy = {gid: lk.holder for gid, lk in locks.items() if lk.holder is not None}
    for gid, job in busy.items():
        assert gid in ("o", "h") or arb.holds(gid, job), (gid, job, busy)
        for other in arb.conflicts(gid):
            assert busy.get(other) in (None, job), (gid, job, other, busy)


def test_the_lock_grants_only_with_the_claim_for_that_job() -> None:
    lk = lock.GroupLock()
    lk.start_claim(None)
    actions = lk.on_acquire("a", now=0.0)
    assert decisions.NeedClaim("a") in actions
    assert not any(isinstance(x, (decisions.StartSwitch, decisions.Granted)) for x in actions)
    actions = lk.on_claim_granted("a", now=0.0)
    assert [type(x) for x in actions] == [decisions.StartSwitch]
    lk.on_switch_done(epoch=1, restored=False, now=0.0)
    lk.on_yield("a", now=0.0)
    # Idle with a verified resident: a zero-cost re-acquire needs no new claim ...
    assert [type(x) for x in lk.on_acquire("a", now=0.0)] == [decisions.Granted]
    lk.on_yield("a", now=0.0)
    # ... but another job needs one, and another group asking makes it let go.
    assert decisions.NeedClaim("b") in lk.on_acquire("b", now=0.0)
    assert lk.on_contended(now=0.0) == [decisions.ReleaseClaim()]
    assert not lk.verified  # the deferred resident may have been moved meanwhile


def test_a_contended_holder_lets_go_when_it_releases() -> None:
    lk = lock.GroupLock()
    lk.start_claim(None)
    lk.on_acquire("a", now=0.0)
    lk.on_claim_granted("a", now=0.0)
    lk.on_switch_done(epoch=1, restored=False, now=0.0)
    assert lk.on_contended(now=0.0) == []  # held: keep it until the holder is done
    outcome = lk.on_yield("a", now=0.0)
    assert decisions.ReleaseClaim() in outcome.actions


def test_a_blocked_lock_fails_its_waiters_and_starts_nothing() -> None:
    lk = lock.GroupLock()
    lk.on_acquire("a", now=0.0)
    lk.on_switch_done(epoch=1, restored=False, now=0.0)
    lk.on_acquire("b", now=0.0)
    actions = lk.on_blocked("node n degraded")
    assert actions == [decisions.Abort("b", "node n degraded", code=refusals.Code.UNAVAILABLE)]
    assert lk.on_acquire("c", now=0.0) == [
        decisions.Abort("c", "node n degraded", code=refusals.Code.UNAVAILABLE)
    ]
    outcome = lk.on_yield("a", now=0.0)
    assert not any(isinstance(x, decisions.StartSwitch) for x in outcome.actions)
    assert lk.on_unblocked(now=0.0) == []


def test_a_groups_state_on_a_node_it_left_is_stray_once_nobody_holds_it() -> None:
    # "t" left node "c" (its label taken off): it spans "a" now; "s" still spans "c".
    a = Arbiter({"s": (node("c"),), "t": (node("a"),)})
    arb = a.arbiter
    assert not arb.stray("a", "t")  # its own node
    assert arb.request("t", "job-d") == "job-d"
    assert not arb.stray("c", "t")  # held: its holder may still run there
    arb.note_holder("t", None)  # yielded, the claim kept idle
    assert arb.stray("c", "t")
    assert arb.stray("c", "gone")  # a group nobody runs any more
    arb.stopped("u", "job-x")  # stopped (its nodes all gone) with a holder: kept
    assert not arb.stray("c", "u")
    arb.stopped("t", None)
    assert arb.stray("c", "t") and arb.stray("a", "t")


def test_the_groups_a_node_belongs_to_follow_joins_and_departures() -> None:
    a = Arbiter({"s": (node("c"),), "t": (node("a"), node("c"))})
    arb = a.arbiter
    homes = arb.homes  # (a plan keeps this mapping: it changes in place)
    assert homes == {"c": {"s", "t"}, "a": {"t"}}
    arb.join("t", (node("a"),), Member(a, "t"))  # "t" left node "c"
    assert homes == {"c": {"s"}, "a": {"t"}}
    assert arb.stray("c", "t")  # (nobody holds it)
    arb.forget("s")
    assert homes == {"a": {"t"}}
    arb.join("u", (node("c"),), Member(a, "u"))
    assert homes == {"c": {"u"}, "a": {"t"}}


def test_a_grant_lists_the_residents_that_give_way_sorted_and_only_those() -> None:
    # On node "c": "s" shares the devices and has no holder (it gives way), "t" is at
    # home there and holds nothing to give, "gone" is stray (nobody runs it any more).
    a = Arbiter({"g": (node("c"),), "s": (node("c"),), "t": (node("c"),)})
    arb = a.arbiter
    p = plan.SwitchPlan(
        "g", "a", "b", 1, 0, {"c": frozenset({"s"})}, stray=arb.stray, homes=arb.homes
    )
    running, saved = pb.JOB_STATE_RUNNING, pb.JOB_STATE_SAVED
    others = {
        ("z", "s"): plan.JobView(running, "s"),
        ("y", "gone"): plan.JobView(running, "gone"),
        ("x", "t"): plan.JobView(running, "t"),
        ("w", "s"): plan.JobView(saved, "s"),  # not resident: nothing to move
    }
    expected = [pb.JobRef(job_id="y", group="gone"), pb.JobRef(job_id="z", group="s")]
    assert p.giving_way("c", others) == expected
    assert [k for k in others if p.may_give_way("c", k[1])] == [
        ("z", "s"),
        ("y", "gone"),
        ("w", "s"),
    ]
    # Without the arbiter's homes every group is asked, with the same answer.
    asked = plan.SwitchPlan("g", "a", "b", 1, 0, {"c": frozenset({"s"})}, stray=arb.stray)
    assert asked.giving_way("c", others) == expected


class Holding(Member):
    """A member whose lock holds ``job`` when it is told its devices are shared."""

    def __init__(self, arbiter: Arbiter, group: str, job: str | None) -> None:
        super().__init__(arbiter, group)
        self._job = job

    def devices_shared(self) -> tuple[bool, str | None]:
        self._arbiter.shared.append(self._group)
        return self._job is not None, self._job


def test_a_group_alone_holds_its_devices_until_one_that_shares_them_joins() -> None:
    a = Arbiter({})
    arb = a.arbiter
    # Alone: it never asks (its lock holds the claim for anybody).
    assert arb.join("s", (node("n"),), Holding(a, "s", "job-a")) is False
    assert arb.join("u", (node("m"),), Holding(a, "u", None)) is False
    assert a.shared == []
    # A group sharing its devices joins: told at once, and its holder keeps the claim.
    assert arb.join("t", (node("n"),), Member(a, "t")) is True
    assert a.shared == ["s"]
    assert arb.request("t", "job-b") is None
    assert a.contended == ["s"]
    arb.note_holder("s", None)  # job-a yields: s keeps the claim idle...
    arb.release("s")  # ...until it lets go, asked
    assert a.granted == [("t", "job-b")]
    # A group left alone when the other goes is not told again: it goes on asking.
    arb.forget("t")
    assert arb.join("v", (node("n"),), Member(a, "v")) is True
    assert a.shared == ["s"]


def test_an_idle_group_that_was_alone_asks_for_its_devices_once_they_are_shared() -> None:
    # Seen in the HA chaos run: a new leader started g1 (alone when it joined, so it
    # never asked) with a yielded resident, job-9; g2, sharing a node, joined with its
    # holder job-8 from disk and took the claim for it. Kept "idle for the resident",
    # g1 then granted job-9 again at no cost, without asking: two jobs held groups that
    # share devices. Idle, it holds nothing once they are shared: job-9 must ask.
    lk = lock.GroupLock()
    lk.start_claim(None, exclusive=True)
    lk.on_acquire("job-9", now=0.0)
    lk.on_switch_done(epoch=1, restored=False, now=0.0)
    lk.on_yield("job-9", now=0.0)
    assert lk.resident == "job-9" and lk.holder is None
    assert lk.on_devices_shared() == (False, None)
    actions = lk.on_acquire("job-9", now=0.0)
    assert decisions.NeedClaim("job-9") in actions
    assert not any(isinstance(x, (decisions.StartSwitch, decisions.Granted)) for x in actions)
    # Granted the claim, it checks what is on the devices (another group may have moved
    # its resident meanwhile) before it grants.
    assert [type(x) for x in lk.on_claim_granted("job-9", now=0.0, shared=True)] == [
        decisions.StartSwitch
    ]


def test_a_group_that_was_alone_keeps_the_claim_for_its_holder_once_devices_are_shared() -> None:
    lk = lock.GroupLock()
    lk.start_claim(None, exclusive=True)
    lk.on_acquire("job-9", now=0.0)
    lk.on_switch_done(epoch=1, restored=False, now=0.0)
    assert lk.on_devices_shared() == (True, "job-9")
    assert lk.on_contended(now=0.0) == []  # held: kept until the holder is done
    assert decisions.ReleaseClaim() in lk.on_yield("job-9", now=0.0).actions


def test_two_groups_back_with_holders_on_shared_devices_are_reported_and_grant_nobody_else(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # g1 and g2 did not overlap before the restart; now g2 names g1's devices too.
    a = Arbiter({"g1": (node("n", 0, 1),), "g2": (node("n", 1, 2),)})
    arb = a.arbiter
    arb.seize("g1", "job-a")
    assert not caplog.records
    with caplog.at_level(logging.ERROR, logger=overlap.__name__):
        arb.seize("g2", "job-b")
    [record] = caplog.records
    assert "g2 came back held by job-b" in record.getMessage()
    assert "g1 (held by job-a)" in record.getMessage()
    # job-a yields: g1's next waiter is not put beside job-b ...
    arb.release("g1")
    assert arb.request("g1", "job-c") is None
    assert a.granted == []
    # ... until job-b has yielded too.
    arb.release("g2")
    assert a.granted == [("g1", "job-c")]
