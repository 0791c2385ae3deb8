"""The in-process event bus behind WatchEvents: publishing costs the hand-over nothing.

Publishing an event (:class:`Event`, a light record: its protobuf is built once, by the
first reader that needs it) appends it to the tap's list (the history and the derived
metrics, ``events.tap``) and to the ring of its group and the ring of all groups, where
anybody watches them. Nothing is written to a watcher on the publisher's path: one
fan-out per loop turn wakes the subscribers that wait for new events and whose filter
(group, kinds, job) an event passes; each then reads the ring at its own pace, in its
own task.

Bounded everywhere (issue 21 §4):

- a ring keeps the last :data:`RING_EVENTS` events of its group; a subscriber whose
  position fell off it (a slow reader, or one that stopped reading) is dropped with the
  reason (:class:`FellBehind`: how far behind, and to catch up with ``since`` from the
  history); one that never reads costs nothing once its stream stops taking writes;
- subscribers are capped per caller (its verified identity, else its peer host) and in
  all (``limits.Limits``): past a cap, WatchEvents is refused RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from google.protobuf import timestamp_pb2

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import limits
from tslice.rpc import refusals

Kind = opb.OrchestratorEvent.Kind

#: Events a ring keeps (per watched group, and for the watchers of every group).
RING_EVENTS = 4096


@dataclasses.dataclass(slots=True)
class Event:
    """One published event: made on the hand-over's path, turned into its protobuf
    (:meth:`message`) once, off it."""

    kind: int
    group_id: str
    job_id: str = ""
    node: str = ""
    duration_ms: int = 0
    from_job: str = ""
    detail: str = ""
    grant_epoch: int = 0
    size_bytes: int = 0
    #: When it happened, wall clock (``time.time_ns()``).
    time_ns: int = dataclasses.field(default_factory=time.time_ns)
    _message: opb.OrchestratorEvent | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    def message(self) -> opb.OrchestratorEvent:
        if self._message is None:
            stamp = timestamp_pb2.Timestamp()
            stamp.FromNanoseconds(self.time_ns)
            self._message = opb.OrchestratorEvent(
                time=stamp,
                kind=self.kind,  # type: ignore[arg-type]
                group_id=self.group_id,
                job_id=self.job_id,
                node=self.node,
                duration_ms=self.duration_ms,
                from_job=self.from_job,
                detail=self.detail,
                grant_epoch=self.grant_epoch,
                bytes=self.size_bytes,
            )
        return self._message


def make_event(kind: int, *, group_id: str, **fields: Any) -> opb.OrchestratorEvent:
    """An event's protobuf at once (tests, replays)."""
    return Event(kind, group_id, **fields).message()


class FellBehind(Exception):
    """A subscriber read too slowly: the events it had not read are gone from its ring."""

    def __init__(self, missed: int, kept: int) -> None:
        super().__init__(
            f"the watcher fell behind: {missed} events were not read in time (the server "
            f"keeps the last {kept} for it); watch again, with since = the time of the last "
            "event read, to replay what was missed from the history"
        )
        self.missed = missed


class _Ring:
    __slots__ = ("events", "first", "size", "subscribers", "total", "waiting")

    def __init__(self, size: int) -> None:
        self.events: collections.deque[Event] = collections.deque(maxlen=size)
        self.size = size
        #: Events ever appended (the index of the next one), and the index of the oldest
        #: one kept (both kept up to date by the publisher).
        self.total = 0
        self.first = 0
        #: Subscribers reading this ring, and those of them waiting for new events.
        self.subscribers: set[Subscription] = set()
        self.waiting: list[Subscription] = []


class Subscription:
    """One WatchEvents stream's place in its ring; iterate it for the events it passes."""

    def __init__(
        self,
        bus: EventBus,
        ring: _Ring,
        *,
        group_id: str,
        kinds: frozenset[int],
        job_id: str,
        caller: str,
    ) -> None:
        self._bus = bus
        self._ring = ring
        self.group_id = group_id
        self.kinds = kinds
        self.job_id = job_id
        self.caller = caller
        self._next = ring.total
        self._wakeup: asyncio.Future[None] | None = None
        #: The stream ends once it read what is in its ring (the bus closed).
        self.closed = False
        self.active = True

    async def __aiter__(self) -> AsyncIterator[opb.OrchestratorEvent]:
        ring = self._ring
        while True:
            # (_wanted leaves it at the next event it passes, or past the ring's last)
            while self._wanted() and self._next < ring.total:
                first = ring.first
                if self._next < first:
                    raise FellBehind(first - self._next, len(ring.events))
                event = ring.events[self._next - first]
                self._next += 1
                yield event.message()
            if self.closed:
                return
            self._wakeup = asyncio.get_running_loop().create_future()
            ring.waiting.append(self)
            await self._wakeup

    def _wanted(self) -> bool:
        """Whether an event it passes (its filter: kinds, then job) came since it last
        read, or its position fell off the ring: the events it does not pass are skipped
        here, once, in one loop."""
        ring = self._ring
        first, events, kinds, job = ring.first, ring.events, self.kinds, self.job_id
        while self._next < ring.total:
            if self._next < first:
                return True
            event = events[self._next - first]
            if (not kinds or event.kind in kinds) and (
                not job or job in (event.job_id, event.from_job)
            ):
                return True
            self._next += 1
        return self.closed

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)


class EventBus:
    def __init__(
        self, *, caps: limits.Limits | None = None, ring_events: int = RING_EVENTS
    ) -> None:
        self.caps = caps or limits.Limits()
        self._ring_events = ring_events
        #: Rings by the group they keep ("" = every group's events), while watched.
        self._rings: dict[str, _Ring] = {}
        self._per_caller: collections.Counter[str] = collections.Counter()
        self._subscribers = 0
        #: Rings with subscribers waiting for new events, to wake at the next fan-out.
        self._due: set[_Ring] = set()
        self.started = time.time()
        #: Called with the number of subscribers dropped for falling behind (a metric).
        self.on_drop: Callable[[int], None] | None = None
        #: Set: every event published is also appended to this list (the history and the
        #: metrics derived from events drain it in batches, ``events.tap``).
        self.tap: list[Event] | None = None

    def publish(self, event: Event) -> None:
        tap = self.tap
        if tap is not None:
            tap.append(event)
        rings = self._rings
        if not rings:
            return
        for key in ("", event.group_id):
            ring = rings.get(key)
            if ring is not None:
                if ring.total - ring.first == ring.size:
                    ring.first += 1  # (the deque drops its oldest)
                ring.events.append(event)
                ring.total += 1
                if ring.waiting:
                    if not self._due:
                        asyncio.get_running_loop().call_soon(self._fan_out)
                    self._due.add(ring)

    def _fan_out(self) -> None:
        """Wake the subscribers an event since their last read is for (once a turn)."""
        due, self._due = self._due, set()
        for ring in due:
            waiting, ring.waiting = ring.waiting, []
            for sub in waiting:
                if sub._wanted():
                    sub._wake()
                else:
                    ring.waiting.append(sub)

    def subscribe(
        self,
        *,
        group_id: str = "",
        kinds: frozenset[int] = frozenset(),
        job_id: str = "",
        caller: str = "",
    ) -> Subscription:
        """A subscription from now on; refused (RESOURCE_EXHAUSTED) past a cap."""
        caps = self.caps
        if self._subscribers >= caps.max_watchers:
            raise refusals.Refused(
                refusals.Code.RESOURCE_EXHAUSTED,
                f"the orchestrator serves at most {caps.max_watchers} event watchers at once "
                "(limits.max_watchers) and has that many; close one, or raise the limit",
            )
        if self._per_caller[caller] >= caps.max_watchers_per_caller:
            raise refusals.Refused(
                refusals.Code.RESOURCE_EXHAUSTED,
                f"{caller or 'this caller'} already watches events on "
                f"{caps.max_watchers_per_caller} streams (limits.max_watchers_per_caller); "
                "close one first",
            )
        ring = self._rings.get(group_id)
        if ring is None:
            ring = self._rings[group_id] = _Ring(self._ring_events)
        sub = Subscription(self, ring, group_id=group_id, kinds=kinds, job_id=job_id, caller=caller)
        ring.subscribers.add(sub)
        self._subscribers += 1
        self._per_caller[caller] += 1
        return sub

    def unsubscribe(self, sub: Subscription, *, missed: int = 0) -> None:
        """The stream ended (``missed``: it was dropped for falling that far behind)."""
        if not sub.active:
            return
        sub.active = False
        ring = sub._ring
        if sub in ring.waiting:
            ring.waiting.remove(sub)
        ring.subscribers.discard(sub)
        if not ring.subscribers and self._rings.get(sub.group_id) is ring:
            del self._rings[sub.group_id]
        self._subscribers -= 1
        self._per_caller[sub.caller] -= 1
        if self._per_caller[sub.caller] <= 0:
            del self._per_caller[sub.caller]
        if missed and self.on_drop is not None:
            self.on_drop(missed)

    def close(self) -> None:
        """Every stream ends once it read what is in its ring (the orchestrator stops or
        loses its leadership)."""
        for ring in self._rings.values():
            ring.waiting = []
            for sub in ring.subscribers:
                sub.closed = True
                sub._wake()
