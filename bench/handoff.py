"""Hand-over latency: job A yields -> job B's blocked Acquire returns.

Runs a real orchestrator and two agents with the ``noop`` backend (one group spanning
both nodes) as separate processes on 127.0.0.1, so the figure is the control path alone:
Yield, snapshot of A and restore of B on both nodes concurrently, the grant, and B's
Acquire reply. Next to it, in the same run and process, a bare gRPC unary round trip
(the standard health Check against the same orchestrator). The ratio is the number to
watch: machine noise moves both figures together.

A and B use the client library (``AsyncClient``, whose Acquire and Yield travel on its
``Session`` stream; the orchestrator sends each node its Grant on a ``GrantStream``); B's
Acquire is known to be queued from the QUEUED event of a WatchEvents stream filtered to
that kind on the server. On a 2-core machine the four processes compete for CPU, and that
contention is most of what separates the two figures; see the orchestrator's and agent's
module docs for what the hand-over does.

    python bench/handoff.py [--rounds 300] [--json]

Target: median hand-over <= 5 x the bare round trip (the llm-d reference polls every
second, so its hand-over takes more than a second).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import AsyncClient
from tslice.sim.cluster import LocalCluster, SimAgent

GROUP = "pool"


def _summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        "median_ms": statistics.median(ordered) * 1000,
        "p99_ms": p99 * 1000,
        "n": len(ordered),
    }


async def _bare_round_trips(address: str, rounds: int) -> list[float]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        request = health_pb2.HealthCheckRequest(service="")
        for _ in range(20):  # warm the connection up
            await stub.Check(request)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            await stub.Check(request)
            samples.append(time.perf_counter() - start)
        return samples


async def _handoffs(
    address: str, rounds: int, warmup: int, lease_s: float | None = 30.0
) -> list[float]:
    a = AsyncClient(address, job_id="job-a", lease_s=lease_s)
    b = AsyncClient(address, job_id="job-b", lease_s=lease_s)
    samples: list[float] = []
    async with grpc.aio.insecure_channel(address) as channel:
        watcher = opb_grpc.TimeSliceOrchestratorServiceStub(channel)  # type: ignore[no-untyped-call]
        events = watcher.WatchEvents(
            opb.WatchEventsRequest(group_id=GROUP, kinds=[opb.OrchestratorEvent.KIND_QUEUED])
        )
        # The server sends headers once subscribed: no QUEUED event can be missed after this.
        await events.initial_metadata()
        try:
            await a.acquire(GROUP)
            holder, waiter = a, b
            for i in range(rounds + warmup):
                pending = asyncio.create_task(waiter.acquire(GROUP))
                # Yield only once the orchestrator has queued the waiter.
                async for event in events:
                    queued = opb.OrchestratorEvent.KIND_QUEUED
                    if event.kind == queued and event.job_id == waiter.job_id:
                        break
                start = time.perf_counter()
                await holder.yield_(GROUP)
                result = await pending
                elapsed = time.perf_counter() - start
                if not result.success:
                    raise RuntimeError(f"acquire failed: {result}")
                if i >= warmup:
                    samples.append(elapsed)
                holder, waiter = waiter, holder
            await holder.yield_(GROUP)
        finally:
            events.cancel()
            for client in (a, b):
                await client.close()
    return samples


async def _measure(rounds: int, warmup: int, lease_s: float | None) -> dict[str, object]:
    agents = [SimAgent(name="node-1", backend="noop"), SimAgent(name="node-2", backend="noop")]
    with LocalCluster(agents=agents, groups={GROUP: ("node-1", "node-2")}) as cluster:
        address = cluster.orchestrator_address
        # Interleave the two measurements so that both see the same machine state.
        bare: list[float] = []
        handoff: list[float] = []
        chunk = max(1, rounds // 5)
        for _ in range(0, rounds, chunk):
            bare += await _bare_round_trips(address, chunk)
            handoff += await _handoffs(address, chunk, warmup, lease_s)
    hand = _summary(handoff)
    rtt = _summary(bare)
    return {
        "handoff": hand,
        "bare_rtt": rtt,
        "ratio_median": hand["median_ms"] / rtt["median_ms"],
        "ratio_p99": hand["p99_ms"] / rtt["p99_ms"],
        "nodes": 2,
        "backend": "noop",
        "lease": lease_s is not None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300, help="hand-overs to measure")
    parser.add_argument("--warmup", type=int, default=5, help="hand-overs discarded per chunk")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-lease",
        action="store_true",
        help="clients without holder leases (no Hold stream), as llm-d clients are",
    )
    args = parser.parse_args(argv)
    result = asyncio.run(_measure(args.rounds, args.warmup, None if args.no_lease else 30.0))
    if args.json:
        print(json.dumps(result))
        return 0
    hand, rtt = result["handoff"], result["bare_rtt"]
    assert isinstance(hand, dict) and isinstance(rtt, dict)
    print("hand-over (A yields -> B's Acquire returns), noop agents on 2 nodes")
    print(f"  {'':28} {'median':>10} {'p99':>10}   n")
    for label, row in (("hand-over", hand), ("bare gRPC unary round trip", rtt)):
        print(f"  {label:28} {row['median_ms']:>8.2f}ms {row['p99_ms']:>8.2f}ms {row['n']:>4}")
    ratio_median, ratio_p99 = result["ratio_median"], result["ratio_p99"]
    print(f"  ratio: median {ratio_median:.2f}x, p99 {ratio_p99:.2f}x (target: median <= 5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
