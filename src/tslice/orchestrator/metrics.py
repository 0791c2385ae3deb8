"""Prometheus metrics of the orchestrator (own registry, so several servers fit in one process).

The first four names are those already used by dashboards of the reference
implementation; no histogram has a job label (bounded cardinality). The only job label
is on :attr:`OrchestratorMetrics.job_hold`, a counter kept for at most
:data:`MAX_JOB_SERIES` jobs per group.

Grants, hold times, per-job device time and lease expiries are derived from the event
stream in batches, off the hand-over path (``events.derived``); each group's state, queue
depth, reservation and degraded and unreachable nodes are read when Prometheus scrapes
(:class:`GroupCollector`): nothing is updated for them on a hand-over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import prometheus_client as prom
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_Family = TypeVar("_Family", prom.Gauge, prom.Counter, prom.Histogram)

GROUP_STATES = ("UNKNOWN", "IDLE", "IDLE_YIELDED", "LOCKED", "SWITCHING")

_OP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
_HOLD_BUCKETS = (0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600)

#: Jobs per group with a ``job_hold`` series; past it the job that held least recently
#: loses its series (a cluster where thousands of jobs come and go keeps a bounded set).
MAX_JOB_SERIES = 64


class OrchestratorMetrics:
    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = registry or prom.CollectorRegistry()
        #: The families with a group_id label: a group that is gone drops its series.
        self._per_group: list[Any] = []
        group = ["group_id"]
        per_node = ["group_id", "node", "operation"]
        self.acquire_wait = self._histogram(
            "timeslice_orchestrator_acquire_wait_duration_seconds",
            "Time from Acquire to grant",
            group,
            _WAIT_BUCKETS,
        )
        self.agent_operation = self._histogram(
            "timeslice_orchestrator_agent_operation_duration_seconds",
            "Duration of agent operations (snapshot, restore, grant, status, reset)",
            per_node,
            _OP_BUCKETS,
        )
        self.deferred_snapshots = self._counter(
            "timeslice_orchestrator_deferred_snapshots",
            "Yields after which the snapshot was deferred because nobody waited",
            group,
        )
        self.switches = self._counter(
            "tslice_orchestrator_switches",
            "Switches by outcome: completed, or failed as refused, degraded (a node kept "
            "refusing), stale_epoch or abandoned",
            ["group_id", "outcome"],
        )
        self.switch_duration = self._histogram(
            "tslice_orchestrator_switch_duration_seconds",
            "Duration of completed switches (all nodes)",
            group,
            _OP_BUCKETS,
        )
        self.switch_step_failures = self._counter(
            "tslice_orchestrator_switch_step_failures",
            "Failed switch steps on a node (each is retried with backoff)",
            per_node,
        )
        self.acquire_sets = self._counter(
            "tslice_orchestrator_acquire_sets",
            "AcquireSet calls by outcome (granted, failed: refused, cancelled or past "
            "their deadline)",
            ["outcome"],
        )
        self.acquire_set_wait = self._histogram(
            "tslice_orchestrator_acquire_set_wait_duration_seconds",
            "Time from AcquireSet to the grant of every group of the set",
            [],
            _WAIT_BUCKETS,
        )
        self.hold_streams = self._gauge(
            "tslice_orchestrator_hold_streams",
            "Open Hold streams of holders keeping a lease",
            group,
        )
        self.hold_streams_opened = self._counter(
            "tslice_orchestrator_hold_streams_opened",
            "Hold streams accepted (a client opens one only for a slice longer than a "
            "quarter of its lease)",
            group,
        )
        self.events_dropped = self._counter(
            "tslice_orchestrator_watch_events_dropped",
            "Events dropped because a WatchEvents subscriber was too slow",
            [],
        )
        # ---- derived from the event stream (tslice.orchestrator.events.derived) ----
        self.grants = self._counter(
            "tslice_orchestrator_grants",
            "Grants (each ends an Acquire: a hand-over) by how the job got its state: "
            "switched (a switch moved it in), zero_cost (it was still resident)",
            ["group_id", "how"],
        )
        self.hold = self._histogram(
            "tslice_orchestrator_hold_duration_seconds",
            "How long a job held the group, grant to yield (or lease expiry, eviction)",
            group,
            _HOLD_BUCKETS,
        )
        self.job_hold = self._counter(
            "tslice_orchestrator_job_hold_seconds",
            "Seconds each job held the group (device time; credited while it holds). "
            f"At most {MAX_JOB_SERIES} jobs per group keep a series",
            ["group_id", "job_id"],
        )
        self.lease_expiries = self._counter(
            "tslice_orchestrator_lease_expiries",
            "Holders whose lease ran out (no Hold stream, no Yield): the lock was released",
            group,
        )
        self.evictions = self._counter(
            "tslice_orchestrator_evictions",
            "Jobs taken out of the group by an administrator, Kubernetes or Slurm",
            group,
        )
        self.history_written = self._counter(
            "tslice_orchestrator_history_events_written",
            "Events written to the event history (tslice events --since)",
            [],
        )
        self.history_failures = self._counter(
            "tslice_orchestrator_history_write_failures",
            "Batches of events the history could not write (each is logged)",
            [],
        )
        self.health = GroupCollector()
        self.registry.register(self.health)
        #: Also told when a group is forgotten (the event-derived series' own caches).
        self.on_forget_group: Callable[[str], None] | None = None

    def _gauge(self, name: str, doc: str, labels: list[str]) -> prom.Gauge:
        return self._family(prom.Gauge(name, doc, labels, registry=self.registry), labels)

    def _counter(self, name: str, doc: str, labels: list[str]) -> prom.Counter:
        return self._family(prom.Counter(name, doc, labels, registry=self.registry), labels)

    def _histogram(
        self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]
    ) -> prom.Histogram:
        family = prom.Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
        return self._family(family, labels)

    def _family(self, family: _Family, labels: list[str]) -> _Family:
        if "group_id" in labels:
            self._per_group.append(family)
        return family

    def forget_group(self, group_id: str) -> None:
        """Drop every series of a group that is gone (an idle local group collected)."""
        for family in self._per_group:
            _remove_group(family, group_id)
        if self.on_forget_group is not None:
            self.on_forget_group(group_id)


def _remove_group(family: Any, group_id: str) -> None:
    if hasattr(family, "remove_by_labels"):  # prometheus_client >= 0.22
        family.remove_by_labels({"group_id": group_id})
        return
    at = list(family._labelnames).index("group_id")
    with family._lock:
        for values in [v for v in family._metrics if v[at] == group_id]:
            del family._metrics[values]


@dataclasses.dataclass(frozen=True)
class GroupReading:
    """One group as a scrape reads it."""

    state: str
    queue_depth: int
    reserved: bool
    degraded: int
    unreachable: int


class GroupCollector(Collector):
    """The series of each group's state, read when scraped (from the HTTP thread) by
    :attr:`read`, which the leader sets: nothing is updated for them on a hand-over."""

    def __init__(self) -> None:
        self.read: Callable[[], Mapping[str, GroupReading]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        state = GaugeMetricFamily(
            "tslice_orchestrator_group_state",
            "1 for the group's current state, 0 for the others",
            labels=["group_id", "state"],
        )
        depth = GaugeMetricFamily(
            "timeslice_orchestrator_queue_depth",
            "Jobs waiting for the group",
            labels=["group_id"],
        )
        reserved = GaugeMetricFamily(
            "tslice_orchestrator_group_reserved",
            "1 while the free group is kept for a member of an AcquireSet whose other "
            "groups are still busy (the idle time a set costs)",
            labels=["group_id"],
        )
        degraded = GaugeMetricFamily(
            "tslice_orchestrator_degraded_nodes",
            "Nodes of the group that kept refusing a switch; no switch starts until an "
            "operator clears them (tslice clear-degraded)",
            labels=["group_id"],
        )
        unreachable = GaugeMetricFamily(
            "tslice_orchestrator_unreachable_nodes",
            "Nodes of the group whose agent does not answer (the group is UNKNOWN)",
            labels=["group_id"],
        )
        for gid, r in sorted(self.read().items()):
            for s in GROUP_STATES:
                state.add_metric([gid, s], 1 if s == r.state else 0)
            depth.add_metric([gid], r.queue_depth)
            reserved.add_metric([gid], 1 if r.reserved else 0)
            degraded.add_metric([gid], r.degraded)
            unreachable.add_metric([gid], r.unreachable)
        yield from (state, depth, reserved, degraded, unreachable)
