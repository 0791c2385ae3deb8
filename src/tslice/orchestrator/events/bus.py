"""In-process event bus behind the WatchEvents stream.

Publishing never blocks and never awaits: each subscriber has a bounded queue;
when a slow watcher falls behind, its oldest events are dropped and counted, so
the lock path is never slowed down by a client that reads slowly.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf import timestamp_pb2

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator.group import effects as decisions

Kind = opb.OrchestratorEvent.Kind


def make_event(
    kind: opb.OrchestratorEvent.Kind,
    *,
    group_id: str,
    job_id: str = "",
    node: str = "",
    duration_ms: int = 0,
    from_job: str = "",
    detail: str = "",
    grant_epoch: int = 0,
    size_bytes: int = 0,
) -> opb.OrchestratorEvent:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(time.time_ns())  # GetCurrentTime goes through datetime: 5x slower
    return opb.OrchestratorEvent(
        time=ts,
        kind=kind,
        group_id=group_id,
        job_id=job_id,
        node=node,
        duration_ms=duration_ms,
        from_job=from_job,
        detail=detail,
        grant_epoch=grant_epoch,
        bytes=size_bytes,
    )


class Subscription:
    def __init__(self, *, group_id: str, maxlen: int, kinds: frozenset[int] = frozenset()) -> None:
        self.group_id = group_id
        self.kinds = kinds
        self._buffer: collections.deque[opb.OrchestratorEvent] = collections.deque(maxlen=maxlen)
        self._wakeup = asyncio.Event()
        self.dropped = 0
        self.closed = False

    def accepts(self, group_id: str, kind: int) -> bool:
        return (not self.group_id or group_id == self.group_id) and (
            not self.kinds or kind in self.kinds
        )

    def offer(self, event: opb.OrchestratorEvent) -> None:
        if not self.accepts(event.group_id, event.kind):
            return
        if len(self._buffer) == self._buffer.maxlen:
            self.dropped += 1  # the deque drops the oldest on append
        self._buffer.append(event)
        self._wakeup.set()

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    async def __aiter__(self) -> AsyncIterator[opb.OrchestratorEvent]:
        while True:
            while self._buffer:
                yield self._buffer.popleft()
            if self.closed:
                return
            self._wakeup.clear()
            await self._wakeup.wait()


class EventBus:
    def __init__(self, *, maxlen: int = 1024) -> None:
        self._maxlen = maxlen
        #: Subscribers by the group they watch ("" = every group): an event of one
        #: group is offered to that group's watchers and to those of all groups only
        #: (every grant asks ``wants``: with many groups watched, a scan of all was the
        #: orchestrator's costliest code of its own per grant).
        self._subs: dict[str, set[Subscription]] = {}
        self.started = time.time()
        #: Called with the number of events a subscriber dropped (metrics hook).
        self.on_drop: Callable[[int], None] | None = None
        #: Set: every event published is also appended to this list (the history and the
        #: metrics derived from events, :mod:`tslice.orchestrator.events.tap`, drain it in
        #: batches): one list append on the hand-over path, nothing more.
        self.tap: list[opb.OrchestratorEvent] | None = None

    def _watching(self, group_id: str) -> list[Subscription]:
        """The subscribers that may want an event of ``group_id``."""
        watching = list(self._subs.get("", ()))
        if group_id:
            watching += self._subs.get(group_id, ())
        return watching

    def publish(self, event: opb.OrchestratorEvent) -> None:
        tap = self.tap
        if tap is not None:
            tap.append(event)
        for sub in self._watching(event.group_id):
            before = sub.dropped
            sub.offer(event)
            if sub.dropped != before and self.on_drop is not None:
                self.on_drop(sub.dropped - before)

    def wants(self, group_id: str, kind: int) -> bool:
        """Whether any subscriber would get such an event (if not, it need not be built)."""
        if self.tap is not None:
            return True
        return any(sub.accepts(group_id, kind) for sub in self._watching(group_id))

    def subscribe(self, *, group_id: str = "", kinds: frozenset[int] = frozenset()) -> Subscription:
        sub = Subscription(group_id=group_id, maxlen=self._maxlen, kinds=kinds)
        self._subs.setdefault(group_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.group_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.group_id]

    def close(self) -> None:
        for subs in list(self._subs.values()):
            for sub in list(subs):
                sub.close()
        self._subs.clear()


#: How long a group's events may be held back while a switch gets going (see GroupEvents).
EVENT_HOLD_S = 0.005


_EMITTED_KINDS = {
    decisions.EventKind.QUEUED: Kind.KIND_QUEUED,
    decisions.EventKind.YIELDED: Kind.KIND_YIELDED,
    decisions.EventKind.CANCELLED: Kind.KIND_CANCELLED,
    decisions.EventKind.ROLLED_BACK: Kind.KIND_SWITCH_FAILED,
}


def _grant_detail(g: decisions.Granted) -> str:
    if g.held:
        return "already held"
    if g.zero_cost:
        return "zero-cost"
    return "restored" if g.restored else ""


class GroupEvents:
    """One group's side of the bus: its events, built only when somebody watches, and
    held back for at most :data:`EVENT_HOLD_S` while a switch gets going.

    Delivering events to watchers takes CPU that the hand-over needs (agent calls, the
    Acquire reply), and a short switch is over before the hold ends, so its events go
    out after the grant, in order and with the timestamps of the facts. A long switch
    streams them from EVENT_HOLD_S on.
    """

    def __init__(self, bus: EventBus, group_id: str) -> None:
        self._bus = bus
        self.group_id = group_id
        #: Events held back; None: not holding.
        self._held: list[opb.OrchestratorEvent] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def wants(self, kind: opb.OrchestratorEvent.Kind) -> bool:
        bus = self._bus
        return bus.tap is not None or bus.wants(self.group_id, kind)

    def publish(self, event: opb.OrchestratorEvent) -> None:
        if self._held is not None:
            self._held.append(event)
        else:
            self._bus.publish(event)

    def emit(self, kind: opb.OrchestratorEvent.Kind, **fields: Any) -> None:
        """Publish an event of this group, if anybody watches such events (or the tap)."""
        bus = self._bus
        # The tap first: with it every event is wanted, and asking costs two calls.
        if bus.tap is not None or bus.wants(self.group_id, kind):  # else: not even built
            self.publish(make_event(kind, group_id=self.group_id, **fields))

    def granted(self, g: decisions.Granted) -> None:
        """The event of a grant the lock decided."""
        self.emit(
            Kind.KIND_GRANTED,
            job_id=g.job,
            grant_epoch=g.epoch,
            duration_ms=int(g.waited_s * 1000),
            detail=_grant_detail(g),
        )

    def decided(self, e: decisions.Emit) -> None:
        """The event the lock asked for (queued, yielded, cancelled, rolled back)."""
        self.emit(_EMITTED_KINDS[e.kind], job_id=e.job, detail=e.detail)

    def hold(self) -> None:
        if self._held is None:
            self._held = []
            self._timer = asyncio.get_running_loop().call_later(EVENT_HOLD_S, self.release)

    def release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        held, self._held = self._held, None
        for event in held or ():
            self._bus.publish(event)
