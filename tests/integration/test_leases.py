"""Holder leases on real processes: a SIGKILLed holder loses the group within its lease,
and a live holder keeps it across an orchestrator restart through its background Hold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest

import tslice
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster

LEASE_S = 1.0


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(agents=1, groups={"g": ("node-1",)}) as local:
        yield local


def test_sigkilled_holder_loses_the_group_within_its_lease(cluster: LocalCluster) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time, tslice
        client = tslice.Client({cluster.orchestrator_address!r}, job_id="doomed",
                               lease_s={LEASE_S})
        client.acquire("g")
        print("held", flush=True)
        time.sleep(600)
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with tslice.Client(cluster.orchestrator_address, job_id="waiter", lease_s=None) as client:
            assert client.status("g").locking_job == "doomed"
            holder.send_signal(signal.SIGKILL)
            holder.wait(10)
            killed = time.monotonic()
            granted = client.acquire("g", timeout=30)
            waited = time.monotonic() - killed
            assert granted.success and client.status("g").locking_job == "waiter"
            # The lease runs from the moment the dead client's Hold stream closed.
            assert LEASE_S * 0.5 <= waited < LEASE_S + 10
            client.yield_("g")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()


#: The lease of a holder that must outlive an orchestrator restart: docs/operations.md asks
#: for 5 s or more there. After a long outage the client's channel waits up to ~2.4 s
#: (gRPC's reconnect back-off, 2 s +- 20 %) before it tries again, so the 1-s lease this
#: test used ran out with its holder alive whenever a loaded runner made the restart slow
#: (with the outage below: lost in 5 of 6 runs at 1 s, kept in every run at 5 s).
RESTART_LEASE_S = 5.0
#: How long the orchestrator stays down: a restart as slow as a loaded runner's, long
#: enough for the client's reconnect back-off to reach its cap (the injected fault).
OUTAGE_S = 3.0


def test_background_hold_keeps_the_group_across_an_orchestrator_restart(
    cluster: LocalCluster,
) -> None:
    with tslice.Client(
        cluster.orchestrator_address, job_id="trainer", lease_s=RESTART_LEASE_S
    ) as client:
        client.acquire("g")
        cluster.kill(ORCHESTRATOR, signal.SIGTERM)
        time.sleep(OUTAGE_S)  # the fault itself: the orchestrator is down this long
        cluster.restart(ORCHESTRATOR)
        serving = time.monotonic()
        # The holder works (sleeps) past its lease, counted from the restart (when it
        # serves again); its Hold thread re-opened the stream meanwhile.
        time.sleep(RESTART_LEASE_S + 1.0)
        assert time.monotonic() - serving > RESTART_LEASE_S
        assert client.status("g").locking_job == "trainer"
        assert client.lost_leases == {}
        assert client.yield_("g").success
        assert client.status("g").locking_job == ""


_WAITERS = {
    "async": """
        import asyncio, tslice
        async def main():
            async with tslice.AsyncClient({address!r}, job_id="doomed", lease_s=None) as client:
                await client.acquire("g")
        asyncio.run(main())
        """,
    "sync": """
        import tslice
        with tslice.Client({address!r}, job_id="doomed", lease_s=None) as client:
            client.acquire("g")
        """,
}


@pytest.mark.parametrize("kind", sorted(_WAITERS))
def test_sigkilled_waiter_on_a_session_stream_leaves_the_queue(
    cluster: LocalCluster, kind: str
) -> None:
    """A client's Acquire waits on its Session stream; when the process dies, the stream
    ends and the orchestrator drops the waiter (no ghost waiter)."""
    script = textwrap.dedent(_WAITERS[kind].format(address=cluster.orchestrator_address))
    with (
        tslice.Client(cluster.orchestrator_address, job_id="holder", lease_s=None) as client,
        grpc.insecure_channel(cluster.orchestrator_address) as channel,
    ):
        client.acquire("g")
        stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        events = stub.WatchEvents(opb.WatchEventsRequest(group_id="g"))
        events.initial_metadata()  # subscribed: no later event is missed
        waiter = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy())
        try:
            queued = next(e for e in events if e.job_id == "doomed")
            assert queued.kind == opb.OrchestratorEvent.KIND_QUEUED
            waiter.send_signal(signal.SIGKILL)
            waiter.wait(10)
            left = next(e for e in events if e.job_id == "doomed")
            assert left.kind == opb.OrchestratorEvent.KIND_CANCELLED
            assert client.status("g").waiting_jobs == ()
            # Nobody waits: the holder's yield defers its snapshot.
            assert client.yield_("g").snapshot_deferred
        finally:
            events.cancel()
            if waiter.poll() is None:
                waiter.kill()
                waiter.wait()
