"""Prometheus metrics of the node agent (own registry, so several agents fit in one process)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class AgentMetrics:
    """Operation counters and latencies by backend, bytes moved, jobs by state."""

    def __init__(self, *, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.operations = Counter(
            "tslice_agent_operations_total",
            "Finished operations; outcome is complete, failed (nothing changed) or faulted.",
            ["backend", "kind", "outcome"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "tslice_agent_operation_duration_seconds",
            "Wall time of backend operations, retries included.",
            ["backend", "kind"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.bytes_moved = Counter(
            "tslice_agent_bytes_moved_total",
            "Device bytes moved off (snapshot) or onto (restore, activate) the accelerators.",
            ["backend", "kind"],
            registry=self.registry,
        )
        #: Counted when scraped (see count_jobs): nothing to update on a hand-over.
        self._jobs = _JobsCollector()
        self.registry.register(self._jobs)
        self._server: object | None = None
        self._thread: threading.Thread | None = None
        self._series: dict[tuple[str, str, str], tuple[Any, Any, Any]] = {}

    def observe(
        self, *, backend: str, kind: str, outcome: str, seconds: float, device_bytes: int
    ) -> None:
        series = self._series.get((backend, kind, outcome))
        if series is None:
            # labels() costs more than the update itself: look each child up once.
            series = (
                self.operations.labels(backend=backend, kind=kind, outcome=outcome),
                self.duration.labels(backend=backend, kind=kind),
                self.bytes_moved.labels(backend=backend, kind=kind),
            )
            self._series[(backend, kind, outcome)] = series
        count, duration, moved = series
        count.inc()
        duration.observe(seconds)
        if device_bytes > 0:
            moved.inc(device_bytes)

    def count_jobs(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Where ``tslice_agent_jobs`` comes from: called (from the HTTP thread) per scrape."""
        self._jobs.counts = counts

    def serve(self, *, port: int, host: str = "0.0.0.0") -> int:
        """Expose ``/metrics`` on ``port`` (0 = any free one) until :meth:`stop`; the port."""
        server, thread = prometheus_client.start_http_server(
            port, addr=host, registry=self.registry
        )
        self._server, self._thread = server, thread
        return int(server.server_port)

    def stop(self) -> None:
        server = self._server
        if server is not None:
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _JobsCollector(Collector):
    def __init__(self) -> None:
        self.counts: Callable[[], Mapping[str, int]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "tslice_agent_jobs", "Jobs known on this node, by state.", labels=["state"]
        )
        for state, count in sorted(self.counts().items()):
            family.add_metric([state], count)
        yield family
