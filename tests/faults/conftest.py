"""One process stack for every fault test: each test has groups of its own.

Groups on node-1 use disjoint devices, so they never wait for one another (no device
claim between them); every other faulty node serves one group. node-1 runs in a network
namespace of its own when namespaces can be made here, so a test can cut its link. A
test that kills or cuts something brings it back before it ends, so the next test finds
the stack whole.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.faults.processes import GroupNodes, Netns, Stack

#: Every switch on node-1 takes this long per copy: long enough to act in
#: the middle of one (the events say when a copy is under way), short enough for a suite.
COPY_S = 1.0
FAST = ["--backend", "sim", "--sim-capacity", "80GiB", "--sim-footprint", "1GiB",
        "--sim-bandwidth", "1TB/s", "--sim-latency", "0"]  # fmt: skip
SLOW = [*FAST, "--sim-devices", "8", "--sim-extra-latency", str(COPY_S)]
#: node-hold's copies take this long: the test that kills it mid-snapshot ends the copy
#: itself (the kill), so no runner is slow enough to see it finish first; it restarts the
#: agent with quick copies.
HOLD_S = 300
HOLD = [*FAST, "--sim-extra-latency", str(HOLD_S)]
#: Seed 1: the first copy hangs, the next ones do not (Random(1): 0.13, 0.85, 0.76).
HANG_ONCE = [*FAST, "--sim-hang-prob", "0.5", "--sim-seed", "1", "--operation-timeout", "1"]
FAIL_ALWAYS = [*FAST, "--sim-devices", "2", "--sim-fail-prob", "1.0"]

#: The states an orchestrator is SIGKILLed in, one group each on node-1.
KILL_STATES = ("idle", "locked", "yielded", "switching", "waiters")
GROUPS: dict[str, GroupNodes] = {
    **{group: {"node-1": [i]} for i, group in enumerate(KILL_STATES)},
    "restart": {"node-hold": None},
    "down": {"node-down": None},
    "deadline": {"node-hang": None},
    "failing": {"node-fail": [0]},
    "failing-retried": {"node-fail": [1]},
    "partition": {"node-1": [len(KILL_STATES) + 1]},
}
ORCHESTRATOR = {
    "backoff_initial_s": 0.05,
    "backoff_max_s": 0.25,
    # A silent partition is noticed within an agent call's deadline.
    "agent_rpc_timeout_s": 2.0,
    "wait_chunk_s": 1.0,
    "status_timeout_s": 1.0,
    "shutdown_grace_s": 1.0,
    "max_refusals": 3,
    "max_operation_failures": 3,
}
#: Why the partition is made with SIGSTOP instead of a network namespace ("" = namespace);
#: TSLICE_TEST_NETNS=0 asks for SIGSTOP anyway (to exercise that path as root).
NO_NETNS = "TSLICE_TEST_NETNS=0" if os.environ.get("TSLICE_TEST_NETNS") == "0" else Netns.usable()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report shows the end of every server's log (the stack's directory
    is deleted at the end of the run)."""
    outcome: Any = yield
    report = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("stack")
    if report.when == "call" and report.failed and isinstance(stack, Stack):
        report.sections.append(("servers' logs (last lines)", stack.logs(last=40)))


@pytest.fixture(autouse=True)
def _stack_left_whole(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test the stack is whole again even if the test failed half-way (a test
    that dies with the orchestrator killed would otherwise fail every later one)."""
    yield
    if "stack" in request.fixturenames:
        request.getfixturevalue("stack").make_whole()


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    base = Path(tempfile.mkdtemp(prefix="tslice-faults-"))
    netns = Netns(os.getpid() % 10_000)
    if not NO_NETNS:
        netns.create()
    agents = {
        "node-1": SLOW,
        "node-hold": HOLD,
        "node-down": FAST,
        "node-hang": HANG_ONCE,
        "node-fail": FAIL_ALWAYS,
    }
    running = Stack(
        base,
        agents,
        GROUPS,
        orchestrator_settings=ORCHESTRATOR,
        netns={} if NO_NETNS else {"node-1": netns},
    )
    try:
        yield running.start()
    finally:
        running.stop()
        if not NO_NETNS:
            netns.delete()
    shutil.rmtree(base, ignore_errors=True)  # kept when the stack failed, for its logs
