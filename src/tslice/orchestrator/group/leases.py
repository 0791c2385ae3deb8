"""Holder leases: the Hold streams of a group's holder and the timer that runs without one.

A job that acquired with ``lease_ms > 0`` keeps the group only while a Hold stream is
open, or for ``lease_ms`` after its grant or its last open stream; then the lock is
released as if it had yielded. :class:`Leases` is that bookkeeping for one group, used
from the group's commands only: when the timer fires it calls ``expired(job, epoch,
lease_ms)``, which posts a command to the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tslice.orchestrator import metrics
from tslice.orchestrator.group import callers, state
from tslice.rpc import refusals

#: (named here too: a Hold stream's session)
HoldSession = callers.HoldSession


class Leases:
    def __init__(
        self,
        group_id: str,
        series: metrics.OrchestratorMetrics,
        *,
        expired: Callable[[str, int, int], None],
    ) -> None:
        self._group_id = group_id
        self._expired = expired
        self._opened = series.hold_streams_opened.labels(group_id=group_id)
        self._open_now = series.hold_streams.labels(group_id=group_id)
        self._holds: set[HoldSession] = set()
        self._timer: asyncio.TimerHandle | None = None
        #: (holder, epoch) the timer runs for (None: none runs).
        self._key: tuple[str, int] | None = None

    def open(self, lk: state.LockState, job: str, epoch: int) -> HoldSession:
        """A Hold stream of ``job`` (``epoch`` 0 = the current grant); refused
        (FAILED_PRECONDITION) unless ``job`` holds the group under that grant."""
        gid = self._group_id
        if lk.finding_holder:
            raise refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"group {gid!r} lost its record and is reading its agents to find its "
                "holder; retry in a moment",
            )
        if lk.holder != job or lk.switch is not None:
            why = lk.eviction(job) or (
                "its Acquire has not returned yet"
                if lk.holder == job
                else f"the holder is {lk.holder!r}"
                if lk.holder
                else "nobody holds it"
            )
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job!r} does not hold group {gid!r} ({why}); Acquire it first",
            )
        if epoch and epoch != lk.grant_epoch and not lk.holder_epoch_unknown:
            raise refusals.Refused(
                refusals.Code.FAILED_PRECONDITION,
                f"job {job!r} does not hold group {gid!r} under grant {epoch} "
                f"(the current grant is {lk.grant_epoch}); Acquire it again",
            )
        ended = asyncio.get_running_loop().create_future()
        session = HoldSession(job, lk.grant_epoch, lk.holder_lease_ms, ended)
        self._holds.add(session)
        self._opened.inc()
        self._open_now.set(len(self._holds))
        return session

    @property
    def open_streams(self) -> int:
        return len(self._holds)

    def close(self, session: HoldSession) -> None:
        self._holds.discard(session)
        self._open_now.set(len(self._holds))

    def covers(self, job: str, epoch: int) -> bool:
        """Whether a Hold stream of ``job`` under grant ``epoch`` is open."""
        return any(h.job == job and h.epoch == epoch for h in self._holds)

    def released(self, job: str) -> tuple[HoldSession, ...]:
        """``job`` let go: its streams, which end once that is saved (:func:`end`)."""
        ending: list[HoldSession] = []
        for h in self._holds:
            if h.job == job:
                ending.append(h)
        if ending:
            self._holds.difference_update(ending)
            self._open_now.set(len(self._holds))
        return tuple(ending)

    def sync(self, lk: state.LockState) -> None:
        """After a batch: end the streams of a job that lost the lock; run the lease timer
        while none is open."""
        holder, epoch = lk.holder, lk.grant_epoch
        if self._holds:
            self._end_lost(lk)
        # A grant held only for a set not answered yet: its job cannot open a stream yet.
        lease_ms = lk.holder_lease_ms
        leased = lease_ms > 0 and not self._holds and not lk.provisional
        key = (holder, epoch) if holder is not None and leased else None
        if key == self._key:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._key = key
        if key is not None:
            self._timer = asyncio.get_running_loop().call_later(
                lease_ms / 1000, self._expired, key[0], epoch, lease_ms
            )

    def _end_lost(self, lk: state.LockState) -> None:
        for session in list(self._holds):
            if session.job != lk.holder or session.epoch != lk.grant_epoch or lk.switch:
                self._holds.discard(session)
                lost = f"job {session.job!r} no longer holds group {self._group_id!r}"
                if not session.ended.done():
                    session.ended.set_result(lost)
        self._open_now.set(len(self._holds))

    def stop(self, error: Exception) -> None:
        """The group stops: no timer, and every open stream ends with ``error``."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._key = None
        for session in self._holds:
            if not session.ended.done():
                session.ended.set_exception(error)
        self._holds.clear()


def end(sessions: tuple[HoldSession, ...], lost: str) -> None:
    """Each stream ends (its Hold RPC answers ``released``, or ``lost`` with why)."""
    for session in sessions:
        if not session.ended.done():
            session.ended.set_result(lost)
