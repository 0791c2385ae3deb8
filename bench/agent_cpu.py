"""Agent CPU per hand-over: one ``noop`` agent, two jobs taking turns on one group.

A real orchestrator and one agent run as processes on 127.0.0.1 (``LocalCluster``); two
``AsyncClient`` jobs hand the group back and forth, one hand-over at a time, and the
agent's CPU (utime + stime of ``/proc/<pid>/stat``) is read around ``--rounds``
hand-overs after a warm-up. Each hand-over is one Grant on the agent's GrantStream: the
holder's snapshot, then the next job's restore. Unlike ``bench/load.py`` nothing else
runs on the agent, so the figure is what one Grant costs it, without the sharing of
loop turns and transactions that concurrent grants get.

    python bench/agent_cpu.py [--rounds 1500] [--json]

For an A/B against another tree, run it with ``PYTHONPATH=<tree>/src`` for each, in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from tslice.client import AsyncClient
from tslice.sim.cluster import LocalCluster, SimAgent

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_WARMUP = 50
GROUP = "pool"


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


async def _measure(cluster: LocalCluster, rounds: int) -> dict[str, float]:
    address = cluster.orchestrator_address
    a = AsyncClient(address, job_id="job-a", lease_s=None)
    b = AsyncClient(address, job_id="job-b", lease_s=None)
    holder, waiter = a, b
    await holder.acquire(GROUP)

    async def hand_overs(count: int) -> None:
        nonlocal holder, waiter
        for _ in range(count):
            await holder.yield_(GROUP)
            await waiter.acquire(GROUP)
            holder, waiter = waiter, holder

    try:
        await hand_overs(_WARMUP)
        pid = cluster.pid("node-1")
        assert pid is not None
        cpu, start = _cpu_s(pid), time.monotonic()
        await hand_overs(rounds)
        cpu, elapsed = _cpu_s(pid) - cpu, time.monotonic() - start
        await holder.yield_(GROUP)
    finally:
        for client in (a, b):
            await client.close()
    return {"agent_cpu_ms_per_handover": cpu / rounds * 1000, "handovers_per_s": rounds / elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500, help="hand-overs measured")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    agents = [SimAgent(name="node-1", backend="noop")]
    with LocalCluster(agents=agents, groups={GROUP: ("node-1",)}) as cluster:
        result = asyncio.run(_measure(cluster, args.rounds))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"agent CPU {result['agent_cpu_ms_per_handover']:.3f} ms per hand-over "
            f"({result['handovers_per_s']:.0f} hand-overs/s, one at a time)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
