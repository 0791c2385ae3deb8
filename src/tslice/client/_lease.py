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

:class:`HoldKeeper` runs in a daemon thread (sync client: no hidden event loop), started by
one scheduler thread per process when the stream is due;
:class:`AsyncHoldKeeper` is a task of the caller's loop.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb

log = logging.getLogger("tslice.client")

#: Answers that mean the lock is gone for good: stop and report the loss.
_LOST_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND)

OnLost = Callable[[str], None]


def retry_delay(attempt: int, lease_ms: int) -> float:
    """Back-off before re-opening: short, and always several tries within the lease."""
    return float(min(0.05 * 2**attempt, max(lease_ms / 5000, 0.02), 1.0))


def open_delay(lease_ms: int) -> float:
    """Seconds from the grant to opening the Hold stream: a quarter of the lease."""
    return lease_ms / 4000


def _outcome(err: grpc.RpcError) -> str | None:
    """Why the lease is lost, or None when the stream is worth re-opening."""
    code = err.code()
    if code in _LOST_CODES:
        return str(err.details() or code.name)
    return None


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


class HoldKeeper:
    """Keeps one Hold stream open from a daemon thread (started when due) until :meth:`stop`."""

    def __init__(
        self, *, stub: Any, job: str, group: str, epoch: int, lease_ms: int, on_lost: OnLost
    ) -> None:
        self._stub = stub
        self._request = opb.HoldRequest(job_id=job, group_id=group, grant_epoch=epoch)
        self._lease_ms = lease_ms
        self._on_lost = on_lost
        self._stopped = threading.Event()
        self._guard = threading.Lock()
        self._call: Any = None
        self._releasing = False
        self._held_loss: str | None = None
        self._name = f"tslice-hold:{group}:{job}"
        self._thread: threading.Thread | None = None
        # No thread until the stream is due: a slice shorter than that costs none.
        self._due = _SCHEDULER.schedule(time.monotonic() + open_delay(lease_ms), self._begin)

    def stop(self) -> None:
        """Close the stream (the lease timer starts on the orchestrator unless yielded)."""
        self._stopped.set()
        self._due.cancel()
        with self._guard:
            call = self._call
        if call is not None:
            call.cancel()

    def join(self, timeout: float | None = None) -> None:
        with self._guard:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _begin(self) -> None:
        with self._guard:
            if self._stopped.is_set():
                return
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def releasing(self) -> None:
        """The job is yielding: hold a loss back until :meth:`resume` (or drop it at stop)."""
        with self._guard:
            self._releasing = True

    def resume(self) -> None:
        """The Yield failed: the lease is kept again; report a loss held back meanwhile."""
        with self._guard:
            self._releasing, lost, self._held_loss = False, self._held_loss, None
        if lost is not None and not self._stopped.is_set():
            self._on_lost(lost)

    def _run(self) -> None:
        attempt = 0
        while not self._stopped.is_set():
            try:
                call = self._stub.Hold(self._request)
            except ValueError:
                return  # the client closed its channel meanwhile
            with self._guard:
                self._call = call
            if self._stopped.is_set():
                call.cancel()
                return
            try:
                for event in call:
                    attempt = 0
                    if event.released:
                        return
                    if event.lost:
                        self._lose(event.lost)
                        return
            except grpc.RpcError as err:
                if self._stopped.is_set():
                    return
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the orchestrator has no Hold RPC; the lease is not kept")
                    return
                lost = _outcome(err)
                if lost is not None:
                    self._lose(lost)
                    return
            self._stopped.wait(retry_delay(attempt, self._lease_ms))
            attempt += 1

    def _lose(self, reason: str) -> None:
        with self._guard:
            if self._releasing:
                self._held_loss = reason
                return
        if not self._stopped.is_set():
            self._on_lost(reason)


class AsyncHoldKeeper:
    """Keeps one Hold stream open from a task of the running loop until :meth:`stop`."""

    def __init__(
        self, *, stub: Any, job: str, group: str, epoch: int, lease_ms: int, on_lost: OnLost
    ) -> None:
        self._stub = stub
        self._request = opb.HoldRequest(job_id=job, group_id=group, grant_epoch=epoch)
        self._lease_ms = lease_ms
        self._on_lost = on_lost
        self._releasing = False
        self._held_loss: str | None = None
        self._name = f"tslice-hold:{group}:{job}"
        self._ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # A timer, not a sleeping task: a slice shorter than the delay costs no task.
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            open_delay(lease_ms), self._open
        )

    @property
    def done(self) -> bool:
        """Stopped, or the stream ended for good (yielded, lost, or no Hold RPC)."""
        return self._ended.is_set()

    async def wait(self) -> None:
        await self._ended.wait()

    async def stop(self) -> None:
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
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)
        self._task.add_done_callback(lambda _task: self._ended.set())

    def releasing(self) -> None:
        """The job is yielding: hold a loss back until :meth:`resume` (or drop it at stop)."""
        self._releasing = True

    def resume(self) -> None:
        """The Yield failed: the lease is kept again; report a loss held back meanwhile."""
        self._releasing, lost, self._held_loss = False, self._held_loss, None
        if lost is not None:
            self._on_lost(lost)

    def _lose(self, reason: str) -> None:
        if self._releasing:
            self._held_loss = reason
        else:
            self._on_lost(reason)

    async def _run(self) -> None:
        attempt = 0
        while True:
            call = self._stub.Hold(self._request)
            try:
                async for event in call:
                    attempt = 0
                    if event.released:
                        return
                    if event.lost:
                        self._lose(event.lost)
                        return
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the orchestrator has no Hold RPC; the lease is not kept")
                    return
                lost = _outcome(err)
                if lost is not None:
                    self._lose(lost)
                    return
            finally:
                call.cancel()
            await asyncio.sleep(retry_delay(attempt, self._lease_ms))
            attempt += 1
