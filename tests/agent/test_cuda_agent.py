"""The cuda backend wired into a real in-process agent (gRPC), over the shipped FakeDriver.

The fake driver and NVML stand for the GPU node: they outlive agent restarts, like a
checkpointed process outlives a crashed agent.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from tslice.agent import nvml
from tslice.agent.backends import cuda, cuda_driver, cuda_fake, cuda_settings
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 2**30
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
S = cuda_driver.ProcessState


@dataclasses.dataclass
class GpuNode:
    pids: list[int]
    nvml: nvml.FakeNvml
    driver: cuda_fake.FakeDriver
    registry: registration.ProcessRegistry

    def backend(self, **settings: Any) -> cuda.CudaBackend:
        """A fresh backend instance, as a (re)started agent builds it."""
        return cuda.CudaBackend(
            settings=cuda_settings.CudaSettings(**settings),
            driver=self.driver,
            nvml=self.nvml,
            registry=self.registry,
        )

    def config(self) -> pb.BackendConfig:
        return pb.BackendConfig(
            cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=self.pids))
        )


@pytest.fixture
def node() -> Iterator[GpuNode]:
    children = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    pids = [c.pid for c in children]
    gpus = nvml.FakeNvml([nvml.FakeGpu(GPU0, 80 * GiB)])
    driver = cuda_fake.FakeDriver(nvml=gpus)
    for pid in pids:
        driver.add_process(pid)
        gpus.gpus[0].compute[pid] = 2 * GiB
    yield GpuNode(pids, gpus, driver, registration.ProcessRegistry())
    for child in children:
        child.kill()
        child.wait()


async def start(agents: Any, node: GpuNode, **settings: Any) -> Any:
    return await agents.start(default_backend="cuda", instances={"cuda": node.backend(**settings)})


async def test_snapshot_and_restore_through_the_agent(agents: Any, node: GpuNode) -> None:
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap.error
    assert snap.snapshot_device_bytes == 4 * GiB
    assert snap.storage_bytes == 4 * GiB
    job = (await agent.jobs())["job-a"]
    assert (job.state, job.backend) == (pb.JOB_STATE_SAVED, "cuda")
    assert [node.driver.states[p] for p in node.pids] == [S.CHECKPOINTED] * 2

    restore = await agent.restore("job-a")  # no config: the recorded PIDs are used
    assert restore.status == pb.OPERATION_STATUS_COMPLETE, restore.error
    assert restore.snapshot_device_bytes == 4 * GiB
    assert await agent.state("job-a") == pb.JOB_STATE_RUNNING
    assert [node.driver.states[p] for p in node.pids] == [S.RUNNING] * 2


async def test_a_completed_operation_reports_its_gb_per_s(agents: Any, node: GpuNode) -> None:
    node.driver.copy_bytes_per_s = 40e9  # 2 GiB per process: about 54 ms each, at once
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap.error
    assert snap.elapsed_ms >= 50
    assert snap.throughput_gbps == pytest.approx(snap.snapshot_device_bytes / snap.elapsed_ms / 1e6)
    restore = await agent.restore("job-a")
    assert restore.throughput_gbps == pytest.approx(4 * GiB / restore.elapsed_ms / 1e6)


async def test_a_snapshot_that_left_memory_on_the_device_faults_the_job(
    agents: Any, node: GpuNode
) -> None:
    node.driver.keeps_memory.add(node.pids[0])
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_FAILED
    assert f"pid {node.pids[0]} {2 * GiB} bytes" in snap.error
    assert await agent.state("job-a") == pb.JOB_STATE_FAULTED  # never SAVED


async def test_agent_restart_keeps_a_checkpointed_job_restorable(
    agents: Any, node: GpuNode
) -> None:
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap.error
    # A new agent process: new backend instance, empty registry; the GPU kept the state.
    restarted = await agents.restart(agent, instances={"cuda": node.backend()})
    assert await restarted.state("job-a") == pb.JOB_STATE_SAVED
    restore = await restarted.restore("job-a")
    assert restore.status == pb.OPERATION_STATUS_COMPLETE, restore.error
    assert [node.driver.states[p] for p in node.pids] == [S.RUNNING] * 2


async def test_a_lock_timeout_is_retried_by_the_agent(agents: Any, node: GpuNode) -> None:
    node.driver.lock_times_out(pid=node.pids[1])
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_COMPLETE, snap.error
    assert node.driver.calls.count(("lock", node.pids[1])) == 2
    assert ("unlock", node.pids[0]) in node.driver.calls  # the rollback of the first try


async def test_checkpoint_failure_faults_then_reset_finds_it_running(
    agents: Any, node: GpuNode
) -> None:
    node.driver.fail("checkpoint", pid=node.pids[0], message="host memory exhausted")
    agent = await start(agents, node)
    snap = await agent.snapshot("job-a", backend_config=node.config())
    assert snap.status == pb.OPERATION_STATUS_FAILED
    assert "host memory exhausted" in snap.error
    assert "RUNNING again" in snap.error
    assert await agent.state("job-a") == pb.JOB_STATE_FAULTED
    reset = await agent.stub.ResetJob(pb.ResetJobRequest(job_id="job-a"))
    assert reset.state == pb.JOB_STATE_RUNNING  # read back from the driver
    again = await agent.snapshot("job-a", backend_config=node.config())
    assert again.status == pb.OPERATION_STATUS_COMPLETE, again.error


async def test_health_reports_the_cuda_backend(agents: Any, node: GpuNode) -> None:
    agent = await start(agents, node)
    reply = await agent.health.Check(health_pb2.HealthCheckRequest(service="cuda"))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    status = await agent.stub.Status(pb.StatusRequest())
    assert [a.id for a in status.accelerator_statuses] == [GPU0]
