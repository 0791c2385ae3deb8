"""What moved is proved (issue 20 §3): after a snapshot NVML must show the processes'
memory released, or the job is FAULTED with the bytes named; processes that NVML lists
with no device memory are left alone; every operation reports bytes and GB/s."""

from __future__ import annotations

import logging

import pytest

from tests.agent.cuda_doubles import GiB, Node, job
from tslice.agent.backends import base, cuda_driver
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

S = cuda_driver.ProcessState
OFFLOAD = pb.SUSPEND_MODE_OFFLOAD


async def test_a_snapshot_is_checked_to_have_freed_the_memory(node: Node) -> None:
    saved = await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert saved.state["released"] == "verified"
    assert saved.device_bytes == 6 * GiB


async def test_memory_still_on_the_device_after_a_snapshot_is_fatal(node: Node) -> None:
    node.driver.keeps_memory.add(node.pids[1])
    with pytest.raises(base.FatalBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    message = str(caught.value)
    assert f"pid {node.pids[1]} {2 * GiB} bytes" in message
    assert "not SAVED" in message


async def test_within_the_tolerance_it_counts_as_released(node: Node) -> None:
    node.driver.keeps_memory.add(node.pids[0])  # 1 GiB left
    saved = await node.backend(released_tolerance_bytes=GiB).snapshot(job(node.pids), OFFLOAD)
    assert saved.state["released"] == "verified"


async def test_without_nvml_the_release_is_said_unverified(node: Node) -> None:
    saved = await node.backend(measure_bytes=False).snapshot(job(node.pids), OFFLOAD)
    assert saved.state["released"] == "not verified: measure_bytes is off"


async def test_processes_nvml_lists_with_no_memory_are_left_alone(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    daemon, unlisted = node.pids[1], node.pids[2]
    node.nvml.gpus[0].compute[daemon] = 0  # a context, no memory: a Ray daemon
    del node.nvml.gpus[0].compute[unlisted]  # NVML does not list it: not known idle
    for pid in node.pids:
        node.registry.register(job_id="rl-a", pid=pid)
    with caplog.at_level(logging.WARNING):
        saved = await node.backend().snapshot(job(), OFFLOAD)
    assert ("lock", daemon) not in node.driver.calls
    assert saved.state["pids"] == [node.pids[0], unlisted]
    assert "holds no device memory" in saved.state["skipped"][str(daemon)]
    assert any("holds no device memory" in r.getMessage() for r in caplog.records)
    assert node.states() == [S.CHECKPOINTED, S.RUNNING, S.CHECKPOINTED]
