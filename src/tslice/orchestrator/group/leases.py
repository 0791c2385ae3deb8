"""Holder leases: the Hold streams of a group's holder and the timer that runs without one.

A job that acquired with ``lease_ms > 0`` keeps the group only while a Hold stream is
open, or for ``lease_ms`` after its grant or its last open stream; then the lock is
released as if it had yielded. :class:`Leases` is that bookkeeping for one group. It
is used from the group's worker only (it changes nothing by itself: the timer posts
a command to the inbox when it fires).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from tslice.orchestrator import metrics
from tslice.orchestrator.group import inbox, lock
from tslice.rpc import refusals


@dataclasses.dataclass(eq=False)
class HoldSession:
    """One open Hold stream of the holder: while any is open, its lease cannot expire."""

    job: str
    epoch: int
    lease_ms: int
    #: Resolved when the stream must end: "" = the job yielded, else why the lock was lost.
    ended: asyncio.Future[str]


#: Builds the command posted when the lease of (job, epoch, lease_ms) ran out.
Expiry = Callable[[str, int, int], inbox.Command]


class Leases:
    def __init__(self, group_id: str, series: metrics.OrchestratorMetrics) -> None:
        self._group_id = group_id
        self._opened = series.hold_streams_opened.labels(group_id=group_id)
        self._open_now = series.hold_streams.labels(group_id=group_id)
        self._holds: set[HoldSession] = set()
        self._reported = 0
        self._timer: asyncio.TimerHandle | None = None
        self._key: tuple[str, int] | None = None

    def open(self, lk: lock.GroupLock, job: str, epoch: int) -> HoldSession:
        """A Hold stream of ``job`` (``epoch`` 0 = the current grant); refused
        (FAILED_PRECONDITION) unless ``job`` holds the group under that grant."""
        gid = self._group_id
        if lk.finding_holder:
            raise refusals.Refused(
                refusals.Code.UNAVAILABLE,
                f"group {gid!r} lost its record and is reading its agents to find its "
                "holder; retry in a moment",
            )
        if lk.holder != job or lk.switching is not None:
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
        return session

    @property
    def open_streams(self) -> int:
        return len(self._holds)

    def close(self, session: HoldSession) -> None:
        self._holds.discard(session)

    def covers(self, job: str, epoch: int) -> bool:
        """Whether a Hold stream of ``job`` under grant ``epoch`` is open."""
        return any(h.job == job and h.epoch == epoch for h in self._holds)

    def released(self, job: str, *, lost: str = "") -> inbox.Effect:
        """``job`` let go: the effect that ends its streams (``lost`` "": it yielded,
        else why it lost the lock, e.g. evicted by an administrator)."""
        ending = [h for h in self._holds if h.job == job]
        self._holds.difference_update(ending)

        def end() -> None:
            for h in ending:
                inbox.resolve(h.ended, lost)

        return end

    def sync(
        self, lk: lock.GroupLock, post: Callable[[inbox.Command], None], expiry: Expiry
    ) -> None:
        """End the streams of a job that lost the lock; run the lease timer while none is open."""
        holder, epoch, lease_ms = lk.holder, lk.grant_epoch, lk.holder_lease_ms
        for session in list(self._holds):
            if session.job != holder or session.epoch != epoch or lk.switching is not None:
                self._holds.discard(session)
                lost = f"job {session.job!r} no longer holds group {self._group_id!r}"
                inbox.resolve(session.ended, lost)
        if len(self._holds) != self._reported:
            self._reported = len(self._holds)
            self._open_now.set(self._reported)
        # A grant held only for a set not answered yet: its job cannot open a stream yet.
        leased = lease_ms > 0 and not lk.provisional and not self._holds
        key = (holder, epoch) if holder is not None and leased else None
        if key == self._key:
            return
        self._cancel_timer()
        self._key = key
        if key is not None:
            command = expiry(key[0], epoch, lease_ms)
            self._timer = asyncio.get_running_loop().call_later(lease_ms / 1000, post, command)

    def stop(self, error: Exception) -> None:
        """The group stops: no timer, and every open stream ends with ``error``."""
        self._cancel_timer()
        self._key = None
        for session in self._holds:
            if not session.ended.done():
                session.ended.set_exception(error)
        self._holds.clear()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
