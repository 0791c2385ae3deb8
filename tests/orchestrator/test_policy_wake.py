"""The group driver wakes its lock (tslice.orchestrator.group.wake): under cost-aware, a real
orchestrator keeps an idle group for its yielded resident whose gaps are short, grants the
resident's quick re-acquire at no cost ahead of a waiter whose switch-in would cost more,
and, when the resident does not come back, grants the waiter once the hold ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import tslice.client as tsclient
from tslice.sim import cluster


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    config = tmp_path / "orchestrator.yaml"
    # b's switch-in is assumed to cost 5 s; a's gaps (~50 ms) are far shorter, and the
    # group waits up to 100 of them for a (capped by b's max_defer_s).
    config.write_text(
        "policy: {kind: cost-aware, default_switch_s: 5, gap_patience: 100, max_defer_s: 30}\n"
    )
    with cluster.LocalCluster(
        agents=[cluster.SimAgent(name="node-1", backend="noop")],
        orchestrator_args=["--config", str(config)],
    ) as running:
        yield running.orchestrator_address


def test_the_resident_comes_back_first_and_the_waiter_is_woken_when_it_does_not(
    address: str,
) -> None:
    with tsclient.Client(address, job_id=None) as client:
        for _ in range(3):  # a's gaps, learnt by the lock
            client.acquire("g", job_id="a")
            client.yield_("g", job_id="a")
            time.sleep(0.05)  # the job's own gap between its phases (its workload)
        client.acquire("g", job_id="a")

        granted_b = threading.Event()

        def b() -> None:
            with tsclient.Client(address, job_id="b") as other:
                other.acquire("g", timeout=60)
                granted_b.set()
                other.yield_("g")

        waiter = threading.Thread(target=b, daemon=True)
        waiter.start()
        while "b" not in client.status("g").waiting_jobs:
            assert waiter.is_alive()

        client.yield_("g", job_id="a")
        client.acquire("g", job_id="a")  # back within its usual gap: no switch
        held = client.status("g")
        assert (held.locking_job, held.waiting_jobs) == ("a", ("b",))
        assert not granted_b.is_set()

        client.yield_("g", job_id="a")  # and now a does not come back: b is woken
        waiter.join(timeout=60)
        assert granted_b.is_set()
