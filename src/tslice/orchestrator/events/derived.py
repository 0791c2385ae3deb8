"""Metrics derived from the event stream, in batches, off the hand-over path.

Grants and their waits, hold times, each job's device time and lease expiries are all
facts the events already state (GRANTED, YIELDED, CANCELLED with their details). Counting
them from a batch of events every tap interval (``events.tap``) costs the hand-over
nothing beyond the events themselves, and keeps these series out of the group's core.

A job's device time is credited while it holds (every batch), not only when it yields,
so a share-of-device-time graph moves smoothly even while one job holds for an hour.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import metrics
from tslice.orchestrator.events import bus

Kind = opb.OrchestratorEvent.Kind

#: The YIELDED detail of a lease that ran out (tslice.orchestrator.group.lock).
LEASE_EXPIRED = "lease expired"
#: How an eviction's detail starts (tslice.orchestrator.group.driver.eviction_message).
EVICTED = "evicted from group"

_HOW = {"zero-cost": "zero_cost", "already held": "already_held", "restored": "restored"}


class _Hold:
    __slots__ = ("credited", "job", "since")

    def __init__(self, job: str, since: float) -> None:
        self.job, self.since, self.credited = job, since, since


class EventMetrics:
    """Applies batches of events to the orchestrator's event-derived series."""

    def __init__(self, series: metrics.OrchestratorMetrics) -> None:
        self._m = series
        #: Group -> its holder's hold, as the events tell it.
        self._holds: dict[str, _Hold] = {}
        #: Group -> its jobs with a job_hold series, least recently holding first.
        self._jobs: dict[str, collections.OrderedDict[str, Any]] = {}
        self._children: dict[tuple[str, str], Any] = {}

    def apply(self, batch: Iterable[bus.Event], *, now: float) -> None:
        """Count a batch (in publication order), then credit every holder up to ``now``
        (wall clock, seconds)."""
        for event in batch:
            kind = event.kind
            if kind == Kind.KIND_GRANTED:
                self._granted(event)
            elif kind in (Kind.KIND_YIELDED, Kind.KIND_CANCELLED):
                self._released(event)
        for gid, hold in self._holds.items():
            self._credit(gid, hold, now)

    def forget_group(self, gid: str) -> None:
        self._holds.pop(gid, None)
        self._jobs.pop(gid, None)
        for key in [k for k in self._children if k[0] == gid]:
            del self._children[key]

    def _granted(self, event: bus.Event) -> None:
        gid, job = event.group_id, event.job_id
        how = _HOW.get(event.detail, "fresh")
        self._child(self._m.grants, gid, how).inc()
        self._child(self._m.acquire_wait, gid).observe(event.duration_ms / 1000)
        held = self._holds.get(gid)
        if how == "already_held" and held is not None and held.job == job:
            return
        at = _seconds(event)
        if held is not None:  # a grant without the previous holder's release: end it here
            self._ended(gid, held, at)
        self._holds[gid] = _Hold(job, at)

    def _released(self, event: bus.Event) -> None:
        gid = event.group_id
        detail = event.detail
        if detail.startswith(EVICTED):
            self._child(self._m.evictions, gid).inc()
        held = self._holds.get(gid)
        if held is None or held.job != event.job_id:
            return  # a waiter left the queue
        if event.kind == Kind.KIND_YIELDED and detail == LEASE_EXPIRED:
            self._child(self._m.lease_expiries, gid).inc()
        self._ended(gid, held, _seconds(event))
        del self._holds[gid]

    def _ended(self, gid: str, held: _Hold, at: float) -> None:
        self._child(self._m.hold, gid).observe(max(at - held.since, 0.0))
        self._credit(gid, held, at)

    def _credit(self, gid: str, held: _Hold, until: float) -> None:
        if until <= held.credited:
            return
        self._job_series(gid, held.job).inc(until - held.credited)
        held.credited = until

    def _job_series(self, gid: str, job: str) -> Any:
        jobs = self._jobs.setdefault(gid, collections.OrderedDict())
        series = jobs.get(job)
        if series is not None:
            jobs.move_to_end(job)
            return series
        if len(jobs) >= metrics.MAX_JOB_SERIES:
            gone, _ = jobs.popitem(last=False)
            self._m.job_hold.remove(gid, gone)
        series = jobs[job] = self._m.job_hold.labels(group_id=gid, job_id=job)
        return series

    def _child(self, family: Any, gid: str, *more: str) -> Any:
        key = (gid, family._name, *more)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(gid, *more)
        return child


def _seconds(event: bus.Event) -> float:
    return event.time_ns / 1e9
