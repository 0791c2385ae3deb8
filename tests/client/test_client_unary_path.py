"""The llm-d-compatible unary path (tslice.client.compat._unary): an orchestrator without
the Session stream (llm-d's) gets Acquire and Yield as unary calls, from the sync and the
async client alike; and that decision is taken in that one place only."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

import tslice
import tslice.client
from tests.client.client_fakes import FakeOrchestrator, ServerThread
from tslice.client.compat import _unary
from tslice.rpc import multiplex


def fake(server: ServerThread) -> FakeOrchestrator:
    return server.servicer  # type: ignore[no-any-return]


def methods(server: ServerThread) -> list[str]:
    return [call.method for call in fake(server).calls]


def test_sync_client_against_an_llm_d_orchestrator(orchestrator: ServerThread) -> None:
    with tslice.Client(orchestrator.address, job_id="me", lease_s=None) as client:
        assert client.acquire("g").success
        assert client.yield_("g").success
        assert client.acquire("g").success
    # The orchestrator double has no Session (it answers UNIMPLEMENTED, as llm-d's does).
    assert methods(orchestrator) == ["Acquire", "Yield", "Acquire"]
    assert all(c.metadata.get("x-tslice-job-id") == "me" for c in fake(orchestrator).calls)


async def test_async_client_against_an_llm_d_orchestrator(orchestrator: ServerThread) -> None:
    async with tslice.AsyncClient(orchestrator.address, job_id="me", lease_s=None) as client:
        assert (await client.acquire("g")).success
        assert (await client.yield_("g")).success
    assert methods(orchestrator) == ["Acquire", "Yield"]


def test_llm_d_drop_in_client_against_an_llm_d_orchestrator(orchestrator: ServerThread) -> None:
    with (
        tslice.TimeSliceOrchestratorClient(orchestrator.address, "me", "g") as client,
        client.on_accelerators() as granted,
    ):
        assert granted.success
    assert methods(orchestrator) == ["Acquire", "Yield"]


async def test_the_fallback_uses_the_session_while_it_works() -> None:
    unary_calls: list[Any] = []

    async def session(request: str, timeout: float | None) -> str:
        return f"session:{request}:{timeout}"

    async def unary(request: str, **kwargs: Any) -> str:
        unary_calls.append((request, kwargs))
        return f"unary:{request}"

    call = _unary.UnaryFallback(session, unary)
    assert await call("a", timeout=2.0) == "session:a:2.0"
    assert unary_calls == []


async def test_the_fallback_makes_the_unary_call_when_the_session_is_unsupported() -> None:
    async def session(request: str, timeout: float | None) -> str:
        raise multiplex.Unsupported("the orchestrator")

    async def unary(request: str, **kwargs: Any) -> str:
        return f"unary:{request}:{kwargs}"

    call = _unary.UnaryFallback(session, unary)
    metadata = (("x-tslice-job-id", "j"),)
    assert await call("a", timeout=2.0, metadata=metadata) == (
        f"unary:a:{ {'timeout': 2.0, 'metadata': metadata} }"
    )


def test_the_sync_fallback_cancels_the_unary_call_it_made() -> None:
    class Future:
        cancelled = False

        def result(self) -> str:
            raise KeyboardInterrupt  # Ctrl-C while waiting

        def cancel(self) -> None:
            self.cancelled = True

    made: list[Future] = []

    class Unary:
        def future(self, request: str, **kwargs: Any) -> Future:
            made.append(Future())
            return made[-1]

    def session(request: str, timeout: float | None) -> str:
        raise multiplex.Unsupported("the orchestrator")

    outcome = _unary.SyncUnaryFallback(session, Unary()).future("a", timeout=1.0)
    with pytest.raises(KeyboardInterrupt):
        outcome.result()
    outcome.cancel()  # what the transport does on an interrupt
    assert len(made) == 1 and made[0].cancelled


def test_nothing_else_in_the_client_branches_on_the_unary_path() -> None:
    root = pathlib.Path(tslice.client.__file__).parent
    branching = re.compile(r"except .*Unsupported|\.supported\b")
    places = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if branching.search(path.read_text())
    )
    assert places == ["compat/_unary.py"]
