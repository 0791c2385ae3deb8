"""The llm-d-compatible unary path: an orchestrator without the Session stream (llm-d's;
here a real orchestrator whose servicer lacks the RPC) gets Acquire and Yield as unary
calls, from the sync and the async client alike; the channel finds that out once, with
its first call, and that decision is taken in one place only."""

from __future__ import annotations

import pathlib
import re
import threading
from typing import Any

import pytest

import tslice
import tslice.client
from tests.client.helpers import interrupt
from tests.client.servers import QUEUED, Orchestrator, wait_for_event, watching
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client.compat import _unary


def test_sync_client_against_an_llm_d_orchestrator(llm_d_orchestrator: Orchestrator) -> None:
    with tslice.Client(llm_d_orchestrator.address, job_id="me", lease_s=None) as client:
        assert client.acquire("g").success
        assert client.yield_("g").success
        assert client.acquire("g").success
    script = llm_d_orchestrator.script
    assert llm_d_orchestrator.lock_calls() == [("Acquire", "g"), ("Yield", "g"), ("Acquire", "g")]
    assert {c.via for c in script.calls_of("Acquire")} == {"unary"}
    # Asked once, with the first call: the channel then sticks to the unary calls.
    assert script.sessions_refused == 1
    assert all(m.get("x-tslice-job-id") in {"me", None} for m in script.metadata)


async def test_async_client_against_an_llm_d_orchestrator(
    llm_d_orchestrator: Orchestrator,
) -> None:
    address = llm_d_orchestrator.address
    async with tslice.AsyncClient(address, job_id="me", lease_s=None) as client:
        assert (await client.acquire("g")).success
        assert (await client.yield_("g")).success
        assert (await client.acquire("g")).success
        assert (await client.yield_("g")).success
    assert llm_d_orchestrator.lock_calls() == [("Acquire", "g"), ("Yield", "g")] * 2
    assert llm_d_orchestrator.script.sessions_refused == 1


def test_ctrl_c_while_the_unary_acquire_is_being_sent_still_cancels_it(
    llm_d_orchestrator: Orchestrator,
) -> None:
    """An interrupt that lands while the Acquire is on its way (the stub's ``future()``
    has sent it but not returned it yet) still cancels it: the call must not be lost
    between leaving and being held by what the interrupt cancels."""
    address = llm_d_orchestrator.address
    with (
        tslice.Client(address, job_id="other", lease_s=None) as other,
        tslice.Client(address, job_id="me", lease_s=None) as client,
    ):
        other.acquire("g")
        client.yield_("a")  # finds out there is no Session (yielding nothing is fine)
        calls = client._orchestrator("acquire")
        started = calls._acquire
        assert isinstance(started, _unary.Started)
        sent = started._unary
        interrupted = threading.Event()

        class SlowToReturn:
            def future(self, request: opb.AcquireRequest, **options: Any) -> Any:
                outcome = sent.future(request, **options)
                # Returns only once the caller was interrupted (and has given up on it).
                while not interrupted.wait(0.01):
                    pass
                return outcome

        started._unary = SlowToReturn()
        outcome: list[BaseException] = []

        def waiter() -> None:
            try:
                client.acquire("g")
            except BaseException as exc:
                outcome.append(exc)

        with watching(address, "g") as events:
            thread = threading.Thread(target=waiter)
            thread.start()
            wait_for_event(events, QUEUED, "me")
        interrupt(thread)
        thread.join(10)
        interrupted.set()
        assert outcome and isinstance(outcome[0], KeyboardInterrupt)
        llm_d_orchestrator.until(lambda: llm_d_orchestrator.waiting("g") == ())


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


def test_one_place_chooses_the_unary_path() -> None:
    root = pathlib.Path(tslice.client.__file__).parent
    branching = re.compile(r"except .*Unsupported|\.supported\b")
    places = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if branching.search(path.read_text())
    )
    assert places == ["_services.py"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_client_of_our_orchestrator_never_makes_a_unary_acquire_or_yield(
    orchestrator: Orchestrator, kind: str
) -> None:
    if kind == "sync":
        with tslice.Client(orchestrator.address, job_id="me") as client:
            client.acquire("g")
            client.yield_("g")
    else:
        import asyncio

        async def run() -> None:
            async with tslice.AsyncClient(orchestrator.address, job_id="me") as client:
                await client.acquire("g")
                await client.yield_("g")

        asyncio.run(run())
    assert {c.via for c in orchestrator.script.calls if c.method in {"Acquire", "Yield"}} == {
        "session"
    }
