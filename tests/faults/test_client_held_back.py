"""tslice's own clients, whose Acquire goes over the ``Session`` stream, are told why a
fault holds it back: the request carries its time left (``timeout_ms``), so the
orchestrator answers ``UNAVAILABLE`` with the reason before the timeout, as it answers a
unary call with a deadline; one merely queued behind a holder still times out.

A stack of its own (this module's ``stack`` overrides the package's): ``down`` on an
agent the test kills (the group is ``UNKNOWN``), ``failing`` on one whose every copy
fails (the switch step is retried; ``max_operation_failures`` is high so that the node
is not degraded, which would refuse the waiter at once, deadline or not), ``queued`` on a
healthy one. The clients do not retry (``NO_RETRY``): a retry of the answer, sent with
the last 0.2 s left, races the client's own deadline, and what is tested is the answer.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import tslice
from tests.faults.conftest import FAIL_ALWAYS, FAST, ORCHESTRATOR
from tests.faults.processes import Stack
from tests.faults.stack import K, Orchestrator
from tslice.client import NO_RETRY
from tslice.common import errors

#: The Acquire's timeout in these tests: the answer comes 0.2 s before it.
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    base = Path(tempfile.mkdtemp(prefix="tslice-held-back-"))
    running = Stack(
        base,
        {"node-down": FAST, "node-fail": FAIL_ALWAYS, "node-ok": FAST},
        {"down": {"node-down": None}, "failing": {"node-fail": None}, "queued": {"node-ok": None}},
        orchestrator_settings={**ORCHESTRATOR, "max_operation_failures": 1000},
    )
    try:
        yield running.start()
    finally:
        running.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_an_acquire_while_an_agent_is_unreachable_is_unavailable_naming_it(
    stack: Stack,
) -> None:
    stack.agents["node-down"].kill()
    client = tslice.Client(stack.orchestrator.address, job_id="j", retry=NO_RETRY)
    with client, pytest.raises(errors.TsliceError) as err:
        client.acquire("down", timeout=TIMEOUT_S)
    assert type(err.value) is errors.Unavailable, repr(err.value)
    assert "not granted within the call's deadline" in str(err.value), err.value
    assert "node-down" in str(err.value), err.value


def test_tslice_acquire_says_why_an_unreachable_agent_holds_it_back(stack: Stack) -> None:
    # The orchestrator answers (it is reachable): its reason is printed, not "not reachable".
    stack.agents["node-down"].kill()
    command = ["acquire", "down", "j-cli", "--timeout", str(TIMEOUT_S)]
    done = subprocess.run(
        [sys.executable, "-m", "tslice", *command, "--addr", stack.orchestrator.address],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert "not granted within the call's deadline" in done.stderr, done.stderr
    assert "node-down" in done.stderr, done.stderr
    assert "not reachable" not in done.stderr, done.stderr


async def test_an_acquire_behind_a_switch_that_keeps_failing_is_unavailable_naming_why(
    stack: Stack,
) -> None:
    o = Orchestrator(stack.orchestrator.address)
    address = stack.orchestrator.address
    try:
        async with (
            tslice.AsyncClient(address, job_id="a") as a,
            tslice.AsyncClient(address, job_id="b", retry=NO_RETRY) as b,
        ):
            await a.acquire("failing")
            events = await o.events("failing")
            waiter = asyncio.ensure_future(b.acquire("failing", timeout=TIMEOUT_S))
            await events.wait_for(K.KIND_QUEUED, job="b")
            await a.yield_("failing")  # a's snapshot fails, and is retried
            with pytest.raises(errors.TsliceError) as err:
                await waiter
            events.cancel()
        assert type(err.value) is errors.Unavailable, repr(err.value)
        assert "injected failure" in str(err.value), err.value
    finally:
        await o.close()


def test_an_acquire_only_queued_behind_a_holder_still_times_out(stack: Stack) -> None:
    address = stack.orchestrator.address
    with tslice.Client(address, job_id="a") as a, tslice.Client(address, job_id="b") as b:
        a.acquire("queued")
        with pytest.raises(errors.AcquireTimeout) as err:
            b.acquire("queued", timeout=TIMEOUT_S)
        assert "no longer queued" in str(err.value), err.value
        assert b.status("queued").waiting_jobs == (), "b left the queue"
        a.yield_("queued")
