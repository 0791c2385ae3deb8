"""The ``stack`` fixture: a real orchestrator + agent (see stack.py), logs on failure."""

from __future__ import annotations

import pathlib
from collections.abc import Generator, Iterator

import pytest

from tests.jobside.stack import Stack, running_stack

_STACK = pytest.StashKey[Stack]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    """A failed test's report carries the servers' logs (shown with the failure)."""
    outcome = yield
    report = outcome.get_result()
    running = item.stash.get(_STACK, None)
    if report.failed and running is not None:
        report.sections.append((f"tslice servers ({report.when})", running.logs()))


@pytest.fixture
def stack(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Stack]:
    """Orchestrator (groups trainer and sampler) and one app-channel agent, per test."""
    with running_stack(tmp_path) as running:
        request.node.stash[_STACK] = running
        yield running
