"""The orchestrator's part of a hand-over's trace (with tracing on:
``tslice.server.tracing``): the ``tslice.handover`` span around a switch, and the client
span of each agent call made within it, whose trace context goes in the call's metadata.
Called only where ``tracing.ENABLED`` was tested, so nothing here runs when it is off."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from tslice.orchestrator import config
from tslice.orchestrator.group import effects as decisions
from tslice.server import tracing

_T = TypeVar("_T")


async def handover(
    run: Coroutine[Any, Any, None],
    *,
    group: str,
    switch: decisions.StartSwitch,
    nodes: Sequence[config.NodeRef],
) -> None:
    """``run`` (a switch) as the root span of its hand-over's trace."""
    attributes = {
        "tslice.group": group,
        "tslice.job": switch.to_job,
        "tslice.from_job": switch.from_job or "",
        "tslice.grant_epoch": switch.epoch,
        "tslice.nodes": [n.name for n in nodes],
        "tslice.recovered": switch.recovered,
    }
    with tracing.span("tslice.handover", attributes):
        await run


def failed(outcome: str, detail: str) -> None:
    """The current hand-over ended without a grant."""
    from opentelemetry import trace

    current = trace.get_current_span()
    current.set_attribute("tslice.outcome", outcome)
    tracing.failed(current, detail)


def in_trace() -> bool:
    """Whether an agent call now is part of a hand-over's trace."""
    return bool(tracing.inject())


async def agent_call(
    make: Callable[[tuple[tuple[str, str], ...]], Awaitable[_T]],
    *,
    metadata: tuple[tuple[str, str], ...],
    operation: str,
    address: str,
    request: object,
) -> _T:
    """An agent call within a hand-over, in its client span: ``make(metadata)`` starts the
    call with ``metadata`` plus this span's trace context."""
    attributes = {
        "tslice.agent": address,
        "tslice.group": str(getattr(request, "group", "")),
        "tslice.job": str(getattr(request, "job_id", "")),
    }
    with tracing.span(f"tslice.agent.{operation}", attributes):
        return await make((*metadata, *tracing.inject()))
