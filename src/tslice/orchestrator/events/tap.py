"""Every event the orchestrator publishes, taken off the hand-over path in batches.

The event bus appends each published event to :attr:`EventTap.pending` (one list append:
:attr:`tslice.orchestrator.events.bus.EventBus.tap`). Every ``flush_interval_s`` the tap
drains that list: the events are numbered (their history ``seq``), counted into the
event-derived metrics (:mod:`tslice.orchestrator.events.derived`) and handed to the
history's own thread (:mod:`tslice.orchestrator.persistence.history`). Nothing of that runs while a
hand-over is under way unless the loop is otherwise idle.

The tap is one per process and outlives leaderships (Kubernetes HA mode): each term's
bus is attached to it, and the history goes on across terms.

A WatchEvents call with ``since`` replays stored events, then goes on live without a gap
or a repeat: it subscribes to the bus and takes a :class:`Mark` in the same turn of the
loop; the stored part is everything numbered before the mark (the history's rows, then
the events not drained yet), the live part everything after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.common import tasks
from tslice.orchestrator import metrics
from tslice.orchestrator.events import bus
from tslice.orchestrator.events import derived as event_metrics
from tslice.orchestrator.persistence import history
from tslice.rpc import refusals

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where the stored part of a replay ends: drained events numbered before
    ``boundary`` are in the history (or on their way there); ``tail`` are the ones not
    drained yet."""

    boundary: int
    tail: tuple[bus.Event, ...]


class EventTap:
    def __init__(
        self,
        *,
        series: metrics.OrchestratorMetrics,
        store: history.History | None,
        flush_interval_s: float,
    ) -> None:
        self.pending: list[bus.Event] = []
        self.history = store
        self._series = series
        self._metrics = event_metrics.EventMetrics(series)
        series.on_forget_group = self._metrics.forget_group
        self._interval = flush_interval_s
        self._next_seq = store.next_seq if store is not None else 1
        self._task: asyncio.Task[None] | None = None

    def attach(self, events: bus.EventBus) -> None:
        """``events`` (one leadership's bus) publishes into this tap."""
        events.tap = self.pending

    def start(self) -> None:
        self._task = tasks.spawn(self._run(), name="event-tap")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            self.drain()

    def drain(self) -> None:
        """Number the pending events, count them, hand them to the history."""
        now = time.time()
        if not self.pending:
            self._metrics.apply((), now=now)
            return
        batch = self.pending.copy()
        self.pending.clear()
        first, self._next_seq = self._next_seq, self._next_seq + len(batch)
        self._metrics.apply(batch, now=now)
        if self.history is not None:
            messages = [event.message() for event in batch]
            self.history.append(first, messages).add_done_callback(self._written)

    def _written(self, done: object) -> None:
        # In the history's thread: counters are thread-safe.
        try:
            written = done.result()  # type: ignore[attr-defined]
        except Exception:
            log.exception("event history: a batch failed")
            written = 0
        if written:
            self._series.history_written.inc(written)
        else:
            self._series.history_failures.inc()

    def mark(self) -> Mark:
        """The replay boundary now (take it in the same turn as the live subscription)."""
        return Mark(self._next_seq, tuple(self.pending))

    async def replay(
        self, query: history.Query, mark: Mark
    ) -> AsyncIterator[opb.OrchestratorEvent]:
        """Stored events matching ``query``, published before ``mark``, oldest first."""
        store = self.history
        if store is None:
            return
        after = 0
        while True:
            page = await store.read_page(query, after_seq=after, before_seq=mark.boundary)
            for seq, event in page:
                yield event
                after = seq
            if len(page) < history.PAGE_ROWS:
                break
        for pending in mark.tail:
            message = pending.message()
            if query.matches(message):
                yield message

    async def close(self) -> None:
        """Stop draining; write what is pending; close the history."""
        if self._task is not None:
            await tasks.cancel_all([self._task])
            self._task = None
        self.drain()
        if self.history is not None:
            await self.history.close()


def query(request: opb.WatchEventsRequest, event_tap: EventTap | None) -> history.Query | None:
    """The stored events a WatchEvents asks for (None: live only); raises
    ``refusals.Refused`` for a request that cannot be answered."""
    if not request.HasField("since"):
        if request.HasField("until") or request.history_only:
            raise refusals.Refused(
                refusals.Code.INVALID_ARGUMENT,
                "until and history_only need since: the time the stored events start",
            )
        return None
    if event_tap is None or event_tap.history is None:
        raise refusals.Refused(
            refusals.Code.FAILED_PRECONDITION,
            "this orchestrator keeps no event history (`history: {enabled: false}` in "
            "its config); watch live events only (no since)",
        )
    since = request.since.ToNanoseconds()
    until = request.until.ToNanoseconds() if request.HasField("until") else 0
    if request.HasField("until") and until < since:
        raise refusals.Refused(
            refusals.Code.INVALID_ARGUMENT,
            f"until ({request.until.ToJsonString()}) is before since "
            f"({request.since.ToJsonString()})",
        )
    return history.Query(
        since_ns=since,
        until_ns=until,
        group_id=request.group_id,
        job_id=request.job_id,
        kinds=frozenset(request.kinds),
    )
