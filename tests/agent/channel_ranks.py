"""Support for tests of the app-channel backend with several ranks of one job: a real
grpc.aio server whose WorkloadChannel is a ChannelHub, and rank workloads registered
through the real ``register_workload`` (each its own stream and worker thread).

Each rank holds a few bytes "on the device" that a snapshot moves to "the host" and a
restore brings back, so a test can check the data is intact after any move.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from tslice.agent import app as agent_app
from tslice.agent import channel
from tslice.agent import config as agent_config
from tslice.agent.backends import app_channel, base, services
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc
from tslice.workload import WorkloadHandle, register_workload

from . import raw_workload

#: Seconds a rank waits at a barrier for the others: a bound that fails the test if the
#: agent asked the ranks one after another, never a synchronisation by time.
BARRIER_TIMEOUT_S = 30.0


class RankAgent:
    """The agent side: a hub behind a real server, and the app-channel backend on it."""

    def __init__(self, hub: channel.ChannelHub, address: str) -> None:
        self.hub = hub
        self.address = address
        node = services.NodeServices(
            node="node-a",
            state_dir=Path("/nonexistent"),
            hub=hub,
            processes=registration.ProcessRegistry(),
        )
        self.backend = app_channel.AppChannelBackend.create_on_node(
            {"command_timeout_s": 60, "register_wait_s": 0}, node
        )
        self.handles: list[WorkloadHandle] = []


@contextlib.asynccontextmanager
async def rank_agent(**hub_settings: Any) -> AsyncIterator[RankAgent]:
    hub = channel.ChannelHub(ping_interval_s=0.2, **hub_settings)
    served = await raw_workload.start_hub(hub, "127.0.0.1:0")
    server = served.server
    agent = RankAgent(hub, served.address)
    try:
        yield agent
    finally:
        for handle in agent.handles:
            await asyncio.to_thread(handle.close)
        await hub.close()
        await server.stop(grace=None)


class Rank:
    """One rank's workload: its data moves between "device" and "host"."""

    def __init__(self, rank: int, *, gate: threading.Barrier | None = None) -> None:
        self.rank = rank
        self.device: bytes | None = bytes([rank]) * 64
        self.original = self.device
        self.host: bytes | None = None
        #: Every rank waits here when asked to snapshot (or restore), before answering.
        self.gate = gate
        self.restore_gate: threading.Barrier | None = None
        self.fail_snapshot = False
        self.fail_restore = False
        self.calls: list[str] = []

    def on_snapshot(self, mode: str, tags: list[str]) -> dict[str, int]:
        self.calls.append("snapshot")
        if self.gate is not None:
            self.gate.wait(BARRIER_TIMEOUT_S)
        assert self.device is not None
        self.host, self.device = self.device, None
        if self.fail_snapshot:  # half-way: its bytes are off the device, it fails anyway
            raise RuntimeError(f"rank {self.rank} ran out of host memory")
        return {"device_bytes": len(self.host), "host_bytes": len(self.host)}

    def on_restore(self, tags: list[str]) -> dict[str, int]:
        self.calls.append("restore")
        if self.restore_gate is not None:
            self.restore_gate.wait(BARRIER_TIMEOUT_S)
        if self.fail_restore:
            raise RuntimeError(f"rank {self.rank} cannot allocate device memory")
        if self.host is not None:
            self.device, self.host = self.host, None
        return {"device_bytes": len(self.device or b"")}


async def register_ranks(
    agent: RankAgent, job_id: str, group: str, ranks: list[Rank], **kwargs: Any
) -> list[WorkloadHandle]:
    """Register each rank as its own workload of (job, group), and wait for all."""
    handles = []
    for rank in ranks:
        handle = register_workload(
            agent.address,
            job_id,
            group,
            on_snapshot=rank.on_snapshot,
            on_restore=rank.on_restore,
            rank=rank.rank,
            ping_interval_s=0.2,
            backoff_initial_s=0.05,
            **kwargs,
        )
        agent.handles.append(handle)
        handles.append(handle)
    for handle in handles:
        assert await asyncio.to_thread(handle.wait_registered, 10), handle.error

    # A handle is registered once the agent acknowledged it: the hub holds its session.
    assert sorted(agent.hub.rank_states(job_id, group)) == sorted(r.rank for r in ranks)
    return handles


def job(job_id: str, group: str = "g") -> base.JobContext:
    config = pb.BackendConfig(app_channel=pb.AppChannelConfig())
    return base.JobContext(job_id=job_id, group=group, config=config)


@contextlib.asynccontextmanager
async def real_agent(tmp: Path, **settings: Any) -> AsyncIterator[tuple[Any, Path]]:
    """The whole agent (``tslice.agent.app.serve``) on a Unix socket in ``tmp`` (keep it
    short: socket paths are limited to ~100 bytes), app-channel its only backend; yields
    its stub and socket."""
    socket = tmp / "agent.sock"
    config = agent_config.AgentConfig(
        node_name="node-a",
        port=0,
        state_dir=tmp / "state",
        unix_socket=socket,
        # Next to the agent socket, where workloads bind their channel to their process.
        register_socket=tmp / "register.sock",
        backends=("app-channel",),
        backend_settings={"app-channel": {"command_timeout_s": 30, **settings}},
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(agent_app.serve(config, ready=ready.set_result, stop=stop))
    try:
        await asyncio.wait_for(ready, timeout=20)
        async with grpc.aio.insecure_channel(f"unix:{socket}") as link:
            yield pb_grpc.SnapshotAgentServiceStub(link), socket
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)


#: One rank as its own process: ``python -c RANK_PROCESS socket job group rank fail``.
#: It prints ``registered True``, then ``asked <kind>`` when sent a command; a snapshot
#: answers only after a ``go`` line on stdin (so a test sees every rank asked before any
#: answers); ``fail`` = ``snapshot`` makes its snapshot fail. On ``quit`` it closes its
#: channel and prints whether its bytes are back on its "device", unchanged.
RANK_PROCESS = """
import queue, sys
from tslice.workload import register_workload
sock, job, group, rank, fail = sys.argv[1:6]
rank = int(rank)
original = bytes([rank]) * 64
held = {"device": original, "host": None}
go = queue.Queue()

def on_snapshot(mode, tags):
    print("asked snapshot", flush=True)
    go.get(timeout=60)
    held["host"], held["device"] = held["device"], None
    if fail == "snapshot":  # half-way: its bytes are off the device, it fails anyway
        raise RuntimeError(f"rank {rank} ran out of host memory")
    return {"device_bytes": 64, "host_bytes": 64}

def on_restore(tags):
    print("asked restore", flush=True)
    if held["host"] is not None:
        held["device"], held["host"] = held["host"], None
    return {"device_bytes": 64}

handle = register_workload("unix:" + sock, job, group, on_snapshot=on_snapshot,
                           on_restore=on_restore, rank=rank)
print("registered", handle.wait_registered(20), flush=True)
for line in sys.stdin:
    if line.strip() == "go":
        go.put(None)
    elif line.strip() == "quit":
        break
handle.close()
print("intact", held["device"] == original and held["host"] is None, flush=True)
"""
