"""Groups that share physical devices take turns: the device claim.

Two groups *overlap* when some node is in both and the device indices they name on
it intersect (a node that names no indices means all of its devices). In local mode
every group spans every device of every agent, so all local groups overlap.

A job's state is per (job, group), so a switch on one group never touches another
group's state. But two holders of overlapping groups would compute on the same
devices at once, so an overlapping group grants a job only while it holds the
*device claim* for that job, and overlapping groups hold it together only for the
same job (one job may hold a sampler and a trainer group that share GPUs: nobody
else is on them). A group keeps its claim while it has a holder (or a switch); an
idle group keeps it too, so that its yielded resident re-acquires for free, until
an overlapping group asks for it: then it lets go at once, and its deferred
resident becomes fair game (the other group's Grant lists it in ``give_way``, and
the agent snapshots it only if the devices are needed). The state a group left on a
node that is no longer one of its nodes (Kubernetes mode: a label taken off) is *stray*
and gives way the same, once nobody holds the group (or the group is gone, unless it
stopped with a holder). A group with a holder lets
go when the holder releases, even if it has waiters of its own: they ask again and
queue behind, so overlapping groups alternate. A group that comes to hold the claim for
another job (or idle) while an overlapping group waits is told so at once: a waiter asks
only once, and nothing else would make that group let go. Waiting is FIFO among overlapping
groups, except that a job which already holds a group (a nested or multi-group
acquire) goes first: it would otherwise wait behind waiters that wait for what it
holds. Multi-group acquires in a fixed order cannot deadlock through this module;
they can through the topology itself when groups overlap in a cycle that the order
does not follow (g1 and g3 taken in that order, while g3 shares devices with g4 and
g4 with g5, and g5 with g1): an all-or-nothing multi-group acquire would be the cure.

A group that shares no devices with any other holds them *exclusively*: for anybody,
without asking (a grant costs it nothing here). When a group joins that shares them, the
exclusive one is told at once (:meth:`Member.devices_shared`: it keeps the claim for its
holder, or while it switches; idle, it keeps none, since the newcomer may take the claim
at once for a holder of its own found on disk) and asks per job from then on; a group
left alone by the others' leaving simply goes on asking.

:class:`DeviceArbiter` is the bookkeeping; it tells a group's driver what concerns it
through the driver's :class:`Member` methods, which post commands to the group's
executor, so every state change of a group still happens in its own batch (the switch to
asking per job, which decides nothing, is made at once).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Protocol

from tslice.orchestrator import config

log = logging.getLogger(__name__)


def overlap(a: Iterable[config.NodeRef], b: Iterable[config.NodeRef]) -> tuple[str, ...]:
    """Names of the nodes on which the two groups share devices."""
    by_name = {n.name: n for n in a}
    shared: list[str] = []
    for node in b:
        other = by_name.get(node.name)
        if other is None:
            continue
        if other.devices is None or node.devices is None or set(other.devices) & set(node.devices):
            shared.append(node.name)
    return tuple(shared)


class Member(Protocol):
    """A group as the arbiter tells it (each method posts a command to the group)."""

    def claim_granted(self, job: str) -> None:
        """The group holds the claim for ``job`` now."""

    def claim_contended(self) -> None:
        """Somebody waits for the group's claim."""

    def devices_shared(self) -> tuple[bool, str | None]:
        """Another group shares the group's devices now: from now on the group asks for
        the claim per job. Whether it holds the claim (for its holder, or while it
        switches: None), and for whom; changed at once, before anything else can ask."""

    def holder(self) -> str | None:
        """Who holds the group now (or is being switched in), read at once."""


@dataclasses.dataclass
class _Member:
    nodes: tuple[config.NodeRef, ...]
    group: Member
    #: The nodes' names: every Grant asks whether a resident's group has its node.
    node_names: frozenset[str] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.node_names = frozenset(n.name for n in self.nodes)


class DeviceArbiter:
    """Who holds the device claim among overlapping groups (see the module docstring)."""

    def __init__(self) -> None:
        self._members: dict[str, _Member] = {}
        self._conflicts: dict[str, set[str]] = {}
        #: Groups holding the claim, with the job they hold it for (None: idle).
        self._claims: dict[str, str | None] = {}
        #: (group, job, the group's other waiters) waiting for the claim, in request order.
        self._waiting: list[tuple[str, str, tuple[str, ...]]] = []
        #: Groups that stopped (every node gone) with a holder: their state stays.
        self._stopped_holders: dict[str, str] = {}
        #: Groups that share no devices: they hold them for anybody and never ask.
        self._exclusive: set[str] = set()
        #: Per node, the groups it belongs to (their state there is never :meth:`stray`),
        #: kept up to date in place: a switch's plan reads it for every resident.
        self.homes: dict[str, frozenset[str]] = {}

    def join(self, group: str, nodes: tuple[config.NodeRef, ...], member: Member) -> bool:
        """Add a group (``member`` is told what concerns it); whether it shares devices
        with another. A group that shares none holds its devices *exclusively*: for
        anybody, without asking (nor telling its holder). Once another group shares them,
        it is told at once (:meth:`Member.devices_shared`) and asks per job from then on;
        it keeps the claim only for its holder (or a switch in flight)."""
        self._stopped_holders.pop(group, None)
        for other in self._conflicts.get(group, ()):  # (back from a restart: anew)
            self._conflicts[other].discard(group)
        self._members[group] = _Member(nodes, member)
        self._rehome()
        self._conflicts[group] = set()
        for other, joined in self._members.items():
            if other != group and overlap(nodes, joined.nodes):
                self._conflicts[group].add(other)
                self._conflicts[other].add(group)
        for other in sorted(self._conflicts[group] & self._exclusive):
            self._exclusive.discard(other)
            held, job = self._members[other].group.devices_shared()
            if held:
                self._claims[other] = job
        if self._conflicts[group]:
            return True
        self._exclusive.add(group)
        return False

    def leave(self, group: str, *, restarting: bool = False) -> None:
        """The group stops. ``restarting``: it comes back at once (on new nodes) and keeps
        what it holds meanwhile (its claim, its place among the groups it shares devices
        with), so that no waiter of theirs is granted on devices its holder still uses;
        :meth:`join` takes it back."""
        self._exclusive.discard(group)
        self._waiting = [w for w in self._waiting if w[0] != group]
        if not restarting:
            self.release(group)

    def stopped(self, group: str, holder: str | None) -> None:
        """The group stopped (its nodes all gone; Kubernetes mode), ``holder`` holding it:
        its state on those nodes is not stray while it does."""
        self.forget(group)
        if holder is not None:
            self._stopped_holders[group] = holder

    def forget(self, group: str) -> None:
        """The group is gone for good (an idle local group collected): drop it."""
        self.leave(group)
        self._members.pop(group, None)
        self._rehome()
        for other in self._conflicts.pop(group, set()):
            self._conflicts[other].discard(group)

    # ---- queries ---------------------------------------------------------------------------

    def conflicts(self, group: str) -> frozenset[str]:
        """The groups that share devices with ``group`` on some node."""
        return frozenset(self._conflicts.get(group, ()))

    def shared_nodes(self, group: str, other: str) -> tuple[str, ...]:
        return overlap(self._members[group].nodes, self._members[other].nodes)

    def released(self, group: str) -> frozenset[str]:
        """Overlapping groups that do not hold the claim: their residents may give way."""
        return frozenset(c for c in self._conflicts.get(group, ()) if c not in self._claims)

    def holds(self, group: str, job: str | None) -> bool:
        """Whether ``group`` holds the claim for ``job`` now."""
        return group in self._claims and self._claims[group] == job

    def stray(self, node: str, group: str) -> bool:
        """Whether ``group``'s state on ``node`` is left over: ``node`` is not one of the
        group's nodes (any more, or the group is gone) and nobody holds the group."""
        member = self._members.get(group)
        if member is None:
            return group not in self._stopped_holders
        if node in member.node_names:
            return False
        if group in self._exclusive and group not in self._claims:
            return member.group.holder() is None  # (it never asks: its holder says)
        return self._claims.get(group) is None

    def _rehome(self) -> None:
        # A group joined (or came back on other nodes) or went: rare, so rebuilt whole.
        homes: dict[str, set[str]] = {}
        for group, member in self._members.items():
            for name in member.node_names:
                homes.setdefault(name, set()).add(group)
        self.homes.clear()
        self.homes.update((name, frozenset(groups)) for name, groups in homes.items())

    # ---- changes ---------------------------------------------------------------------------

    def request(self, group: str, job: str, others: Sequence[str] = ()) -> str | None:
        """May ``group`` grant ``job`` now? The job it may grant, else ``None`` and
        ``granted(job)`` is posted later.

        ``others`` are the group's other waiters, in queue order: one of them that
        already holds a group (a nested or multi-group acquire) may be granted past a
        blocked ``job``, which may well wait for what that holder will release. Asking
        again keeps the group's place in line. A group asking anew gives up the claim
        it holds idle, so that two idle groups asking for each other's claim never wait
        on each other.
        """
        if group in self._claims:
            if not self._blockers(group, job):
                self._claims[group] = job
                # Held for ``job`` now: a group waiting for the claim for the same job
                # (another group of its set, a nested acquire) may be blocked no more.
                self._grant_waiting(asking=group)
                self._tell_if_wanted(group)
                return job
            del self._claims[group]
        for i, (g, _, _) in enumerate(self._waiting):
            if g == group:
                self._waiting[i] = (group, job, tuple(others))
                break
        else:
            self._waiting.append((group, job, tuple(others)))
        self._grant_waiting(asking=group)
        if group in self._claims:
            return self._claims[group]
        for other in self._blockers(group, job):
            self._members[other].group.claim_contended()
        return None

    def seize(self, group: str, job: str) -> None:
        """Take the claim for a holder found on disk after a restart, whatever else holds.

        Two overlapping groups both back with holders (only after a topology change that
        made them overlap, or an earlier violation) are reported, not undone: both jobs
        are on the devices already, and a holder is only ever told it lost its grant at
        its next call. Each keeps its claim, so neither group grants anybody else until
        both holders have let go: nothing new is put on the devices meanwhile."""
        self._waiting = [w for w in self._waiting if w[0] != group]
        blockers = self._blockers(group, job)
        if blockers:
            held = ", ".join(
                f"{other} (held by {self._claims[other]})"
                if self._claims[other]
                else f"{other} (claimed, with no holder)"
                for other in blockers
            )
            log.error(
                "group %s came back held by %s, but it shares devices with %s: jobs of "
                "both may be on the same devices. Neither group grants anybody else until "
                "both have let go; check the topology (a group's devices changed?) and have "
                "one of the jobs yield",
                group,
                job,
                held,
                extra={"group_id": group, "job_id": job},
            )
        self._claims[group] = job

    def note_holder(self, group: str, job: str | None) -> None:
        """The group's holder changed (``None``: it keeps its claim idle)."""
        if group in self._claims and self._claims[group] != job:
            self._claims[group] = job
            self._tell_if_wanted(group)

    def release(self, group: str) -> None:
        if self._claims.pop(group, "") != "":
            self._grant_waiting()

    # ---- internals -------------------------------------------------------------------------

    def _blockers(self, group: str, job: str) -> list[str]:
        """Overlapping groups holding the claim for anybody but ``job`` (idle ones too)."""
        return sorted(
            c for c in self._conflicts[group] if c in self._claims and self._claims[c] != job
        )

    def _grant_waiting(self, *, asking: str = "") -> None:
        granted: list[tuple[str, str]] = []
        blocked: set[str] = set()
        for entry in list(self._waiting):
            group, job, others = entry
            conflicts = self._conflicts[group]
            # FIFO among overlapping waiters: nobody jumps an earlier one it conflicts with,
            # except a job that already holds a group (a nested or multi-group acquire).
            free = not self._blockers(group, job) and not (conflicts & blocked)
            if free or self._nested(group, job):
                chosen: str | None = job
            else:
                chosen = next((o for o in others if self._nested(group, o)), None)
            if chosen is None:
                blocked.add(group)
                continue
            self._waiting.remove(entry)
            self._claims[group] = chosen
            granted.append((group, chosen))
        for group, job in granted:
            if group != asking:  # the asking group learns it from request()'s answer
                self._members[group].group.claim_granted(job)
        for group, _ in granted:
            self._tell_if_wanted(group)

    def _tell_if_wanted(self, group: str) -> None:
        """``group`` holds the claim for a new job (or idle): a group still waiting that
        shares its devices may be blocked by it now, so it lets go at its next release.
        Nothing else would: a waiter asks (and makes its blockers let go) only once."""
        conflicts = self._conflicts[group]
        if any(waiter in conflicts for waiter, _, _ in self._waiting):
            self._members[group].group.claim_contended()

    def _nested(self, group: str, job: str) -> bool:
        """``job`` holds some group's claim and nobody else blocks ``group`` for it.

        A job that holds a group while it waits for another must not wait behind
        waiters that may themselves wait for what it holds (hold-and-wait plus FIFO
        would deadlock), so it goes first.
        """
        held = any(j == job for j in self._claims.values()) or any(
            self._members[g].group.holder() == job for g in self._exclusive
        )
        return held and not self._blockers(group, job)
