"""The per-group lock and wait queue as a pure state machine.

Every decision about who holds a group, who waits and when a switch starts is
taken here, with no I/O and no clock of its own (callers pass ``now``). Each
``on_*`` method changes the state (``group.state``) and returns a list of *decisions*
(``group.effects``), which the group's executor books at once and acts on once the
new state is persisted. A group grants only while it holds the device claim that
groups sharing devices take turns on (``group.overlap``).

Vocabulary: the *holder* owns the lock (during a switch, the switch target);
the *resident* is the job whose state is on the devices; *verified* says the
resident was confirmed on every node (after a completed switch or by reading the
agents); a queue entry is *attached* while at least one Acquire RPC of its job
is waiting, *detached* when it was restored from disk after a crash and its RPCs
are gone. Only attached entries are promoted; detached ones keep their place for
``reattach_grace_s`` and are then dropped. An administrator may *evict* a job
(it loses the lock, or its place in the queue) and *drain* the group (no new turn is
granted until it is resumed). Its state, record and read-only views: ``state.LockState``.

Who of the live waiters is promoted is the group's *policy*'s choice
(``tslice.orchestrator.policy``: FIFO by default); the lock tells it what happens
(arrivals, grants, releases, measured switches) and asks it to rank the waiters.

Because this module is pure, randomized tests drive it directly and check the
invariants (one holder, the policy's order and starvation bound, no departed job
granted, every live waiter granted).
"""

from __future__ import annotations

import dataclasses

from tslice.orchestrator.group import effects as act
from tslice.orchestrator.group import found_holder, state
from tslice.rpc import refusals

#: The group's state from the lock alone (named here too: callers read ``lock.Phase``).
Phase = state.Phase

#: Why a job restored from disk was dropped after ``reattach_grace_s``.
_NOT_BACK = "did not re-attach after recovery"
#: Why the holder granted by a recovered switch lost the lock.
_UNCLAIMED = (
    f"{_NOT_BACK}: its grant (a switch finished after a restart) was never claimed, "
    "no Acquire of it came back within the re-attach grace"
)


class GroupLock(state.LockState):
    """Lock, queue and residency of one group. Not thread-safe; one driver owns it."""

    # ---- events ---------------------------------------------------------------------------

    def on_acquire(
        self,
        job: str,
        *,
        footprint_bytes: int = 0,
        lease_ms: int = 0,
        set_seq: int | None = None,
        now: float,
    ) -> list[act.Action]:
        """One Acquire RPC of ``job`` arrived (it stays attached until granted or departed).

        ``set_seq``: it is one group of set ``set_seq`` (AcquireSet): it is granted only
        once the whole set is ready (:meth:`on_set_ready`), never at once."""
        if footprint_bytes > 0:
            self._set_footprint(job, footprint_bytes)
        if lease_ms > 0:
            self._leases[job] = lease_ms
        else:
            self._leases.pop(job, None)
        s = self.switch
        if s is not None and s.to_job == job and (set_seq is None or not s.departed):
            # Its own switch is running (or a recovered one): wait for it to finish.
            # (Not a set's part after that switch's Acquire left: it waits for its set.)
            s.attached += 1
            s.departed = False
            self.holder = job
            return []
        if self.holder == job:
            self._receivers += 1
            if set_seq is None:  # (a set's part is answered with its set: on_set_answered)
                self._answered += 1
                self._confirm_deadline = None
            return [act.Granted(job, self.grant_epoch, False, 0.0, zero_cost=True, held=True)]
        if self.blocked:
            return [act.Abort(job, self.blocked, code=refusals.Code.UNAVAILABLE)]
        if set_seq is not None or job in self._sets.members:
            self._sets.mark(job, set_seq)
        entry = self.queue.get(job)
        if entry is not None:
            self._attach(entry, 1)
            actions: list[act.Action] = []
            if entry.detached_since is not None:
                entry.detached_since = None
                actions.append(act.Emit(act.EventKind.QUEUED, job, "re-attached after restart"))
            return [*actions, *self._promote(now)]
        self._policy.arrived(job, now=now, active=state.Active(self))
        if (
            set_seq is None
            and not self.recovering
            and not self.draining
            and self._claim.allows(job)
            and self.holder is None
            and s is None
            and self.resident == job
            and self.verified
            and self.attached_waiters == 0
        ):
            # Zero-cost re-acquire: still resident everywhere and nobody waits.
            self._grant_to(job, now, attached=1, new_epoch=True)
            return [
                act.Granted(job, self.grant_epoch, restored=False, waited_s=0.0, zero_cost=True)
            ]
        self._enqueue(state.Entry(job, self._next_seq, now, attached=1))
        self._next_seq += 1
        return [act.Emit(act.EventKind.QUEUED, job), *self._promote(now)]

    def on_cancel(self, job: str, *, now: float) -> list[act.Action]:
        """An Acquire RPC of ``job`` went away before it was granted."""
        s = self.switch
        if s is not None and s.to_job == job and s.attached > 0:
            s.attached -= 1
            if s.attached == 0:
                s.departed = True
                self.holder = None
                why = "left during its own switch; the switch finishes, then the group moves on"
                return [act.Emit(act.EventKind.CANCELLED, job, why)]
            return []
        entry = self.queue.get(job)
        if entry is not None and entry.attached > 0:
            self._attach(entry, -1)
            if entry.attached == 0:
                self._dequeue(job)
                return [
                    act.Emit(act.EventKind.CANCELLED, job, "left the queue"),
                    *self._left(job, now),
                ]
        return []

    def on_undelivered(
        self,
        job: str,
        *,
        epoch: int,
        now: float,
        why: str = "grant not delivered (RPC cancelled)",
    ) -> list[act.Action]:
        """An Acquire RPC of ``job`` was granted but cancelled before the reply went out
        (or an AcquireSet that did not complete gives back its part of the grant).

        When every receiver of the grant is gone, the job never learnt that it holds
        the group: release it like a yield so that it does not become a ghost holder.
        While one receiver was answered, the grant stands: a success answer is taken
        back only by the job's yield, its lease or an eviction.
        """
        if self.holder != job or self.grant_epoch != epoch or self.switch is not None:
            return []
        self._undelivered += 1
        if self._undelivered < self._receivers:
            return []
        return self._release(job, now, act.EventKind.CANCELLED, why)

    def on_yield(self, job: str, *, now: float) -> act.YieldOutcome:
        s = self.switch
        if s is not None and s.to_job == job and not s.departed and self.holder == job:
            # Yield during its own switch: finish the switch, then treat it as yielded.
            s.departed = True
            s.attached = 0
            self.holder = None
            pending = self.attached_waiters
            actions: list[act.Action] = [
                act.Abort(job, f"job {job!r} yielded the group while its own Acquire was pending"),
                act.Emit(act.EventKind.YIELDED, job, "during its own switch"),
            ]
            return act.YieldOutcome(True, None, pending, pending == 0, actions)
        if self.holder == job:
            pending = self.attached_waiters
            actions = self._release(job, now, act.EventKind.YIELDED, "")
            return act.YieldOutcome(True, None, pending, pending == 0, actions)
        evicted = self.eviction(job)
        if self.holder is not None or evicted:
            return act.YieldOutcome(
                False, self.holder, self.attached_waiters, False, [], evicted=evicted
            )
        # Nobody holds the group: idempotent no-op.
        self._search.departed(job)
        deferred = s is None and self.resident == job
        return act.YieldOutcome(True, None, self.attached_waiters, deferred, [])

    def on_lease_expired(self, job: str, *, epoch: int, now: float) -> list[act.Action]:
        """``job`` kept no Hold stream open for its lease: release it as if it had yielded."""
        if self.holder != job or self.grant_epoch != epoch or self.switch is not None:
            return []
        return self._release(job, now, act.EventKind.YIELDED, "lease expired")

    def on_evict(self, job: str, *, why: str, now: float) -> act.EvictOutcome:
        """An administrator takes ``job`` out of the group; ``why`` is what it is told.

        A holder loses the lock as a lapsed lease does (the next waiter is promoted; a
        switch moves the evicted state off the devices); the target of the switch in
        progress is treated as if it yielded during it. A waiter leaves the queue and
        its pending Acquires fail ABORTED. Neither: nothing changes (``role`` None).
        """
        s = self.switch
        if self.holder == job:
            self._remember_eviction(job, why)
            if s is not None and s.to_job == job:
                # The switch finishes (its agents are at work), then the group moves on.
                s.departed, s.attached, self.holder = True, 0, None
                actions: list[act.Action] = [act.Abort(job, why)]
                actions.append(act.Emit(act.EventKind.YIELDED, job, why))
                return act.EvictOutcome(act.Role.HOLDER, "", actions)
            actions = self._release(job, now, act.EventKind.YIELDED, why)
            # The new holder, or the waiter promoted once the device claim is granted.
            attached = (e.job for e in self.queue.values() if e.attached > 0)
            return act.EvictOutcome(act.Role.HOLDER, self.holder or next(attached, ""), actions)
        entry = self._dequeue(job)
        if entry is None:
            self._search.departed(job)
            return act.EvictOutcome(None, "", [])
        self._remember_eviction(job, why)
        gone: list[act.Action] = [act.Abort(job, why)] if entry.attached > 0 else []
        left = [act.Emit(act.EventKind.CANCELLED, job, why), *self._left(job, now)]
        return act.EvictOutcome(act.Role.WAITER, "", [*gone, *left])

    def on_drain(self, drain: bool, *, now: float) -> list[act.Action]:
        """An administrator drains the group (no new turn is granted: the holder keeps
        its own, waiters stay queued) or resumes it (the head of the queue is promoted)."""
        self.draining = drain
        if not drain:
            return self._promote(now)
        # A group kept for a set must not be counted ready while it may grant nobody:
        # its set would be granted by the other groups alone (a set granted before the
        # drain is still honoured: see _promote).
        return [act.NotReady()] if self.reserved_for is not None else []

    def on_switch_done(self, *, epoch: int, restored: bool, now: float) -> list[act.Action]:
        s = self._end_switch(epoch)
        if s is None:
            return []
        self.resident = s.to_job
        self.verified = True
        self.switch_count += 1
        self.detail = ""
        self.unparkable_tries = 0
        if s.departed:
            return self._promote(now)
        if s.attached == 0 and s.recovered:
            # Granted by a recovered switch: keep the lock for the job until it re-attaches.
            self._grant_to(s.to_job, now, attached=0, new_epoch=False)
            deadline = self.grace_deadline()
            if deadline is not None and now >= deadline:
                return self._release(s.to_job, now, act.EventKind.CANCELLED, _UNCLAIMED)
            self._confirm_deadline = deadline
            return []
        self._grant_to(s.to_job, now, attached=s.attached, new_epoch=False)
        return [
            act.Granted(s.to_job, epoch, restored=restored, waited_s=max(0.0, now - s.queued_at))
        ]

    def on_switch_failed(self, *, epoch: int, detail: str, now: float) -> list[act.Action]:
        """The driver gave up on a switch (nobody wants it any more)."""
        s = self._end_switch(epoch)
        if s is None:
            return []
        # Half done: the next switch re-reads every node and evicts whatever runs there.
        self.resident = s.to_job
        self.verified = False
        self.detail = f"switch {s.from_job or '-'} -> {s.to_job} abandoned: {detail}"
        if s.attached > 0:
            # Its job came back meanwhile: it is promoted again (a new switch, which
            # re-reads every node).
            self._queue_first(s)
        return self._promote(now)

    def on_stale_epoch(self, *, epoch: int, mark: int, now: float) -> list[act.Action]:
        """A node refused the switch's grant as stale, naming its mark: this group's
        state was lost (its epochs start again below what the agents saw). Epochs go on
        past the mark, never below it, and the target is granted again at once."""
        s = self.switch
        if s is None or s.epoch != epoch:
            return []
        self.grant_epoch = max(self.grant_epoch, mark)
        actions = self.on_switch_failed(epoch=epoch, detail=f"stale epoch (mark {mark})", now=now)
        if self.switch is None:
            self.detail = f"grant epochs continue past the agents' mark {mark}"
        return actions

    def on_switch_refused(
        self, *, epoch: int, code: refusals.Code, detail: str, now: float
    ) -> list[act.Action]:
        """An agent refused the switch's target for good (its state can never fit):
        its Acquires fail with ``code`` and the group moves on without it."""
        s = self._end_switch(epoch)
        if s is None:
            return []
        # The outgoing job may have been moved out on some nodes: re-check at the next switch.
        self.resident = s.from_job
        self.verified = False
        self.detail = f"job {s.to_job} refused: {detail}"
        actions: list[act.Action] = []
        if s.attached > 0 and not s.departed:
            actions.append(act.Abort(s.to_job, detail, code=code))
        return [*actions, *self._promote(now)]

    def on_switch_unparkable(self, *, epoch: int, detail: str, now: float) -> list[act.Action]:
        """A node cannot park what the switch moves out (issue 20 §2): nothing moved (no
        agent was called, or one refused before freezing anything). The resident stays
        and keeps running, the target keeps its place, and no switch starts until
        :meth:`on_parking_retry` (only the resident may be granted again meanwhile)."""
        s = self._end_switch(epoch)
        if s is None:
            return []
        self.unparkable = detail
        self.unparkable_tries += 1
        if s.attached > 0 or (s.recovered and not s.departed):
            self._queue_first(s, detached_since=None if s.attached > 0 else now)
        return self._promote(now)

    def on_parking_retry(self, *, now: float) -> list[act.Action]:
        """Try the switch again: the nodes may hold less now."""
        self.unparkable = ""
        return self._promote(now)

    def on_blocked(self, reason: str) -> list[act.Action]:
        """A node is degraded: no switch starts until an operator clears it, and every
        waiting Acquire fails now with the reason (UNAVAILABLE)."""
        self.blocked = reason
        actions: list[act.Action] = []
        for job, entry in list(self.queue.items()):
            if entry.attached > 0:
                self._dequeue(job)
                actions.append(act.Abort(job, reason, code=refusals.Code.UNAVAILABLE))
        return actions

    def on_degraded(self, *, epoch: int, cause: str, reason: str, now: float) -> list[act.Action]:
        """A node kept refusing the switch: the switch ends, no other starts (not even
        for its own target) and every waiting Acquire fails with ``reason``."""
        self.blocked = reason
        return [
            *self.on_switch_failed(epoch=epoch, detail=cause, now=now),
            *self.on_blocked(reason),
        ]

    def on_unblocked(self, *, now: float) -> list[act.Action]:
        self.blocked = ""
        return self._promote(now)

    def on_recovered(
        self,
        *,
        resident: str | None,
        verified: bool,
        rollback: bool,
        now: float,
    ) -> list[act.Action]:
        """Agents were read after a restart; decide the switch in progress and resume.

        ``rollback`` (only meaningful with a switch in progress): nothing moved on any
        node, so the switch is undone and its target goes back to the head of the queue.
        """
        self.recovering = False
        self.resident = resident
        self.verified = verified
        s = self.switch
        actions: list[act.Action] = []
        if s is not None:
            if rollback and s.attached == 0:
                self._end_switch(s.epoch)
                self._queue_first(s, detached_since=now)
                why = (
                    f"switch {s.from_job or '-'} -> {s.to_job} rolled back after restart: "
                    "nothing had moved; the job keeps its place in the queue"
                )
                actions.append(act.Emit(act.EventKind.ROLLED_BACK, s.to_job, why))
            else:
                return [self._start_switch(s)]
        elif self._search.pending:
            found = self._search.decide(
                resident, waiting=resident in self.queue, epoch=self.grant_epoch
            )
            if found is not None:
                self.holder, self._receivers = found, 1
                self.detail = found_holder.holder_detail(found)
                actions.append(act.NeedClaim(found, ()))  # its devices, as a holder on disk
        return [*actions, *self._promote(now)]

    def on_observed(self, *, epoch: int, resident: str | None, running_everywhere: bool) -> None:
        """A live read of the agents (GetGroupStatus) confirmed or refuted the resident."""
        if self.switch is not None or self.recovering:
            return
        if epoch != self.grant_epoch or resident != self.resident:
            return
        self.verified = running_everywhere

    def on_node_unreachable(self) -> None:
        """A node of the group did not answer: what is on its devices is unknown now, so
        the resident is granted again only through a switch, which every node confirms."""
        if self.switch is None:
            self.verified = False

    def on_expire(self, *, now: float) -> list[act.Action]:
        """Drop detached entries and unconfirmed recovered grants older than the grace."""
        actions: list[act.Action] = []
        for job, entry in list(self.queue.items()):
            since = entry.detached_since
            if entry.attached == 0 and since is not None and now - since >= self._grace:
                self._dequeue(job)
                actions.append(act.Emit(act.EventKind.CANCELLED, job, _NOT_BACK))
        if (
            self.holder is not None
            and self.switch is None
            and self._confirm_deadline is not None
            and now >= self._confirm_deadline
            and self._receivers == 0
        ):
            actions += self._release(self.holder, now, act.EventKind.CANCELLED, _UNCLAIMED)
        return [*actions, *self._promote(now)]

    def start_claim(self, job: str | None, *, exclusive: bool = False) -> None:
        """The claim at start: held for ``job`` (its holder, found on disk after a
        restart), or not held (a driver whose group shares devices asks per job).
        ``exclusive``: no other group shares its devices: it holds them for anybody
        and never asks (until :meth:`on_devices_shared`)."""
        held = exclusive or job is not None
        self._claim.held, self._claim.job = held, None if exclusive else job
        self._claim.contended = False

    def on_devices_shared(self) -> tuple[bool, str | None]:
        """Another group shares the devices now: the claim is asked for per job from now
        on. It stays held for the holder, and while a switch is in flight. An idle
        group holds nothing: the newcomer may take the claim at once for a holder of its
        own (found on disk), so a yielded resident asks again, and its grant checks the
        devices first. Whether it is held, and for whom. Changes no decision: the overlap
        arbiter calls it at once."""
        held = self.holder is not None or self.switch is not None
        self._claim.held, self._claim.job, self._claim.contended = held, self.holder, False
        if not held:
            self.verified = False  # (another group may move the resident from now on)
        return held, self.holder

    def on_claim_granted(self, job: str, *, now: float, shared: bool = False) -> list[act.Action]:
        """The device claim is this group's for ``job``: promote the head of the queue.

        ``shared``: the group shares devices with others. Then a resident verified while
        the claim was not held (after a restart: recovery reads the agents before any
        claim is held) may have given way to another group's switch meanwhile.
        """
        if shared and not self._claim.held:
            self.verified = False
        self._claim.held, self._claim.job, self._claim.chosen = True, job, job
        return self._promote(now)

    def on_claim_waiting(self) -> None:
        """The claim was asked for and must be waited for: meanwhile another group may
        move what is on the shared devices, the deferred resident included."""
        self._claim.held = False
        self.verified = False

    def on_contended(self, *, now: float) -> list[act.Action]:
        """An overlapping group asks for the claim: let go now if nobody holds the group."""
        if not self._claim.held:
            return []
        self._claim.contended = True
        released = self._let_go()
        # Waiters kept back for the resident (a policy's hold) now ask for the claim.
        return [*released, *self._promote(now)] if released and self.wake_at else released

    def on_set_passed(self, job: str, *, now: float) -> list[act.Action]:
        """The coordinator lets ``job`` (a single waiter that holds another group of the
        set this group is kept for) go first: the set waits for it anyway."""
        self._set_pass = job
        return self._promote(now)

    def on_granted_to_set_parts(self, job: str, *, epoch: int, parts: int, now: float) -> None:
        """Of the receivers of ``job``'s new grant ``epoch``, ``parts`` are the parts of
        sets not answered yet: they count as answered only with their set. Granted to
        such parts alone, the grant is unclaimed on disk until then (a crash meanwhile
        must not leave for ever a holder that was never told) and its lease waits."""
        if self.holder != job or self.grant_epoch != epoch or self.switch is not None:
            return
        self._answered = max(0, self._answered - parts)
        if self._answered == 0:
            self._confirm_deadline = now + self._grace

    def on_set_answered(self, job: str, *, epoch: int) -> None:
        """``job``'s set, granted here under ``epoch``, was answered success: its part is
        an answered receiver now (the grant is claimed, and its lease may start)."""
        if self.holder == job and self.grant_epoch == epoch and self.switch is None:
            self._answered += 1
            self._confirm_deadline = None

    def on_set_ready(self, job: str, *, set_seq: int, now: float) -> list[act.Action]:
        """Every group of ``job``'s set ``set_seq`` is reserved for it: grant it here."""
        return self._promote(now) if self._sets.on_ready(job, set_seq) else []

    # ---- internals ------------------------------------------------------------------------

    def _left(self, job: str, now: float) -> list[act.Action]:
        """``job`` left the queue: a group kept free for it moves on."""
        reserved = self._sets.reserved == job
        if job in self._sets.members:
            self._sets.drop(job)
        if self._set_pass == job:
            self._set_pass = None
        return self._promote(now) if reserved else []

    def _let_go(self) -> list[act.Action]:
        """Give the claim back if contended and free; the resident may then be evicted."""
        if not (self._claim.contended and self.holder is None and self.switch is None):
            return []
        self._claim.held = self._claim.contended = False
        # Another group's Grant may make the deferred resident give way: re-check it.
        self.verified = False
        return [act.ReleaseClaim()]

    def on_switch_measured(self, from_job: str | None, to_job: str, *, seconds: float) -> None:
        """The switch runner measured a completed switch (for the policy's costs)."""
        self._policy.switched(from_job, to_job, seconds=seconds)

    def _holds_for_resident(self, ranked: list[state.Entry], now: float) -> bool:
        """Keep the idle group for its yielded resident a while (the policy's call)?"""
        resident = self.resident
        if not (self._woken and self.verified and self._claim.held and resident is not None):
            return False
        if resident in self.queue:
            return False  # it asks again: the ranking decides
        until = self._policy.hold_until(resident, ranked, self._view(now))
        if until is None or until <= now:
            return False
        self._wake_at = until
        return True

    def _release(self, job: str, now: float, kind: act.EventKind, detail: str) -> list[act.Action]:
        self._policy.released(job, now=now)
        self._leases.pop(job, None)
        self.holder = None
        self._receivers = 0
        self._undelivered = 0
        self._answered = 0
        self._confirm_deadline = None
        return [act.Emit(kind, job, detail), *self._promote(now)]

    def _promote(self, now: float) -> list[act.Action]:
        if self.recovering or self.holder is not None or self.switch is not None:
            return []
        released = self._let_go()
        self._wake_at = None
        attached = self._ranked(now)
        if not attached or self.blocked:
            return released
        sets = self._sets
        entry = sets.choose(attached, self.queue) if sets.members else attached[0]
        if self.draining and entry.job not in self._sets.ready:
            return released  # drained: only a set granted before the drain goes on
        kept = self._sets.reserved is not None
        chosen, self._claim.chosen = self._claim.chosen, None
        if kept:
            # Kept for a set member not granted yet: only a waiter that holds another
            # group passes it, when the coordinator lets it (on_set_passed).
            need = self._sets.waiting(entry.job)
            if need is not None:
                passing = next((e for e in attached if e.job == self._set_pass), None)
                if passing is None:
                    singles = tuple(e.job for e in attached if e.job not in self._sets.members)
                    return [*released, dataclasses.replace(need, others=singles)]
                entry = passing
        elif self._claim.held and chosen is not None and chosen != entry.job:
            entry = next((e for e in attached if e.job == chosen), entry)
        elif chosen is None and self._holds_for_resident(attached, now):
            return released
        if self.unparkable and not (entry.job == self.resident and self.verified):
            # No switch may start: only the resident, still on the devices, goes again.
            resident = [e for e in attached if e.job == self.resident and self.verified]
            if not resident:
                return released
            entry = resident[0]
        if not self._claim.allows(entry.job):
            # Asked again whenever the waiters change: a nested acquire may pass the head.
            others = () if kept else tuple(e.job for e in attached if e.job != entry.job)
            return [*released, act.NeedClaim(entry.job, others)]
        self._dequeue(entry.job)
        if entry.job in sets.members:
            sets.drop(entry.job)
        self._set_pass = None
        if entry.job == self.resident and self.verified:
            self._grant_to(entry.job, now, attached=entry.attached, new_epoch=True)
            waited = max(0.0, now - entry.queued_at)
            return [act.Granted(entry.job, self.grant_epoch, False, waited, zero_cost=True)]
        self.grant_epoch += 1
        self.holder = entry.job
        self.switch = state.Switch(
            self.resident, entry.job, self.grant_epoch, entry.seq, entry.queued_at, entry.attached
        )
        return [self._start_switch(self.switch)]
