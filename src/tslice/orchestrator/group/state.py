"""What a group's lock keeps: its state, its record for the store, its read-only views.

``group.lock`` decides (its ``on_*`` methods change this state); :class:`LockState` is its
base. Vocabulary as there (holder, resident, verified, attached and detached queue
entries). The state's plain fields (``holder``, ``resident``, ``verified``,
``grant_epoch``, ``switch``, ``queue``, ``attached_waiters``...) are read directly by the
group; only the lock changes them.

Every change to the queue goes through :meth:`LockState._enqueue`, :meth:`_dequeue` and
:meth:`_attach`, which keep the count of attached waiters and note what a save must
write (:meth:`LockState.changes`): an arrival costs O(1), in memory and on disk, however
long the queue.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterator
from typing import TypeVar

from tslice.orchestrator import policy as sched
from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import found_holder
from tslice.orchestrator.persistence import records
from tslice.orchestrator.sets import gate

_L = TypeVar("_L", bound="LockState")

#: Evicted jobs remembered (until they acquire again), so that a late Yield is told why.
_EVICTIONS_KEPT = 64


class Phase(enum.Enum):
    """Group state as derived from the lock alone (the driver adds UNKNOWN)."""

    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


@dataclasses.dataclass
class Entry:
    job: str
    seq: int
    queued_at: float
    #: Acquire RPCs of the job waiting now (0: detached, or about to leave).
    attached: int
    #: Set for entries restored after a crash until an Acquire re-attaches them.
    detached_since: float | None = None


@dataclasses.dataclass
class Switch:
    from_job: str | None
    to_job: str
    epoch: int
    seq: int
    queued_at: float
    attached: int
    recovered: bool = False
    #: The target left (cancelled or yielded): after the switch it is a yielded resident.
    departed: bool = False


@dataclasses.dataclass
class Claim:
    held: bool = True
    #: The job it is held for (None: any).
    job: str | None = None
    #: A waiter it was just granted for (possibly past the head of the queue).
    chosen: str | None = None
    #: Another group waits for it: let go at the next release.
    contended: bool = False

    def allows(self, job: str) -> bool:
        return self.held and self.job in (None, job)


class LockState:
    """The lock's state; changed by :class:`~tslice.orchestrator.group.lock.GroupLock` only."""

    def __init__(
        self,
        *,
        reattach_grace_s: float = 30.0,
        wall_offset_s: float = 0.0,
        policy: sched.Policy | None = None,
    ) -> None:
        self._grace = reattach_grace_s
        #: Wall clock minus the callers' ``now``: deadlines on disk are wall-clock times,
        #: so that they survive a restart (the monotonic clock does not).
        self._wall_offset = wall_offset_s
        #: Who owns the lock (while switching: the switch's target), and whose state is on
        #: the devices; ``verified``: confirmed on every node (a switch, or the agents read).
        self.holder: str | None = None
        self.resident: str | None = None
        self.verified = False
        self.grant_epoch = 0
        self.switch_count = 0
        self._next_seq = 1
        #: The waiters by job; insertion order is their order (seq).
        self.queue: dict[str, Entry] = {}
        #: Entries with an Acquire RPC waiting now.
        self.attached_waiters = 0
        #: The switch in progress (None: none).
        self.switch: Switch | None = None
        self.footprints: dict[str, int] = {}
        #: lease_ms of each job's latest Acquire (0 = no lease); see holder_lease_ms.
        self._leases: dict[str, int] = {}
        self.recovering = False
        #: Whether the holder is (being) found on the agents (a lost record).
        self._search = found_holder.HolderSearch()
        # Delivery tracking of the current grant: how many Acquire RPCs received it
        # and how many of those were cancelled before the reply went out.
        self._receivers = 0
        self._undelivered = 0
        # Of those, how many were answered: a set's part is answered only once its whole
        # set is (on_set_answered). A grant nobody was answered is unclaimed on disk, and
        # its lease waits for the answer (the job cannot open a Hold stream before).
        self._answered = 0
        # A grant made by a recovered switch (never delivered: unclaimed) is kept until
        # then for its job to re-attach; persisted, so a restart does not extend it.
        self._confirm_deadline: float | None = None
        self._recovered_at: float | None = None
        self.detail = ""
        #: The device claim (see overlap). A lock on its own holds it for anybody; a
        #: driver starts without it (start_claim) unless it has a holder.
        self._claim = Claim()
        #: Set members among the waiters (AcquireSet), and whom the group keeps itself for.
        self._sets = gate.SetGate()
        #: A single waiter let past the member the group is kept for (on_set_passed).
        self._set_pass: str | None = None
        #: Why no switch may start (a degraded node); "" = none.
        self.blocked = ""
        #: Why no switch may start for now: a node cannot park what it would move out
        #: (issue 20 §2); "" = none. Tried again (on_parking_retry) after a backoff of
        #: ``unparkable_tries`` switches found so in a row.
        self.unparkable = ""
        self.unparkable_tries = 0
        #: An administrator drained the group: no new turn is granted (persisted).
        self.draining = False
        #: Jobs an administrator evicted -> the message they get (see on_evict).
        self._evicted: dict[str, str] = {}
        #: Who of the live waiters goes next (see tslice.orchestrator.policy).
        self._policy = policy if policy is not None else sched.Policy()
        self._policy_given = policy is not None
        #: The driver calls on_expire at wake_at: only then may the policy keep an idle
        #: group for its resident (a hold needs a wake-up to end).
        self._woken = False
        self._wake_at: float | None = None
        #: Queue entries and footprints changed since the last save (None: the entry left).
        self._unsaved_entries: dict[str, Entry | None] = {}
        self._unsaved_footprints: set[str] = set()

    def _from_record(self, record: records.LockRecord, *, now: float) -> None:
        """The state a record describes, every queue entry detached (after a restart)."""
        offset = self._wall_offset
        self.holder = record.holder
        self.resident = record.resident
        self.grant_epoch = record.grant_epoch
        self.switch_count = record.switch_count
        self._next_seq = record.next_seq
        self.footprints = dict(record.footprints)
        self.draining = record.draining
        self._evicted = dict(record.evictions)
        # The lease on disk is the holder's, or while switching the target's.
        leased = record.intent.to_job if record.intent is not None else record.holder
        if leased is not None and record.holder_lease_ms > 0:
            self._leases[leased] = record.holder_lease_ms
        for q in sorted(record.queue, key=lambda q: q.seq):
            since = now if q.queued_at is None else min(now, q.queued_at - offset)
            self.queue[q.job] = Entry(q.job, q.seq, since, 0, detached_since=now)
            if q.footprint_bytes:
                self.footprints[q.job] = q.footprint_bytes
        if record.intent is not None:
            it = record.intent
            self.switch = Switch(
                it.from_job, it.to_job, it.epoch, it.seq, now, attached=0, recovered=True
            )
            self.holder = it.to_job
        self.recovering = True
        self._recovered_at = now
        self._search = found_holder.HolderSearch.of(record)

    # ---- construction from disk -----------------------------------------------------------

    @classmethod
    def from_record(
        cls: type[_L],
        record: records.LockRecord,
        *,
        now: float,
        reattach_grace_s: float = 30.0,
        wall_now: float | None = None,
        policy: sched.Policy | None = None,
    ) -> _L:
        """Rebuild after a restart: every queue entry is detached; recovery is pending.

        ``wall_now``: the wall clock at ``now`` (deadlines on disk are wall-clock times);
        None: ``now`` is itself the wall clock. Waits count from when the record says
        they began, where it says (otherwise from ``now``).
        """
        offset = 0.0 if wall_now is None else wall_now - now
        lock = cls(reattach_grace_s=reattach_grace_s, wall_offset_s=offset, policy=policy)
        lock._from_record(record, now=now)
        # A holder that was granted before the crash keeps the lock; its client got the
        # reply. One whose grant was never delivered keeps it only until its deadline
        # (not extended by this restart) unless an Acquire of it comes back; never more
        # than the grace from now (a wall clock set back across the restart).
        granted = lock.holder is not None and lock.switch is None
        unclaimed = record.holder_unclaimed_until
        if granted and unclaimed is not None:
            lock._confirm_deadline = min(unclaimed - offset, now + reattach_grace_s)
        lock._receivers = lock._answered = 1 if granted and unclaimed is None else 0
        return lock

    def use_policy(self, policy: sched.Policy, *, woken: bool = False) -> None:
        """Schedule with ``policy`` from now on. ``woken``: the driver calls
        :meth:`on_expire` at :attr:`wake_at`, so the policy may keep an idle group for
        its resident (cost-aware); without it the group never waits idle."""
        self._policy = policy
        self._policy_given = True
        self._woken = woken

    # ---- the queue (every change goes through here) -----------------------------------------

    def _enqueue(self, entry: Entry, *, first: bool = False) -> None:
        """``entry`` joins the queue (``first``: at its head, keeping its seq)."""
        if first:
            self.queue = {entry.job: entry, **self.queue}
        else:
            self.queue[entry.job] = entry
        if entry.attached > 0:
            self.attached_waiters += 1
        self._unsaved_entries[entry.job] = entry

    def _dequeue(self, job: str) -> Entry | None:
        entry = self.queue.pop(job, None)
        if entry is not None:
            if entry.attached > 0:
                self.attached_waiters -= 1
            self._unsaved_entries[job] = None
        return entry

    def _attach(self, entry: Entry, change: int) -> None:
        """One more (``change`` 1) or one less (-1) Acquire RPC of a queued job."""
        before = entry.attached
        entry.attached += change
        if before == 0 and entry.attached > 0:
            self.attached_waiters += 1
        elif before > 0 and entry.attached == 0:
            self.attached_waiters -= 1

    def _set_footprint(self, job: str, footprint_bytes: int) -> None:
        if self.footprints.get(job) != footprint_bytes:
            self.footprints[job] = footprint_bytes
            self._unsaved_footprints.add(job)
            if job in self.queue:
                self._unsaved_entries[job] = self.queue[job]

    # ---- changes every decision makes --------------------------------------------------------

    def _grant_to(self, job: str, now: float, *, attached: int, new_epoch: bool) -> None:
        # A switch's grant was numbered when the switch started (the epoch travels to
        # the agents in Grant); grants without a switch are numbered here.
        if new_epoch:
            self.grant_epoch += 1
        self.holder = job
        self._evicted.pop(job, None)  # (kept until then: a late Yield is told why)
        self._receivers = attached
        self._undelivered = 0
        self._answered = attached  # (less the parts of sets: on_granted_to_set_parts)
        self._confirm_deadline = None
        self._wake_at = None
        self._policy.granted(job, now=now)

    def _end_switch(self, epoch: int) -> Switch | None:
        """The switch of ``epoch`` ends (None: it is not the one in progress)."""
        s = self.switch
        if s is None or s.epoch != epoch:
            return None
        self.switch = None
        self.holder = None
        return s

    def _queue_first(self, s: Switch, *, detached_since: float | None = None) -> None:
        """The switch's target goes back to the head of the queue, keeping its place."""
        self._enqueue(Entry(s.to_job, s.seq, s.queued_at, s.attached, detached_since), first=True)

    def _remember_eviction(self, job: str, why: str) -> None:
        self._evicted.pop(job, None)
        self._evicted[job] = why
        while len(self._evicted) > _EVICTIONS_KEPT:
            del self._evicted[next(iter(self._evicted))]

    # ---- what a save writes -----------------------------------------------------------------

    def row(self) -> records.GroupRow:
        """The group's own fields, as persisted."""
        s = self.switch
        intent = None if s is None else records.IntentRecord(s.from_job, s.to_job, s.epoch, s.seq)
        holder = None if s is not None else self.holder
        # While switching, the target's lease: a switch rolled forward after a restart
        # grants it with that lease, so a target that is gone loses the lock in time.
        leased = s.to_job if s is not None else holder
        search = self._search
        return records.GroupRow(
            holder=holder,
            resident=self.resident,
            grant_epoch=self.grant_epoch,
            switch_count=self.switch_count,
            next_seq=self._next_seq,
            intent=intent,
            holder_lease_ms=self._leases.get(leased, 0) if leased is not None else 0,
            draining=self.draining,
            holder_unclaimed_until=self._unclaimed_until(holder),
            holder_from_agents=(search.pending or search.found is not None)
            and search.recorded(holder, self.grant_epoch),
            evictions=tuple(self._evicted.items()),
        )

    def changes(self, saved: records.GroupRow | None) -> records.Changes | None:
        """What changed since the last save (``saved``: the row it wrote; None: nothing
        did); forgotten here once taken (the caller saves it, retrying until durable)."""
        row = self.row()
        changed = None if row == saved else row
        entries, jobs = self._unsaved_entries, self._unsaved_footprints
        if not entries and not jobs:
            return None if changed is None else records.Changes(changed)
        self._unsaved_entries, self._unsaved_footprints = {}, set()
        queued: list[records.QueueRecord] = []
        left: list[str] = []
        for job, e in entries.items():
            if e is None:
                left.append(job)
            else:
                queued.append(self._queue_record(e))
        sizes: list[tuple[str, int]] = []
        for job in jobs:
            sizes.append((job, self.footprints[job]))
        return records.Changes(
            row=changed, queued=tuple(queued), left=tuple(left), footprints=tuple(sizes)
        )

    def record(self) -> records.LockRecord:
        """The whole record (O(queue): for recovery, the HA store and tests)."""
        return records.applied(
            records.LockRecord.empty(),
            records.Changes(
                row=self.row(),
                queued=tuple(self._queue_record(e) for e in self.queue.values()),
                footprints=tuple(self.footprints.items()),
            ),
        )

    def _queue_record(self, entry: Entry) -> records.QueueRecord:
        # When the wait began, wall clock, where the policy keeps it across a restart.
        since = entry.queued_at + self._wall_offset if self._policy.keeps_wait_times else None
        return records.QueueRecord(entry.job, entry.seq, self.footprints.get(entry.job, 0), since)

    def _unclaimed_until(self, holder: str | None) -> float | None:
        """The wall-clock deadline of a holder whose grant nobody received (None: claimed)."""
        if holder is None or self._answered > 0 or self._confirm_deadline is None:
            return None
        return self._confirm_deadline + self._wall_offset

    # ---- read-only views ------------------------------------------------------------------

    @property
    def active_job(self) -> str | None:
        """The job that should be resident: the switch target while switching."""
        return self.switch.to_job if self.switch is not None else self.resident

    @property
    def loaded_job(self) -> str | None:
        """The job verified resident on every node (none while switching)."""
        if self.switch is None and self.verified:
            return self.resident
        return None

    @property
    def provisional(self) -> bool:
        """The holder's grant went only to the parts of a set not answered yet."""
        return (
            self.holder is not None
            and self.switch is None
            and self._receivers > 0
            and self._answered == 0
        )

    @property
    def finding_holder(self) -> bool:
        """The record was lost and the agents not read yet: nobody knows who holds."""
        return self._search.pending

    @property
    def holder_epoch_unknown(self) -> bool:
        """The holder was found on the agents: its client's grant epoch is unknown."""
        return self.switch is None and self._search.epoch_unknown(self.holder, self.grant_epoch)

    @property
    def switching(self) -> act.StartSwitch | None:
        return None if self.switch is None else self._start_switch(self.switch)

    @property
    def waiting_jobs(self) -> list[str]:
        return list(self.queue)

    def waiting_since(self) -> list[float]:
        """When each of :attr:`waiting_jobs` started waiting, wall clock (status reads)."""
        return [e.queued_at + self._wall_offset for e in self.queue.values()]

    @property
    def holder_lease_ms(self) -> int:
        """The lease of the granted holder (0 = none, or no grant yet: switching)."""
        if self.holder is None or self.switch is not None:
            return 0
        return self._leases.get(self.holder, 0)

    @property
    def policy(self) -> sched.Policy:
        return self._policy

    @property
    def policy_configured(self) -> bool:
        """A policy was given (at construction or by ``use_policy``), not the default."""
        return self._policy_given

    @property
    def wake_at(self) -> float | None:
        """When the driver must call ``on_expire``: the policy keeps the idle group for
        its resident until then (None: no wake-up needed: no hold, or it is over, e.g.
        the waiters left or the resident was granted again)."""
        idle = self.holder is None and self.switch is None and self.attached_waiters > 0
        return self._wake_at if idle else None

    def next_waiter(self, *, now: float) -> str | None:
        """The live waiter the policy would promote next (None: nobody waits)."""
        ranked = self._ranked(now)
        return ranked[0].job if ranked else None

    def prefetch_advice(
        self, *, now: float, free_bytes: int, reserve_bytes: int = 0
    ) -> sched.Prefetch:
        """Should the next waiter's state start coming in now, while the holder holds?

        ``free_bytes``: device memory free beside the holder on the tightest node of
        the group; ``reserve_bytes``: what the holder may still allocate. See
        :func:`tslice.orchestrator.policy.should_prefetch`.
        """
        job = self.next_waiter(now=now)
        if job is None:
            return sched.Prefetch("", False, "nobody waits")
        holder = self.holder
        if holder is None or self.switch is not None:
            return sched.Prefetch(job, False, "no holder: the switch to it starts at once")
        phases = self._policy.phases
        expected = phases.expected(phases.holds, holder)
        since = phases.granted_at.get(holder)
        left = None if expected is None or since is None else max(0.0, expected - (now - since))
        start, why = sched.should_prefetch(
            switch_in_s=phases.switch_in_s(job, self.footprints),
            holder_left_s=left,
            free_bytes=free_bytes,
            footprint_bytes=self.footprint(job),
            reserve_bytes=reserve_bytes,
        )
        return sched.Prefetch(job, start, why)

    def eviction(self, job: str) -> str:
        """Why ``job`` was evicted, while it has not acquired again ("" = it was not)."""
        return self._evicted.get(job, "")

    def footprint(self, job: str) -> int:
        return self.footprints.get(job, 0)

    @property
    def claimed(self) -> bool:
        return self._claim.held

    @property
    def reserved_for(self) -> tuple[str, int] | None:
        """``(job, set)``: the set member the free group keeps itself for (AcquireSet)."""
        job = self._sets.reserved
        if job is None or self.holder is not None or self.switch is not None:
            return None
        return job, self._sets.members[job]

    def phase(self) -> Phase:
        if self.switch is not None:
            return Phase.SWITCHING
        if self.holder is not None:
            return Phase.LOCKED
        if self.resident is not None:
            return Phase.IDLE_YIELDED
        return Phase.IDLE

    def wants_switch(self, *, now: float) -> bool:
        """Is anybody still interested in the switch in progress (worth retrying)?"""
        s = self.switch
        if s is None:
            return False
        if s.attached > 0 or self.attached_waiters > 0:
            return True
        # A recovered switch whose target may still re-issue its Acquire.
        deadline = self.grace_deadline()
        return s.recovered and not s.departed and deadline is not None and now < deadline

    def expiry_deadlines(self) -> list[float]:
        """When :meth:`~tslice.orchestrator.group.lock.GroupLock.on_expire` has work, in
        order: the end of the grace, and the kept deadline of an unclaimed holder from disk."""
        grace = self.grace_deadline()
        return sorted({d for d in (grace, self._confirm_deadline) if d is not None})

    def grace_deadline(self) -> float | None:
        """When detached entries (and an unconfirmed recovered grant) expire."""
        if self._recovered_at is None:
            return None
        return self._recovered_at + self._grace

    def _view(self, now: float) -> sched.View:
        return sched.View(now, self.resident if self.verified else None, self.footprints)

    def _ranked(self, now: float) -> list[Entry]:
        """The live (attached) waiters in the order the policy grants them."""
        if not self.attached_waiters:
            return []
        waiting: list[Entry] = []
        for e in self.queue.values():
            if e.attached > 0:
                waiting.append(e)
        return self._policy.rank(waiting, self._view(now))

    def _start_switch(self, s: Switch) -> act.StartSwitch:
        return act.StartSwitch(s.from_job, s.to_job, s.epoch, self.footprint(s.to_job), s.recovered)


class Active(Collection[str]):
    """The jobs holding, switching in or waiting, as a policy reads them at an arrival: a
    view, so that an arrival costs nothing more for a policy that does not read it."""

    def __init__(self, lock: LockState) -> None:
        self._lock = lock

    def _busy(self) -> list[str]:
        s = self._lock.switch
        busy = [self._lock.holder, s.to_job if s is not None else None]
        return [j for j in busy if j is not None and j not in self._lock.queue]

    def __contains__(self, job: object) -> bool:
        return job in self._lock.queue or job in self._busy()

    def __iter__(self) -> Iterator[str]:
        yield from self._lock.queue
        yield from dict.fromkeys(self._busy())

    def __len__(self) -> int:
        return len(self._lock.queue) + len(set(self._busy()))
