"""Fixtures of the orchestrator tests (see orch_harness.py)."""

from __future__ import annotations

import pathlib
from collections.abc import AsyncIterator

import pytest
from orch_harness import Cluster


@pytest.fixture
async def cluster(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        await c.close()
