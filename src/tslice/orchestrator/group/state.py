"""What a group's lock keeps, and what can be read from it (``tslice.orchestrator.group.lock``
decides; this module holds its state, its record for the store and its read-only views).

Nothing here changes the state: :class:`LockState` is the base of
:class:`~tslice.orchestrator.group.lock.GroupLock`, whose ``on_*`` methods do. Vocabulary as
there (holder, resident, verified, attached and detached queue entries).
"""

from __future__ import annotations

import dataclasses
import enum

from tslice.orchestrator import policy as sched
from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import found_holder
from tslice.orchestrator.persistence import records
from tslice.orchestrator.sets import gate as set_gate


class Phase(enum.Enum):
    """Group state as derived from the lock alone (the driver adds UNKNOWN)."""

    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


# ---- state ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Entry:
    job: str
    seq: int
    queued_at: float
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
    """The lock's state; read-only here (see :class:`~tslice.orchestrator.group.lock.GroupLock`)."""

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
        self._holder: str | None = None
        self._resident: str | None = None
        self._verified = False
        self._epoch = 0
        self._switch_count = 0
        self._next_seq = 1
        self._queue: dict[str, Entry] = {}  # insertion order == seq order
        self._switch: Switch | None = None
        self._footprints: dict[str, int] = {}
        #: lease_ms of each job's latest Acquire (0 = no lease); see holder_lease_ms.
        self._leases: dict[str, int] = {}
        self._recovering = False
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
        self._sets = set_gate.SetGate()
        #: A single waiter let past the member the group is kept for (on_set_passed).
        self._set_pass: str | None = None
        #: Why no switch may start (a degraded node); "" = none.
        self.blocked = ""
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

    def record(self) -> records.LockRecord:
        s = self._switch
        intent = None if s is None else records.IntentRecord(s.from_job, s.to_job, s.epoch, s.seq)
        holder = None if self._switch is not None else self._holder
        # While switching, the target's lease: a switch rolled forward after a restart
        # grants it with that lease, so a target that is gone loses the lock in time.
        leased = s.to_job if s is not None else holder
        return records.LockRecord(
            holder=holder,
            resident=self._resident,
            grant_epoch=self._epoch,
            switch_count=self._switch_count,
            next_seq=self._next_seq,
            queue=tuple(
                records.QueueRecord(e.job, e.seq, self._footprints.get(e.job, 0), self._since(e))
                for e in self._queue.values()
            ),
            intent=intent,
            footprints=tuple(sorted(self._footprints.items())),
            holder_lease_ms=self._leases.get(leased, 0) if leased is not None else 0,
            draining=self.draining,
            holder_unclaimed_until=self._unclaimed_until(holder),
            holder_from_agents=self._search.recorded(holder, self._epoch),
        )

    def _since(self, entry: Entry) -> float | None:
        """When ``entry`` started waiting, wall clock, where the policy keeps it."""
        return entry.queued_at + self._wall_offset if self._policy.keeps_wait_times else None

    def _unclaimed_until(self, holder: str | None) -> float | None:
        """The wall-clock deadline of a holder whose grant nobody received (None: claimed)."""
        if holder is None or self._answered > 0 or self._confirm_deadline is None:
            return None
        return self._confirm_deadline + self._wall_offset

    # ---- read-only views ------------------------------------------------------------------

    @property
    def holder(self) -> str | None:
        return self._holder

    @property
    def resident(self) -> str | None:
        return self._resident

    @property
    def active_job(self) -> str | None:
        """The job that should be resident: the switch target while switching."""
        return self._switch.to_job if self._switch is not None else self._resident

    @property
    def loaded_job(self) -> str | None:
        """The job verified resident on every node (none while switching)."""
        if self._switch is None and self._verified:
            return self._resident
        return None

    @property
    def verified(self) -> bool:
        return self._verified

    @property
    def provisional(self) -> bool:
        """The holder's grant went only to the parts of a set not answered yet."""
        return (
            self._holder is not None
            and self._switch is None
            and self._receivers > 0
            and self._answered == 0
        )

    @property
    def grant_epoch(self) -> int:
        return self._epoch

    @property
    def switch_count(self) -> int:
        return self._switch_count

    @property
    def recovering(self) -> bool:
        return self._recovering

    @property
    def finding_holder(self) -> bool:
        """The record was lost and the agents not read yet: nobody knows who holds."""
        return self._search.pending

    @property
    def holder_epoch_unknown(self) -> bool:
        """The holder was found on the agents: its client's grant epoch is unknown."""
        return self._switch is None and self._search.epoch_unknown(self._holder, self._epoch)

    @property
    def switching(self) -> act.StartSwitch | None:
        return None if self._switch is None else self._start_switch(self._switch)

    @property
    def waiting_jobs(self) -> list[str]:
        return list(self._queue)

    def waiting_since(self) -> list[float]:
        """When each of :attr:`waiting_jobs` started waiting, wall clock (status reads)."""
        return [e.queued_at + self._wall_offset for e in self._queue.values()]

    @property
    def attached_waiters(self) -> int:
        return sum(1 for e in self._queue.values() if e.attached > 0)

    @property
    def holder_lease_ms(self) -> int:
        """The lease of the granted holder (0 = none, or no grant yet: switching)."""
        if self._holder is None or self._switch is not None:
            return 0
        return self._leases.get(self._holder, 0)

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
        idle = self._holder is None and self._switch is None and self.attached_waiters > 0
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
        holder = self._holder
        if holder is None or self._switch is not None:
            return sched.Prefetch(job, False, "no holder: the switch to it starts at once")
        phases = self._policy.phases
        expected = phases.expected(phases.holds, holder)
        since = phases.granted_at.get(holder)
        left = None if expected is None or since is None else max(0.0, expected - (now - since))
        start, why = sched.should_prefetch(
            switch_in_s=phases.switch_in_s(job, self._footprints),
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
        return self._footprints.get(job, 0)

    @property
    def claimed(self) -> bool:
        return self._claim.held

    @property
    def reserved_for(self) -> tuple[str, int] | None:
        """``(job, set)``: the set member the free group keeps itself for (AcquireSet)."""
        job = self._sets.reserved
        if job is None or self._holder is not None or self._switch is not None:
            return None
        return job, self._sets.members[job]

    def phase(self) -> Phase:
        if self._switch is not None:
            return Phase.SWITCHING
        if self._holder is not None:
            return Phase.LOCKED
        if self._resident is not None:
            return Phase.IDLE_YIELDED
        return Phase.IDLE

    def wants_switch(self, *, now: float) -> bool:
        """Is anybody still interested in the switch in progress (worth retrying)?"""
        s = self._switch
        if s is None:
            return False
        if s.attached > 0 or self.attached_waiters > 0:
            return True
        # A recovered switch whose target may still re-issue its Acquire.
        deadline = self.grace_deadline()
        return s.recovered and not s.departed and deadline is not None and now < deadline

    def expiry_deadlines(self) -> list[float]:
        """When :meth:`~tslice.orchestrator.group.lock.GroupLock.on_expire` has work, in order:
        the end of the grace, and the kept deadline of an unclaimed holder from disk."""
        grace = self.grace_deadline()
        return sorted({d for d in (grace, self._confirm_deadline) if d is not None})

    def grace_deadline(self) -> float | None:
        """When detached entries (and an unconfirmed recovered grant) expire."""
        if self._recovered_at is None:
            return None
        return self._recovered_at + self._grace

    def _view(self, now: float) -> sched.View:
        return sched.View(now, self._resident if self._verified else None, self._footprints)

    def _ranked(self, now: float) -> list[Entry]:
        """The live (attached) waiters in the order the policy grants them."""
        waiting = [e for e in self._queue.values() if e.attached > 0]
        return self._policy.rank(waiting, self._view(now)) if waiting else []

    def _start_switch(self, s: Switch) -> act.StartSwitch:
        return act.StartSwitch(s.from_job, s.to_job, s.epoch, self.footprint(s.to_job), s.recovered)
