"""A hypothesis state machine of one group's lock (``tslice.orchestrator.group.lock.GroupLock``)
against a simple model: a FIFO queue of waiting jobs (each with its count of Acquire
RPCs), at most one holder, and at most one switch in progress (its target, epoch,
attached RPCs, whether its target left).

Every rule drives the lock as its driver would and applies the same event to the
model; after every step the lock must show exactly the model's holder, queue (in
order), switch target, resident and grant epoch, and hold the invariants: at most one
holder, no job both holder and waiter, every grant to the job the model expects (with
an Acquire waiting), and ``record()`` round-trips (a lock rebuilt from its record
records the same thing). A restart rule rebuilds the lock from its record, as the
driver does after a crash, and the queue must come back in order. An administrator
may evict a job (a holder loses the lock as a lapsed lease does, a waiter leaves the
queue, its Acquires aborted; a later Yield of the evicted job is refused) and drain
the group (no new turn: the model promotes nobody until it resumes; the mark survives
a restart).
"""

from __future__ import annotations

import dataclasses

from hypothesis import stateful
from hypothesis import strategies as st

from tests.fuzz.examples import fuzz_settings
from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import lock as lk

JOBS = st.sampled_from(["a", "b", "c", "d"])


@dataclasses.dataclass
class Switch:
    to_job: str
    epoch: int
    attached: int
    departed: bool = False


class LockMachine(stateful.RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.lock = lk.GroupLock(reattach_grace_s=10.0)
        self.now = 0.0
        # The model.
        self.queue: dict[str, int] = {}  # job -> attached RPCs, in FIFO order
        self.holder: str | None = None
        self.switch: Switch | None = None
        self.resident: str | None = None
        self.verified = False
        self.epoch = 0
        #: A degraded node's reason: no switch starts, new waiters are refused.
        self.blocked = ""
        #: RPCs of the holder that received its grant (for undelivered).
        self.receivers = 0
        self.undelivered_rpcs = 0
        #: An administrator drained the group: nobody is promoted (persisted).
        self.draining = False
        #: Jobs evicted since they were last granted -> why (in the record: a restart
        #: keeps them).
        self.evicted: dict[str, str] = {}

    # ---- the model's own rules --------------------------------------------------------

    def _promote(self) -> None:
        if self.holder is not None or self.switch is not None:
            return
        if not self.queue or self.blocked or self.draining:
            return
        job, attached = next(iter(self.queue.items()))
        del self.queue[job]
        self.epoch += 1
        self.holder = job
        if job == self.resident and self.verified:
            self.receivers, self.undelivered_rpcs = attached, 0
            self.evicted.pop(job, None)
        else:
            self.switch = Switch(job, self.epoch, attached)

    def _release(self) -> None:
        self.holder = None
        self.receivers = self.undelivered_rpcs = 0
        self._promote()

    def _apply(self, actions: list[act.Action]) -> None:
        """The lock's decisions agree with the model (which already moved)."""
        for a in actions:
            if isinstance(a, act.Granted):
                assert a.job == self.holder and self.switch is None, (a, self.holder)
                assert a.epoch == self.epoch, (a, self.epoch)
            elif isinstance(a, act.StartSwitch):
                assert self.switch is not None and a.to_job == self.switch.to_job, a
                assert a.epoch == self.switch.epoch == self.epoch, (a, self.switch)
            elif isinstance(a, (act.NeedClaim, act.ReleaseClaim)):
                raise AssertionError(f"a lone group never asks for the claim: {a}")

    @property
    def _now(self) -> float:
        self.now += 0.5
        return self.now

    # ---- rules --------------------------------------------------------------------------

    @stateful.rule(
        job=JOBS,
        footprint=st.sampled_from([0, 0, 1 << 30, 5 << 30]),
        lease=st.sampled_from([0, 0, 1500]),
    )
    def acquire(self, job: str, footprint: int = 0, lease: int = 0) -> None:
        s = self.switch
        granted_at_once = False
        if s is not None and s.to_job == job:
            s.attached += 1
            s.departed = False
            self.holder = job
        elif self.holder == job:
            self.receivers += 1
            granted_at_once = True
        elif self.blocked:
            pass  # refused (Abort) below
        elif job in self.queue:
            self.queue[job] += 1
        elif (
            self.holder is None
            and s is None
            and self.resident == job
            and self.verified
            and not self.queue
            and not self.draining
        ):
            self.epoch += 1
            self.holder = job
            self.receivers, self.undelivered_rpcs = 1, 0
            self.evicted.pop(job, None)
            granted_at_once = True
        else:
            self.queue[job] = 1
            self._promote()
        actions = self.lock.on_acquire(
            job, footprint_bytes=footprint, lease_ms=lease, now=self._now
        )
        grants = [a for a in actions if isinstance(a, act.Granted)]
        if granted_at_once:
            assert [g.job for g in grants] == [job], actions
        refused = [a.job for a in actions if isinstance(a, act.Abort)]
        own_switch = s is not None and s.to_job == job
        expected = [job] if self.blocked and not granted_at_once and not own_switch else []
        assert refused == expected, (actions, self.blocked)
        self._apply(actions)

    @stateful.rule(job=JOBS)
    def cancel(self, job: str) -> None:
        s = self.switch
        if s is not None and s.to_job == job and s.attached > 0:
            s.attached -= 1
            if s.attached == 0:
                s.departed = True
                self.holder = None
        elif self.queue.get(job, 0) > 0:
            self.queue[job] -= 1
            if self.queue[job] == 0:
                del self.queue[job]
        self._apply(self.lock.on_cancel(job, now=self._now))

    @stateful.rule(job=JOBS)
    def yield_(self, job: str) -> None:
        s = self.switch
        holder = self.holder
        ok = True
        if s is not None and s.to_job == job and not s.departed and holder == job:
            s.departed, s.attached = True, 0
            self.holder = None
        elif holder == job:
            self._release()
        elif holder is not None or job in self.evicted:
            ok = False
        outcome = self.lock.on_yield(job, now=self._now)
        assert outcome.ok == ok, (outcome, holder)
        if not ok:
            assert outcome.holder == holder
            assert outcome.evicted == self.evicted.get(job, "")
        self._apply(outcome.actions)

    @stateful.precondition(lambda self: self.switch is not None)
    @stateful.rule(restored=st.booleans())
    def switch_done(self, restored: bool) -> None:
        s = self.switch
        assert s is not None
        self.switch = None
        self.holder = None
        self.resident, self.verified = s.to_job, True
        if s.departed:
            self._promote()
        else:
            self.holder = s.to_job
            self.receivers, self.undelivered_rpcs = s.attached, 0
            self.evicted.pop(s.to_job, None)
        actions = self.lock.on_switch_done(epoch=s.epoch, restored=restored, now=self._now)
        self._apply(actions)

    @stateful.precondition(lambda self: self.switch is not None)
    @stateful.rule()
    def switch_failed(self) -> None:
        s = self.switch
        assert s is not None
        self.switch_failed_in_model(s)
        self._apply(self.lock.on_switch_failed(epoch=s.epoch, detail="fuzz", now=self._now))

    def switch_failed_in_model(self, s: Switch) -> None:
        self.switch = None
        self.holder = None
        self.resident, self.verified = s.to_job, False
        if s.attached > 0:
            self.queue = {s.to_job: s.attached, **self.queue}
        self._promote()

    @stateful.precondition(lambda self: self.switch is not None)
    @stateful.rule(mark=st.integers(0, 40))
    def stale_epoch(self, mark: int) -> None:
        """A node refused the switch's grant as stale (lost state): epochs go on past
        its mark, and the target is tried again at once (first in the queue)."""
        s = self.switch
        assert s is not None
        self.epoch = max(self.epoch, mark)
        self.switch_failed_in_model(s)
        self._apply(self.lock.on_stale_epoch(epoch=s.epoch, mark=mark, now=self._now))

    @stateful.precondition(lambda self: self.switch is not None)
    @stateful.rule()
    def degraded(self) -> None:
        """A node kept refusing the switch: it ends, every waiter (its own target too)
        is refused, and no switch starts until an operator clears the node."""
        s = self.switch
        assert s is not None
        self.blocked = "node-a degraded"
        self.switch_failed_in_model(s)
        aborted, self.queue = set(self.queue), {}
        actions = self.lock.on_degraded(
            epoch=s.epoch, cause="fuzz", reason=self.blocked, now=self._now
        )
        assert {a.job for a in actions if isinstance(a, act.Abort)} == aborted, actions
        self._apply(actions)

    @stateful.precondition(lambda self: bool(self.blocked))
    @stateful.rule()
    def cleared(self) -> None:
        self.blocked = ""
        self._promote()
        self._apply(self.lock.on_unblocked(now=self._now))

    @stateful.rule(epoch_offset=st.integers(-2, 1))
    def stale_switch_event(self, epoch_offset: int) -> None:
        """A switch outcome of another epoch (a late reply) changes nothing."""
        epoch = self.epoch + epoch_offset if epoch_offset else self.epoch - 3
        if self.switch is not None and epoch == self.switch.epoch:
            return
        assert self.lock.on_switch_done(epoch=epoch, restored=False, now=self._now) == []
        assert self.lock.on_switch_failed(epoch=epoch, detail="late", now=self._now) == []

    @stateful.precondition(lambda self: self.holder is not None and self.switch is None)
    @stateful.rule()
    def undelivered(self) -> None:
        """One RPC that received the grant was cancelled before the reply went out."""
        job, epoch = self.holder, self.epoch
        assert job is not None
        self.undelivered_rpcs += 1
        if self.undelivered_rpcs >= self.receivers:
            self._release()
        self._apply(self.lock.on_undelivered(job, epoch=epoch, now=self._now))

    @stateful.precondition(lambda self: self.holder is not None and self.switch is None)
    @stateful.rule()
    def lease_expired(self) -> None:
        job, epoch = self.holder, self.epoch
        assert job is not None
        self._release()
        self._apply(self.lock.on_lease_expired(job, epoch=epoch, now=self._now))

    @stateful.rule(job=JOBS)
    def evict(self, job: str) -> None:
        why = f"evicted {job}"
        s = self.switch
        role, aborted = None, False
        if self.holder == job:
            role, self.evicted[job] = act.Role.HOLDER, why
            if s is not None and s.to_job == job:
                s.departed, s.attached, self.holder, aborted = True, 0, None, True
            else:
                self._release()
        elif job in self.queue:
            role, self.evicted[job] = act.Role.WAITER, why
            aborted = self.queue.pop(job) > 0
        out = self.lock.on_evict(job, why=why, now=self._now)
        assert out.role is role, (out, role)
        refused = [(a.job, a.message) for a in out.actions if isinstance(a, act.Abort)]
        assert refused == ([(job, why)] if aborted else []), out
        self._apply(out.actions)

    @stateful.rule(drain=st.booleans())
    def drain(self, drain: bool) -> None:
        self.draining = drain
        if not drain:
            self._promote()
        self._apply(self.lock.on_drain(drain, now=self._now))

    @stateful.precondition(lambda self: self.switch is None)
    @stateful.rule()
    def restart(self) -> None:
        """The orchestrator restarts: the lock comes back from its record; every waiter
        re-attaches (its client retries its Acquire) in queue order, as recovery reads
        the agents and finds the resident where the lock left it."""
        record = self.lock.record()
        now = self._now
        # Degraded marks live in memory: the next switch finds them again (the drain mark
        # and the evictions are in the record).
        self.blocked = ""
        self.lock = lk.GroupLock.from_record(record, now=now, reattach_grace_s=10.0)
        self._apply(
            self.lock.on_recovered(
                resident=self.resident, verified=self.verified, rollback=False, now=now
            )
        )
        assert self.lock.waiting_jobs == list(self.queue), (self.lock.waiting_jobs, self.queue)
        waiting, self.queue = self.queue, {}
        # A granted holder's client got its reply before the crash: it keeps the lock.
        self.receivers, self.undelivered_rpcs = (1, 0) if self.holder is not None else (0, 0)
        for job, attached in waiting.items():
            self.queue[job] = attached
            for _ in range(attached):
                self._apply(self.lock.on_acquire(job, now=self._now))
        self._promote()
        # Re-attaching promotes the head once the first waiter is back.

    # ---- invariants --------------------------------------------------------------------

    @stateful.invariant()
    def lock_matches_model(self) -> None:
        g = self.lock
        assert g.holder == self.holder, (g.holder, self.holder)
        assert g.waiting_jobs == list(self.queue), (g.waiting_jobs, self.queue)
        switching = g.switching
        assert (switching.to_job if switching else None) == (
            self.switch.to_job if self.switch else None
        )
        assert g.grant_epoch == self.epoch
        assert g.draining == self.draining
        if self.switch is None:
            assert g.resident == self.resident

    @stateful.invariant()
    def one_holder_never_waiting(self) -> None:
        g = self.lock
        waiting = g.waiting_jobs
        assert len(waiting) == len(set(waiting))
        assert g.holder is None or g.holder not in waiting
        if g.holder is None and g.switching is None and not g.draining:
            assert g.attached_waiters == 0, "a live waiter was left on a free group"

    @stateful.invariant()
    def record_round_trips(self) -> None:
        """A lock rebuilt from the record has what the driver needs after a crash."""
        g = self.lock
        record = g.record()
        again = lk.GroupLock.from_record(record, now=self.now, reattach_grace_s=10.0)
        assert again.record() == record
        assert again.waiting_jobs == g.waiting_jobs
        # A switch in progress comes back as a recovered one, for its target.
        assert (again.active_job, again.resident, again.grant_epoch) == (
            g.active_job,
            g.resident,
            g.grant_epoch,
        )
        if g.switching is None:
            assert again.holder == g.holder
        assert again.switch_count == g.switch_count
        assert again.holder_lease_ms == g.holder_lease_ms
        assert again.draining == g.draining
        for job in ("a", "b", "c", "d"):
            assert again.footprint(job) == g.footprint(job), job


LockMachine.TestCase.settings = fuzz_settings(50)
test_group_lock_against_model = LockMachine.TestCase
