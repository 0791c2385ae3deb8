"""Host memory is a budget (issue 20 §2, DESIGN.md invariant 8): a snapshot that cannot be
parked is refused before anything is frozen, with RESOURCE_EXHAUSTED naming the bytes
needed and available; parked states are accounted per (job, group) and the accounting
survives an agent restart.

A real in-process agent with the cuda backend over the FakeDriver and a FakeNvml node:
four jobs of one process each, 2 GiB on the GPU each; the budget holds two parked states.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tslice.agent import nvml
from tslice.agent.backends import cuda, cuda_driver, cuda_fake, cuda_settings
from tslice.agent.channel import registration
from tslice.agent.jobs import model
from tslice.agent.moves import parking
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

GiB = 2**30
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
S = cuda_driver.ProcessState
JOBS = ("job-a", "job-b", "job-c", "job-d")


@dataclasses.dataclass
class Node:
    pids: dict[str, int]
    nvml: nvml.FakeNvml
    driver: cuda_fake.FakeDriver

    def backend(self) -> cuda.CudaBackend:
        return cuda.CudaBackend(
            settings=cuda_settings.CudaSettings(),
            driver=self.driver,
            nvml=self.nvml,
            registry=registration.ProcessRegistry(),
        )

    def config(self, job: str) -> pb.BackendConfig:
        target = pb.ProcessTarget(pids=[self.pids[job]])
        return pb.BackendConfig(cuda=pb.CudaBackendConfig(explicit_target=target))

    def state(self, job: str) -> S:
        return self.driver.states[self.pids[job]]


@pytest.fixture
def node() -> Iterator[Node]:
    children = {job: subprocess.Popen(["sleep", "300"]) for job in JOBS}
    gpus = nvml.FakeNvml([nvml.FakeGpu(GPU0, 80 * GiB)])
    driver = cuda_fake.FakeDriver(nvml=gpus)
    for child in children.values():
        driver.add_process(child.pid)
        gpus.gpus[0].compute[child.pid] = 2 * GiB
    yield Node({job: c.pid for job, c in children.items()}, gpus, driver)
    for child in children.values():
        child.kill()
        child.wait()


async def start(agents: Any, node: Node, **overrides: Any) -> Any:
    return await agents.start(
        default_backend="cuda",
        instances={"cuda": node.backend()},
        host_budget=str(5 * GiB),
        **overrides,
    )


async def park(agent: Any, node: Node, *jobs: str) -> None:
    for job in jobs:
        done = await agent.snapshot(job, backend_config=node.config(job))
        assert done.status == pb.OPERATION_STATUS_COMPLETE, done.error


async def test_a_third_parked_state_is_refused_before_anything_is_frozen(
    agents: Any, node: Node
) -> None:
    agent = await start(agents, node)
    await park(agent, node, "job-a", "job-b")
    node.driver.calls.clear()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await agent.snapshot("job-c", backend_config=node.config("job-c"))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = refused.value.details() or ""
    assert f"needs {2 * GiB} bytes" in message
    assert f"budget for parked states is {5 * GiB} bytes" in message
    assert f"so {GiB} are available" in message
    assert "Nothing was frozen" in message
    # Nobody's state was touched: the driver was not called for anyone.
    assert [c for c in node.driver.calls if c[0] != "get_state"] == []
    assert node.state("job-c") is S.RUNNING
    status = await agent.stub.Status(pb.StatusRequest())
    assert (status.host_budget_bytes, status.host_parked_bytes) == (5 * GiB, 4 * GiB)
    # Once one parked state is restored, the third fits.
    assert (await agent.restore("job-a")).status == pb.OPERATION_STATUS_COMPLETE
    await park(agent, node, "job-c")


async def test_the_accounting_survives_an_agent_restart(agents: Any, node: Node) -> None:
    agent = await start(agents, node)
    await park(agent, node, "job-a", "job-b")
    restarted = await agents.restart(agent, instances={"cuda": node.backend()})
    status = await restarted.stub.Status(pb.StatusRequest())
    assert status.host_parked_bytes == 4 * GiB
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await restarted.snapshot("job-c", backend_config=node.config("job-c"))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_switch_whose_eviction_cannot_be_parked_touches_no_one(
    agents: Any, node: Node
) -> None:
    agent = await start(agents, node)
    await park(agent, node, "job-a", "job-b")
    # job-d holds the group; job-c's switch must park job-d's state.
    await agent.grant("job-d", group="g", epoch=1, backend_config=node.config("job-d"))
    node.driver.calls.clear()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await agent.grant(
            "job-c", group="g", epoch=2, evict=["job-d"], backend_config=node.config("job-c")
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "job 'job-d'" in (refused.value.details() or "")
    assert [c for c in node.driver.calls if c[0] != "get_state"] == []
    assert node.state("job-d") is S.RUNNING
    assert await agent.state("job-d") == pb.JOB_STATE_RUNNING


# --------------------------------------------------------------------------- the rule


def _job(job_id: str, host_bytes: int, *, backend: str = "cuda") -> model.Job:
    return model.Job(
        job_id=job_id,
        group="g",
        state=model.State.SAVED,
        host_bytes=host_bytes,
        backend=backend,
    )


def test_a_state_parked_again_is_not_counted_twice_and_simulated_ones_not_at_all() -> None:
    budget = parking.HostBudget(budget_bytes=5 * GiB)
    jobs = [_job("a", 2 * GiB), _job("b", 2 * GiB), _job("s", 40 * GiB, backend="sim")]
    counted = {"cuda"}
    assert budget.refusal(jobs, key=("a", "g"), needed=3 * GiB, counted=counted) == ""
    assert "needs" in budget.refusal(jobs, key=("c", "g"), needed=2 * GiB, counted=counted)
    assert budget.refusal(jobs, key=("c", "g"), needed=GiB, counted=counted) == ""
    assert budget.refusal(jobs, key=("c", "g"), needed=0, counted=counted) == ""
    assert budget.parked_bytes(jobs, counted=counted) == 4 * GiB


def test_the_default_is_the_available_memory_less_a_reserve(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        f"MemTotal:       {32 * GiB // 1024} kB\nMemAvailable:   {10 * GiB // 1024} kB\n"
    )
    budget = parking.HostBudget(meminfo=meminfo)
    # 10 GiB available, 3.2 GiB kept (10 % of 32 GiB), parked states count back in.
    assert budget.limit(0) == 10 * GiB - 32 * GiB // 10
    assert budget.limit(2 * GiB) == 12 * GiB - 32 * GiB // 10
    jobs = [_job("a", 2 * GiB)]
    why = budget.refusal(jobs, key=("c", "g"), needed=7 * GiB, counted={"cuda"})
    assert "MemAvailable less the reserve" in why
    assert parking.HostBudget(meminfo=meminfo, reserve_bytes=GiB).limit(0) == 9 * GiB
    assert parking.HostBudget(meminfo=tmp_path / "absent").limit(0) is None
