"""Optional OpenTelemetry tracing of hand-overs (the ``otel`` extra, imported when turned on).

Off by default, and then free: every hook tests :data:`ENABLED` (a module global, no call)
or was chosen once at construction, so a hand-over does no tracing work at all. On
(``TSLICE_TRACING=console|otlp`` for the servers, or :func:`setup` with a provider), each
switch of a group is one trace:

* ``tslice.handover`` (orchestrator): the switch, from its start to the grant it leads
  to, with the group, both jobs and the grant epoch;
* ``tslice.agent.<operation>`` (orchestrator, client side): each call to a node's agent
  within it, the W3C trace context sent in the call's gRPC metadata (``traceparent``);
  a Grant then goes as a unary call, not on the GrantStream, whose metadata is the
  stream's, not the call's;
* ``tslice.agent.grant`` (agent, server side): the node's step, its parent read from that
  metadata (a remote parent);
* ``tslice.backend.<snapshot|restore|...>`` (agent): each backend operation of the step.

Hand-overs without a switch (the holder's state was still resident) have no trace.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

#: Whether tracing is on in this process (read by the hooks; set by :func:`setup`).
ENABLED = False
#: The variable that turns it on for a server: ``console`` or ``otlp``.
ENV = "TSLICE_TRACING"

_tracer: Any = None
_provider: Any = None
_propagator: Any = None


class TracingUnavailable(RuntimeError):
    """Tracing was asked for without the ``otel`` extra; the message says what to install."""


def _otel() -> tuple[Any, Any, Any]:
    try:
        from opentelemetry import trace
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.trace.propagation import tracecontext
    except ImportError as err:
        raise TracingUnavailable(
            f"tracing needs OpenTelemetry: pip install 'tslice[otel]' (cannot import "
            f"{err.name or err}), or unset ${ENV}"
        ) from err
    return trace, sdk_trace, tracecontext


def setup(service: str, *, exporter: str = "", provider: Any = None) -> None:
    """Turn tracing on in this process: spans go to ``provider`` (tests: an SDK provider
    with an in-memory exporter) or to a new provider exporting to ``exporter``
    (``console``: one JSON object per span on stdout; ``otlp``: to the collector that
    the standard ``OTEL_EXPORTER_OTLP_*`` variables name)."""
    # Module globals on purpose: the hooks read ENABLED as an attribute, not a call.
    global ENABLED, _tracer, _provider, _propagator  # noqa: PLW0603
    trace, sdk_trace, tracecontext = _otel()
    if provider is None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import export

        provider = sdk_trace.TracerProvider(resource=Resource.create({"service.name": service}))
        provider.add_span_processor(export.BatchSpanProcessor(_exporter(exporter)))
    _provider = provider
    _tracer = trace.get_tracer("tslice", tracer_provider=provider)
    _propagator = tracecontext.TraceContextTextMapPropagator()
    ENABLED = True


def _exporter(name: str) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as err:
            raise TracingUnavailable(
                f"${ENV}=otlp needs the OTLP exporter: pip install "
                "opentelemetry-exporter-otlp-proto-grpc (or use console)"
            ) from err
        return OTLPSpanExporter()
    raise TracingUnavailable(f"${ENV}={name!r}: use console or otlp (or unset it)")


def from_env(service: str, environ: Mapping[str, str] | None = None) -> None:
    """:func:`setup` if ``$TSLICE_TRACING`` asks for it (a server's start)."""
    name = (os.environ if environ is None else environ).get(ENV, "").strip().lower()
    if name and name not in ("0", "off", "false", "no"):
        setup(service, exporter=name)


def shutdown() -> None:
    """Flush and turn tracing off (a server's stop; tests)."""
    global ENABLED, _tracer, _provider
    provider, _provider = _provider, None
    ENABLED, _tracer = False, None
    if provider is not None and hasattr(provider, "force_flush"):
        provider.force_flush()


@contextlib.contextmanager
def span(
    name: str,
    attributes: Mapping[str, Any],
    *,
    remote: Sequence[tuple[str, str | bytes]] = (),
    server: bool = False,
) -> Iterator[Any]:
    """A span, current within the block; its parent is the current span, or the trace
    context in ``remote`` (gRPC metadata) where that has one. An exception escaping the
    block marks it failed."""
    from opentelemetry import trace

    context = None
    if remote:
        carrier = {k: v.decode() if isinstance(v, bytes) else v for k, v in remote}
        context = _propagator.extract(carrier)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    with _tracer.start_as_current_span(
        name, context=context, kind=kind, attributes=dict(attributes)
    ) as current:
        yield current


def failed(current: Any, why: str) -> None:
    """Mark ``current`` failed with ``why`` (an outcome that is not an exception)."""
    from opentelemetry.trace import Status, StatusCode

    current.set_status(Status(StatusCode.ERROR, why))


def inject() -> tuple[tuple[str, str], ...]:
    """The current span's trace context as gRPC metadata (empty: no current span)."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return tuple(carrier.items())


def ids() -> dict[str, str]:
    """The current trace and span ids (for log lines); empty without a current span."""
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
