"""llm-d's unary calls for the blocking client, started so that Ctrl-C never loses one.

tslice's clients send Acquire and Yield over one ``Session`` stream; a channel whose
orchestrator has no such RPC (llm-d's, an older tslice) takes the unary calls of the
wire contract instead, for good (decided once per channel, in
:mod:`tslice.client._services`), as does every AcquireSet (always unary: see there).

An interrupt (Ctrl-C, raised in the waiting thread at whatever bytecode it is on) must
always find the unary call it interrupts: grpc's ``future()`` returns the call only
after sending it, so an interrupt landing in between would lose the call and leave the
job queued on the orchestrator as a ghost waiter. :class:`Starter` is therefore one
daemon thread per channel that starts those calls and hands each over under a lock
(cancelling it itself when the caller gave up first); the waiting thread only waits.
The async client needs none of this: its unary calls are the stub's own methods.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Generic, TypeVar

from tslice.client import _channel

Req = TypeVar("Req")
Rep = TypeVar("Rep")

#: How long the waiting thread blocks at a time: an interrupt is held back while it waits
#: in C, and must land in Python (inside the transport's try) to cancel the call.
_INTERRUPTIBLE_S = 0.05


class Starter:
    """One daemon thread per channel that starts the unary calls of :class:`Started`
    (made at the first one, ended by :meth:`close`)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._due: queue.SimpleQueue[_Outcome[object, object] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def start(self, outcome: _Outcome[Req, Rep]) -> None:
        with self._guard:
            if self._thread is None or not self._thread.is_alive():  # first use, or forked
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        self._due.put(outcome)  # type: ignore[arg-type]

    def close(self) -> None:
        self._due.put(None)

    def _run(self) -> None:
        while (outcome := self._due.get()) is not None:
            outcome.start()


class Started(Generic[Req, Rep]):
    """A sync stub method whose ``future()`` is started by the channel's :class:`Starter`."""

    def __init__(self, starter: Starter, unary: _channel.SyncUnary[Req, Rep]) -> None:
        self._starter = starter
        self._unary = unary

    def future(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        metadata: _channel.Metadata | None = None,
    ) -> _Outcome[Req, Rep]:
        outcome = _Outcome(self._unary, request, timeout, metadata)
        self._starter.start(outcome)
        return outcome


@dataclasses.dataclass
class _Outcome(Generic[Req, Rep]):
    """What the sync transport waits on: ``result()``, and ``cancel()`` on an interrupt."""

    unary: _channel.SyncUnary[Req, Rep]
    request: Req
    timeout: float | None
    metadata: _channel.Metadata | None
    _call: _channel.Outcome[Rep] | None = None
    _start_error: BaseException | None = None
    _cancelled: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _started: threading.Event = dataclasses.field(default_factory=threading.Event)

    def result(self) -> Rep:
        while not self._started.wait(_INTERRUPTIBLE_S):
            pass
        if self._start_error is not None:
            raise self._start_error
        assert self._call is not None
        return self._call.result()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()

    def start(self) -> None:
        """(the starter's thread) Send the call and hand it over; cancel it if the
        caller already gave up."""
        try:
            call = self.unary.future(self.request, timeout=self.timeout, metadata=self.metadata)
        except BaseException as err:  # handed to the waiting thread, raised there
            self._start_error = err
            self._started.set()
            return
        with self._lock:
            self._call = call
            cancelled = self._cancelled
        if cancelled:
            call.cancel()
        self._started.set()
