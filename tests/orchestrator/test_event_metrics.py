"""Metrics derived from the event stream (grants, hold time, device time per job, lease
expiries) and the degraded/unreachable gauges, on a real orchestrator's /metrics; the job
label stays bounded."""

from __future__ import annotations

import asyncio

import httpx
import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from tests.orchestrator.orch_harness import Cluster, Events, acquire, free_port, yield_
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import metrics
from tslice.orchestrator.events import bus
from tslice.orchestrator.events import derived as event_metrics

K = opb.OrchestratorEvent.Kind


async def _samples(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def _eventually(port: int, check: object, timeout: float = 10.0) -> dict:  # type: ignore[type-arg]
    """Scrape until ``check(samples)`` holds: the tap drains every flush interval."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        samples = await _samples(port)
        if check(samples):  # type: ignore[operator]
            return samples
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"metrics never satisfied the check: {samples}")
        await asyncio.sleep(0.05)


async def test_grants_holds_device_time_and_lease_expiries(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    port = free_port()
    await cluster.start_orchestrator(metrics_port=port, history={"flush_interval_s": 0.05})
    stub = cluster.stub()
    ev = await Events.open(stub, "g")
    await acquire(stub, "a", "g")
    await acquire(stub, "a", "g")  # already held: no new hold
    await yield_(stub, "a", "g")
    await acquire(stub, "b", "g")  # a switch brings b in
    await yield_(stub, "b", "g")
    await acquire(stub, "b", "g")  # b still resident: zero cost
    await yield_(stub, "b", "g")
    await acquire(stub, "c", "g", lease_ms=200)  # and no Hold stream: the lease runs out
    assert (await ev.wait_for(K.KIND_YIELDED, job="c")).detail == event_metrics.LEASE_EXPIRED
    ev.cancel()

    def settled(s: dict) -> bool:  # type: ignore[type-arg]
        return _value(s, "tslice_orchestrator_lease_expiries_total", group_id="g") == 1

    samples = await _eventually(port, settled)
    grants = {
        how: _value(samples, "tslice_orchestrator_grants_total", group_id="g", how=how)
        for how in ("fresh", "restored", "zero_cost", "already_held")
    }
    assert grants["already_held"] == 1 and grants["zero_cost"] >= 1
    assert sum(grants.values()) == 5
    holds = _value(samples, "tslice_orchestrator_hold_duration_seconds_count", group_id="g")
    assert holds == 4  # a, b, b again, c (the re-acquire of a is the same hold)
    for job in "abc":
        held = _value(
            samples, "tslice_orchestrator_job_hold_seconds_total", group_id="g", job_id=job
        )
        assert held > 0, job
    assert _value(samples, "tslice_orchestrator_degraded_nodes", group_id="g") == 0
    assert ("tslice_orchestrator_unreachable_nodes", frozenset({("group_id", "g")})) in samples
    assert _value(samples, "tslice_orchestrator_history_events_written_total") > 10


def _event(kind: int, job: str, t: float, detail: str = "") -> bus.Event:
    event = bus.Event(kind, "g", job, detail=detail)
    event.time_ns = int(t * 1e9)
    return event


def test_the_job_label_stays_bounded_and_histograms_have_none() -> None:
    series = metrics.OrchestratorMetrics(prometheus_client.CollectorRegistry())
    derived = event_metrics.EventMetrics(series)
    batch = []
    for i in range(3 * metrics.MAX_JOB_SERIES):
        batch += [_event(K.KIND_GRANTED, f"job-{i}", i), _event(K.KIND_YIELDED, f"job-{i}", i + 1)]
    derived.apply(batch, now=10_000.0)
    jobs = {
        s.labels["job_id"]
        for family in series.registry.collect()
        for s in family.samples
        if "job_id" in s.labels
    }
    assert len(jobs) == metrics.MAX_JOB_SERIES
    newest = 3 * metrics.MAX_JOB_SERIES - 1
    assert f"job-{newest}" in jobs and "job-0" not in jobs
    for family in series.registry.collect():
        if family.type == "histogram":
            assert all("job_id" not in s.labels for s in family.samples), family.name
