"""OpenTelemetry tracing of hand-overs, into an in-memory exporter: one trace per switch,
spanning the orchestrator and each node's agent step (its parent read from the gRPC
metadata: a remote parent) and the backend operations; off, nothing is traced; JSON log
lines carry the ids of the work (and the trace) they are about."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from tests.orchestrator.orch_harness import Cluster, acquire, yield_
from tslice.server import logs, tracing

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
export = pytest.importorskip("opentelemetry.sdk.trace.export")


@pytest.fixture
def spans() -> Iterator[object]:
    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    tracing.setup("tslice-test", provider=provider)
    try:
        yield exporter
    finally:
        tracing.shutdown()


async def _two_switches(cluster: Cluster) -> None:
    await cluster.start_agent("node-a")
    await cluster.start_agent("node-b")
    await cluster.start_orchestrator(groups={"g": ["node-a", "node-b"]})
    stub = cluster.stub()
    await acquire(stub, "a", "g")  # a switch: nothing to move out
    await yield_(stub, "a", "g")
    await acquire(stub, "b", "g")  # a switch: a out, b in, on both nodes
    await yield_(stub, "b", "g")


async def test_each_hand_over_is_one_trace_across_orchestrator_and_agents(
    cluster: Cluster, spans: object
) -> None:
    await _two_switches(cluster)
    await cluster.close()
    finished = spans.get_finished_spans()  # type: ignore[attr-defined]
    roots = [s for s in finished if s.name == "tslice.handover"]
    assert [r.attributes["tslice.job"] for r in roots] == ["a", "b"]
    assert len({r.context.trace_id for r in roots}) == 2, "one trace per hand-over"
    second = roots[1]
    assert second.parent is None and second.attributes["tslice.from_job"] == "a"
    trace = [s for s in finished if s.context.trace_id == second.context.trace_id]
    by_id = {s.context.span_id: s for s in trace}
    calls = [
        s
        for s in trace
        if s.name == "tslice.agent.grant" and s.parent.span_id == second.context.span_id
    ]
    steps = [s for s in trace if s.name == "tslice.agent.grant" and s.parent.is_remote]
    assert len(calls) == 2 and len(steps) == 2, [s.name for s in trace]
    # Each node's step is the child of the orchestrator's call, through the metadata.
    assert {s.parent.span_id for s in steps} == {c.context.span_id for c in calls}
    assert {s.attributes["tslice.node"] for s in steps} == {"node-a", "node-b"}
    moves = [s for s in trace if s.name.startswith("tslice.backend.")]
    # a out (snapshot) and b in (activate: it has no state yet), on each node
    assert sorted(m.name for m in moves) == [
        "tslice.backend.activate",
        "tslice.backend.activate",
        "tslice.backend.snapshot",
        "tslice.backend.snapshot",
    ]
    for move in moves:  # under its node's step
        assert by_id[move.parent.span_id].name == "tslice.agent.grant"
        assert (
            by_id[move.parent.span_id].attributes["tslice.node"] == move.attributes["tslice.node"]
        )


async def test_off_nothing_is_traced(cluster: Cluster) -> None:
    assert not tracing.ENABLED
    exporter = in_memory.InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(exporter))
    # A provider that nobody turned on: the hooks test ENABLED and do nothing.
    await _two_switches(cluster)
    assert exporter.get_finished_spans() == ()


def test_json_log_lines_carry_the_ids_of_their_work(spans: object) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter({"node": "node-a"}))
    logger = logging.getLogger("tslice.test.ids")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        token = logs.IDS.set({"job_id": "j", "group_id": "g", "operation_id": "op-1"})
        with tracing.span("tslice.test", {}):
            logger.warning("inside", extra={"detail": "x"})
        logs.IDS.reset(token)
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["job_id"] == "j" and inside["group_id"] == "g"
    assert inside["operation_id"] == "op-1" and inside["node"] == "node-a"
    assert len(inside["trace_id"]) == 32 and inside["detail"] == "x"
    assert "job_id" not in outside and "trace_id" not in outside and outside["node"] == "node-a"


def test_asking_for_tracing_without_opentelemetry_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_otel(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("opentelemetry"):
            raise ImportError(name=name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_otel)
    with pytest.raises(tracing.TracingUnavailable, match=r"tslice\[otel\]"):
        tracing.from_env("x", {"TSLICE_TRACING": "console"})
    assert not tracing.ENABLED
    tracing.from_env("x", {"TSLICE_TRACING": "off"})  # off: nothing imported
    assert not tracing.ENABLED
