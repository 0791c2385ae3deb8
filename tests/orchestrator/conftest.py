"""Fixtures of the orchestrator tests (see orch_harness.py)."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator

import pytest

from tests.orchestrator.orch_harness import Cluster


@pytest.fixture
async def cluster(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(autouse=True)
async def _no_tasks_left_behind() -> AsyncIterator[None]:
    """Every server and driver task is gone once the test's servers are stopped."""
    yield
    current = asyncio.current_task()
    left = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    names = sorted(t.get_name() for t in left)
    assert not left, f"tasks left behind: {names}"
