"""Prometheus metrics of the node agent (own registry, so several agents fit in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tslice.security import identities, tls
from tslice.server import metrics_http

_DURATION_BUCKETS = (0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: GB/s: from a driver checkpoint in the field (2-6) to a PCIe Gen5 link (~50) and beyond
#: (several GPUs of one job moved at once add up).
_THROUGHPUT_BUCKETS = (0.5, 1, 2, 4, 8, 16, 25, 50, 100, 200, 400)


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
        self.throughput = Histogram(
            "tslice_agent_operation_throughput_gbps",
            "Device bytes moved per second by each completed operation that moved bytes, "
            "GB/s (10^9 bytes), retries included.",
            ["backend", "kind"],
            buckets=_THROUGHPUT_BUCKETS,
            registry=self.registry,
        )
        #: Counted when scraped (see count_jobs): nothing to update on a hand-over.
        self._jobs = _JobsCollector()
        self.registry.register(self._jobs)
        self._server: metrics_http.MetricsServer | None = None
        self._series: dict[tuple[str, str, str], tuple[Any, Any, Any, Any]] = {}

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
                self.throughput.labels(backend=backend, kind=kind),
            )
            self._series[(backend, kind, outcome)] = series
        count, duration, moved, throughput = series
        count.inc()
        duration.observe(seconds)
        if device_bytes > 0:
            moved.inc(device_bytes)
            if outcome == "complete" and seconds > 0:
                throughput.observe(device_bytes / seconds / 1e9)

    def count_jobs(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Where ``tslice_agent_jobs`` comes from: called (from the HTTP thread) per scrape."""
        self._jobs.counts = counts

    def serve(
        self,
        *,
        port: int,
        host: str,
        server_tls: tls.ServerTLS | None = None,
        auth_settings: identities.AuthSettings | None = None,
        insecure: bool = False,
    ) -> int:
        """Expose ``/metrics`` on ``port`` (0 = any free one) until :meth:`stop`; the port.

        As protected as the agent's gRPC port (see :mod:`tslice.server.metrics_http`).
        """
        self._server = metrics_http.serve(
            prometheus_client.make_wsgi_app(self.registry),
            host=host,
            port=port,
            server="agent",
            server_tls=server_tls,
            auth_settings=auth_settings,
            insecure=insecure,
        )
        return self._server.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None


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
