"""A real agent drives a TorchAdapter over the workload channel: bytes reported, bits kept."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

torch = pytest.importorskip("torch")

from tslice.agent import app as agent_app  # noqa: E402
from tslice.agent import config as agent_config  # noqa: E402
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb  # noqa: E402
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2_grpc as pb_grpc  # noqa: E402
from tslice.workload import channel  # noqa: E402
from tslice.workload.adapters import torch as torch_adapter  # noqa: E402

GROUP = "trainer"


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[str, pb_grpc.SnapshotAgentServiceStub]]:
    """A real agent whose default backend is app-channel, and a stub connected to it."""
    config = agent_config.AgentConfig(
        node_name="node-a", port=0, state_dir=tmp_path, default_backend="app-channel"
    )
    stop = asyncio.Event()
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(agent_app.serve(config, ready=ready.set_result, stop=stop))
    address = await asyncio.wait_for(ready, timeout=20)
    async with grpc.aio.insecure_channel(address) as grpc_channel:
        yield address, pb_grpc.SnapshotAgentServiceStub(grpc_channel)
    stop.set()
    await asyncio.wait_for(task, timeout=20)


async def run_op(stub: pb_grpc.SnapshotAgentServiceStub, call: object) -> pb.GetOperationResponse:
    op = await call  # type: ignore[misc]
    return await stub.WaitOperation(
        pb.WaitOperationRequest(operation_id=op.operation_id, timeout_ms=10_000)
    )


async def test_agent_offloads_and_restores_a_torch_job(agent) -> None:
    address, stub = agent
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters())
    optimizer.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    expected = [t.clone() for t in model.state_dict().values()]
    expected += [v.clone() for s in optimizer.state.values() for v in s.values()]
    adapter = torch_adapter.TorchAdapter(model, optimizer)
    handle = channel.register_workload(address, "job-a", GROUP, workload=adapter)
    try:
        assert await asyncio.to_thread(handle.wait_registered, 20)
        await stub.Grant(pb.GrantRequest(job_id="job-a", group=GROUP, grant_epoch=1))

        saved = await run_op(stub, stub.Snapshot(pb.SnapshotRequest(job_id="job-a", group=GROUP)))

        assert saved.status == pb.OPERATION_STATUS_COMPLETE, saved.error
        assert saved.snapshot_device_bytes == adapter.stats.bytes_out > 0
        assert saved.storage_bytes == saved.snapshot_device_bytes
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        status = await stub.Status(pb.StatusRequest())
        (job,) = [j for j in status.job_statuses if j.job_id == "job-a"]
        assert job.state == pb.JOB_STATE_SAVED and job.backend == "app-channel"

        back = await run_op(stub, stub.Restore(pb.RestoreRequest(job_id="job-a", group=GROUP)))

        assert back.status == pb.OPERATION_STATUS_COMPLETE, back.error
        assert back.snapshot_device_bytes == saved.snapshot_device_bytes
        actual = list(model.state_dict().values())
        actual += [v for s in optimizer.state.values() for v in s.values()]
        assert all(torch.equal(a, b) for a, b in zip(expected, actual, strict=True))
    finally:
        await asyncio.to_thread(handle.close)
