"""Keeping a holder lease: the Hold stream a client keeps open while it holds a group.

An Acquire with ``lease_ms > 0`` obliges the holder to keep a Hold stream open;
without one for ``lease_ms`` the orchestrator releases the lock (so a dead client
cannot keep a group). The orchestrator counts the lease from the grant, so a keeper
opens its stream only after a quarter of the lease (:func:`open_delay`): a slice
shorter than that costs no stream at all, and the hand-over at its end carries no
stream teardown. A keeper re-opens the stream with back-off (well within the lease)
when the orchestrator restarts or the network blips, and stops when the job yields
(the server ends the stream with ``released``), when the client closes, or when the
lease is lost (``FAILED_PRECONDITION`` or a ``lost`` event): then it calls
``on_lost`` with the reason. While the job is yielding (:meth:`releasing`) a loss is
held back: the Hold stream may reach the orchestrator after the Yield, and a lock
being given up is not lost; if the Yield fails, :meth:`resume` reports it.

Every decision (when to open, back-off, lost lease, yielding) is :class:`LeaseFlow`'s,
which does no I/O; the keepers only open and read streams and act on its steps.
:class:`HoldKeeper` runs in a daemon thread (sync client: no hidden event loop), started by
one scheduler thread per process when the stream is due;
:class:`AsyncHoldKeeper` is a task of the caller's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _streams
from tslice.common import errors

log = logging.getLogger("tslice.client")

#: Answers that mean the lock is gone for good: stop and report the loss.
_LOST_CODES = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})

OnLost = Callable[[str], None]
#: (job, group): a grant a client holds.
HoldKey = tuple[str, str]


class Keeper(Protocol):
    """What the clients ask of a lease keeper (sync or async) while yielding."""

    def releasing(self) -> None: ...

    def resume(self) -> None: ...


K = TypeVar("K", bound=Keeper)


class Keepers(Generic[K]):
    """The lease keepers of a client's grants, and the leases it lost (group -> why);
    thread-safe (the sync client's keepers report from their threads)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        #: The keeper of each grant held (tests read it).
        self.by_key: dict[HoldKey, K] = {}
        self._lost: dict[str, str] = {}

    def lost(self) -> dict[str, str]:
        with self._guard:
            return dict(self._lost)

    def was_lost(self, group: str) -> bool:
        return group in self._lost

    def lose(self, job: str, group: str, reason: str) -> None:
        log.warning(
            "job %s lost its lock on group %s: %s",
            job,
            group,
            reason,
            extra={"job_id": job, "group_id": group},
        )
        with self._guard:
            self._lost[group] = reason

    def swap(self, key: HoldKey, keeper: K) -> K | None:
        """Register the keeper of a new grant (the group is no longer lost); returns
        the one it replaces (to stop)."""
        with self._guard:
            self._lost.pop(key[1], None)
            old = self.by_key.get(key)
            self.by_key[key] = keeper
        return old

    def get(self, key: HoldKey) -> K | None:
        return self.by_key.get(key)

    def pop(self, key: HoldKey) -> K | None:
        with self._guard:
            return self.by_key.pop(key, None)

    def pop_all(self) -> list[K]:
        with self._guard:
            keepers, self.by_key = list(self.by_key.values()), {}
        return keepers


def retry_delay(attempt: int, lease_ms: int) -> float:
    """Back-off before re-opening: short, and always several tries within the lease."""
    return float(min(0.05 * 2**attempt, max(lease_ms / 5000, 0.02), 1.0))


def open_delay(lease_ms: int) -> float:
    """Seconds from the grant to opening the Hold stream: a quarter of the lease."""
    return lease_ms / 4000


@dataclasses.dataclass(frozen=True)
class Step:
    """What a keeper does next, as :class:`LeaseFlow` decides it."""

    #: Seconds to wait before re-opening the stream; ``None``: the keeper is done.
    reopen_in: float | None
    #: A lost lease to report through ``on_lost`` (before stopping).
    report: str | None = None
    #: Why the keeper stops although nothing was lost (logged at INFO).
    note: str | None = None


DONE = Step(reopen_in=None)


class LeaseFlow:
    """Every decision of keeping one lease, and no I/O: the keepers feed it what their
    Hold stream did and act on the :class:`Step` it returns (httpx's ``auth_flow``,
    kopf's cause detectors), so the sync and async keepers share one behaviour.

    Not thread-safe: the sync keeper calls it under its lock.
    """

    def __init__(self, *, lease_ms: int) -> None:
        self.lease_ms = lease_ms
        #: Failed openings since the stream last delivered an event.
        self.attempt = 0
        self.stopped = False
        self._releasing = False
        self._held_loss: str | None = None

    @property
    def open_delay(self) -> float:
        return open_delay(self.lease_ms)

    def on_event(self, *, released: bool, lost: str) -> Step | None:
        """A Hold event; ``None``: keep reading the stream."""
        self.attempt = 0
        if released:
            return DONE
        if lost:
            return self._lose(lost)
        return None

    def on_error(self, code: grpc.StatusCode, details: str) -> Step:
        """The stream failed with ``code``."""
        if self.stopped:
            return DONE
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return Step(
                reopen_in=None, note="the orchestrator has no Hold RPC; the lease is not kept"
            )
        if code in _LOST_CODES:
            return self._lose(details or code.name)
        return self._reopen()

    def on_end(self) -> Step:
        """The stream ended without saying released or lost (the server went away)."""
        return DONE if self.stopped else self._reopen()

    def releasing(self) -> None:
        """The job is yielding: a loss is held back until :meth:`resume` (or dropped)."""
        self._releasing = True

    def resume(self) -> str | None:
        """The Yield failed: the lease is kept again; the loss held back meanwhile, if any."""
        self._releasing, lost, self._held_loss = False, self._held_loss, None
        return None if self.stopped else lost

    def stop(self) -> None:
        self.stopped = True

    def _reopen(self) -> Step:
        delay = retry_delay(self.attempt, self.lease_ms)
        self.attempt += 1
        return Step(reopen_in=delay)

    def _lose(self, reason: str) -> Step:
        if self._releasing:
            # The Hold may reach the orchestrator after the Yield: a lock being given
            # up is not lost (unless the Yield fails, see resume()).
            self._held_loss = reason
            return DONE
        return DONE if self.stopped else Step(reopen_in=None, report=reason)


class _Due:
    """A scheduled start; :meth:`cancel` makes it a no-op."""

    __slots__ = ("cancelled", "start")

    def __init__(self, start: Callable[[], None]) -> None:
        self.start = start
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Scheduler:
    """One daemon thread per process that starts the keepers whose stream is due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, _Due]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, at: float, start: Callable[[], None]) -> _Due:
        due = _Due(start)
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._order), due))
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(
                    target=self._run, name="tslice-hold-scheduler", daemon=True
                )
                self._thread.start()
            elif self._heap[0][2] is due:
                self._cond.notify()
        return due

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][2].cancelled:
                    heapq.heappop(self._heap)  # a yield came first: nothing to start
                if not self._heap:
                    self._cond.wait()
                    continue
                at, _, due = self._heap[0]
                wait_s = at - time.monotonic()
                if wait_s > 0:
                    self._cond.wait(wait_s)
                    continue
                heapq.heappop(self._heap)
            if not due.cancelled:
                try:
                    due.start()
                except Exception:
                    log.exception("could not start a Hold stream")


_SCHEDULER = _Scheduler()


@dataclasses.dataclass(frozen=True)
class Lease:
    """The lease of one grant, as a keeper holds it."""

    job: str
    group: str
    #: The grant's epoch: a Hold for an older grant is refused.
    epoch: int
    lease_ms: int
    #: Called with the reason when the lease is lost.
    on_lost: OnLost

    @property
    def request(self) -> opb.HoldRequest:
        return opb.HoldRequest(job_id=self.job, group_id=self.group, grant_epoch=self.epoch)

    @property
    def name(self) -> str:
        """The keeper's thread or task name."""
        return f"tslice-hold:{self.group}:{self.job}"


class HoldKeeper:
    """Keeps one Hold stream open from a daemon thread (started when due) until :meth:`stop`."""

    def __init__(
        self, lease: Lease, *, hold: Callable[[opb.HoldRequest], _streams.SyncStream[opb.HoldEvent]]
    ) -> None:
        self._hold = hold
        self._request = lease.request
        self._flow = LeaseFlow(lease_ms=lease.lease_ms)
        self._on_lost = lease.on_lost
        self._stopped = threading.Event()
        self._guard = threading.Lock()
        self._stream: _streams.SyncStream[opb.HoldEvent] | None = None
        self._name = lease.name
        self._thread: threading.Thread | None = None
        # No thread until the stream is due: a slice shorter than that costs none.
        self._due = _SCHEDULER.schedule(time.monotonic() + self._flow.open_delay, self._begin)

    def stop(self) -> None:
        """Close the stream (the lease timer starts on the orchestrator unless yielded)."""
        with self._guard:
            self._flow.stop()
            stream = self._stream
        self._stopped.set()
        self._due.cancel()
        if stream is not None:
            stream.cancel()

    def join(self, timeout: float | None = None) -> None:
        with self._guard:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _begin(self) -> None:
        with self._guard:
            if self._flow.stopped:
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def releasing(self) -> None:
        """See :meth:`LeaseFlow.releasing`."""
        with self._guard:
            self._flow.releasing()

    def resume(self) -> None:
        """See :meth:`LeaseFlow.resume`."""
        with self._guard:
            lost = self._flow.resume()
        if lost is not None:
            self._on_lost(lost)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                stream = self._hold(self._request)
            except ValueError:
                return  # the client closed its channel meanwhile
            with self._guard:
                self._stream = stream
                stopped = self._flow.stopped
            if stopped:
                stream.cancel()
                return
            step = self._read(stream)
            if _done(step, self._on_lost):
                return
            assert step.reopen_in is not None
            self._stopped.wait(step.reopen_in)

    def _read(self, stream: _streams.SyncStream[opb.HoldEvent]) -> Step:
        try:
            for event in stream:
                with self._guard:
                    step = self._flow.on_event(released=event.released, lost=event.lost)
                if step is not None:
                    return step
        except errors.RPCError as err:
            with self._guard:
                return self._flow.on_error(err.status, err.message)
        with self._guard:
            return self._flow.on_end()


class AsyncHoldKeeper:
    """Keeps one Hold stream open from a task of the running loop until :meth:`stop`."""

    def __init__(
        self,
        lease: Lease,
        *,
        hold: Callable[[opb.HoldRequest], _streams.AsyncStream[opb.HoldEvent]],
    ) -> None:
        self._hold = hold
        self._lease = lease
        self._flow = LeaseFlow(lease_ms=lease.lease_ms)
        self._on_lost = lease.on_lost
        self._ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # A timer, not a sleeping task: a slice shorter than the delay costs no task
        # (the delay is open_delay(), inline: a keeper is made on every grant).
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            lease.lease_ms / 4000, self._open
        )

    @property
    def done(self) -> bool:
        """Stopped, or the stream ended for good (yielded, lost, or no Hold RPC)."""
        return self._ended.is_set()

    async def wait(self) -> None:
        await self._ended.wait()

    async def stop(self) -> None:
        self._flow.stop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = self._task
        if task is not None:
            if not task.done():
                task.cancel()
            # wait() does not raise the keeper's own cancellation (only the caller's).
            await asyncio.wait({task})
        self._ended.set()

    def _open(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._lease.name)
        self._task.add_done_callback(lambda _task: self._ended.set())

    def releasing(self) -> None:
        """See :meth:`LeaseFlow.releasing`."""
        self._flow.releasing()

    def resume(self) -> None:
        """See :meth:`LeaseFlow.resume`."""
        lost = self._flow.resume()
        if lost is not None:
            self._on_lost(lost)

    async def _run(self) -> None:
        request = self._lease.request
        while True:
            stream = self._hold(request)
            try:
                step = await self._read(stream)
            finally:
                stream.cancel()
            if _done(step, self._on_lost):
                return
            assert step.reopen_in is not None
            await asyncio.sleep(step.reopen_in)

    async def _read(self, stream: _streams.AsyncStream[opb.HoldEvent]) -> Step:
        try:
            async for event in stream:
                step = self._flow.on_event(released=event.released, lost=event.lost)
                if step is not None:
                    return step
        except errors.RPCError as err:
            return self._flow.on_error(err.status, err.message)
        return self._flow.on_end()


def _done(step: Step, on_lost: OnLost) -> bool:
    """Carry out the end of a step (log, report); True when the keeper is done."""
    if step.note is not None:
        log.info("%s", step.note)
    if step.report is not None:
        on_lost(step.report)
    return step.reopen_in is None
