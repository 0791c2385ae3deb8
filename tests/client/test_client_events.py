"""watch_events against a real orchestrator: from the moment it is subscribed, no event is
missed (the sync client returns the stream subscribed; the async one offers started())."""

from __future__ import annotations

import asyncio
import pathlib
from collections.abc import AsyncIterator

import pytest

import tslice
from tests.orchestrator.orch_harness import Cluster, one_node


@pytest.fixture
async def cluster(tmp_path: pathlib.Path) -> AsyncIterator[Cluster]:
    async with one_node(tmp_path) as c:
        yield c


async def test_async_events_after_started_are_all_seen(cluster: Cluster) -> None:
    async with tslice.AsyncClient(cluster.orch_address, job_id="a", lease_s=None) as a:
        for round_ in range(20):  # without started(), the first events race the subscription
            events = a.watch_events("g", kinds=["GRANTED", "YIELDED"])
            await events.started()
            await a.acquire("g")
            await a.yield_("g")
            seen = [await events.__anext__(), await events.__anext__()]
            assert [(e.kind, e.job_id) for e in seen] == [("GRANTED", "a"), ("YIELDED", "a")], (
                round_
            )
            await events.aclose()


async def test_sync_watch_events_returns_subscribed(cluster: Cluster) -> None:
    def scenario() -> list[tuple[str, str]]:
        with tslice.Client(cluster.orch_address, job_id="a", lease_s=None) as a:
            seen = []
            for _ in range(20):
                events = a.watch_events("g", kinds=["GRANTED", "YIELDED"])
                a.acquire("g")
                a.yield_("g")
                seen += [(e.kind, e.job_id) for e in (next(events), next(events))]
                events.close()
            return seen

    assert await asyncio.to_thread(scenario) == [("GRANTED", "a"), ("YIELDED", "a")] * 20
