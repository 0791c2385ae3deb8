"""The llm-d-compatible unary path (tslice.client.compat._unary): an orchestrator without
the Session stream (llm-d's) gets Acquire and Yield as unary calls, from the sync and the
async client alike; and that decision is taken in that one place only."""

from __future__ import annotations

import pathlib
import re
import threading
from typing import Any

import tslice
import tslice.client
from tests.client.client_fakes import FakeOrchestrator, ServerThread
from tslice.client.compat import _unary


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


def test_the_unary_calls_are_started_by_one_thread_per_channel() -> None:
    """No helper thread per call: the channel's starter thread starts them all, and a
    call whose caller gave up (Ctrl-C) before it was started is cancelled by it."""
    release = threading.Event()
    threads: set[str] = set()

    class Future:
        cancelled = False

        def result(self) -> str:
            return "done"

        def cancel(self) -> None:
            self.cancelled = True

    made: list[Future] = []

    class Unary:
        def future(self, request: str, **kwargs: Any) -> Future:
            threads.add(threading.current_thread().name)
            release.wait(10)
            made.append(Future())
            return made[-1]

    starter = _unary.Starter("tslice-unary-calls")
    try:
        started = _unary.Started(starter, Unary())
        release.set()
        assert [started.future(str(i), timeout=1.0).result() for i in range(3)] == ["done"] * 3
        release.clear()
        given_up = started.future("late", timeout=1.0)
        given_up.cancel()  # what the transport does on an interrupt, before the start
        release.set()
        assert given_up._started.wait(10)
        assert len(made) == 4 and made[-1].cancelled
        assert threads == {"tslice-unary-calls"}
    finally:
        starter.close()


def test_nothing_else_in_the_client_branches_on_the_unary_path() -> None:
    root = pathlib.Path(tslice.client.__file__).parent
    branching = re.compile(r"except .*Unsupported|\.supported\b")
    places = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if branching.search(path.read_text())
    )
    assert places == ["_services.py"]
