"""The cuda backend over the shipped FakeDriver/FakeNvml, with real (sleeping) processes.

Every state path of the driver is driven: lock timeout, checkpoint failure →
unlock, restore of a running process is a no-op, agent restart with a
checkpointed process, deadlines, and the missing-GPU error.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.agent.cuda_doubles import GPU0, GPU1, GiB, Node, exited_pid, job
from tslice.agent import channel, nvml
from tslice.agent.backends import (
    base,
    cuda,
    cuda_binary,
    cuda_driver,
    cuda_fake,
    cuda_settings,
    services,
)
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import errors

S = cuda_driver.ProcessState
OFFLOAD = pb.SUSPEND_MODE_OFFLOAD


# --------------------------------------------------------------------------- happy paths


async def test_snapshot_then_restore_moves_every_process_in_order(node: Node) -> None:
    backend = node.backend()
    saved = await backend.snapshot(job(node.pids), OFFLOAD)
    assert node.states() == [S.CHECKPOINTED] * 3
    # Every process is locked before any is checkpointed (ranks never run beside a
    # checkpointed peer).
    assert node.ops() == [("lock", p) for p in node.pids] + [("checkpoint", p) for p in node.pids]
    assert saved.device_bytes == saved.host_bytes == 6 * GiB
    assert saved.state["pids"] == node.pids
    assert (await backend.accelerators())[0] == base.Accelerator(GPU0, 0, 80 * GiB)

    node.driver.calls.clear()
    restored = await backend.restore(job(state=saved.state))
    assert node.states() == [S.RUNNING] * 3
    # Every process is back before any is unlocked.
    assert node.ops() == [("restore", p) for p in node.pids] + [("unlock", p) for p in node.pids]
    assert restored.device_bytes == 6 * GiB
    assert restored.host_bytes == 0
    assert (await backend.accelerators())[0].memory_used_bytes == 6 * GiB


async def test_restore_of_a_running_process_is_a_noop_never_a_checkpoint(node: Node) -> None:
    backend = node.backend()
    result = await backend.restore(job(node.pids))
    assert node.states() == [S.RUNNING] * 3
    assert node.ops() == []  # only get_state was called
    assert result.device_bytes == 0


async def test_restore_of_a_locked_process_unlocks_it(node: Node) -> None:
    node.driver.states[node.pids[1]] = S.LOCKED
    await node.backend().restore(job(node.pids))
    assert node.states() == [S.RUNNING] * 3
    assert node.ops() == [("unlock", node.pids[1])]


async def test_snapshot_is_idempotent_and_keeps_the_host_bytes(node: Node) -> None:
    backend = node.backend()
    first = await backend.snapshot(job(node.pids), OFFLOAD)
    node.driver.calls.clear()
    again = await backend.snapshot(job(node.pids, state=first.state), OFFLOAD)
    assert node.ops() == []
    assert again.device_bytes == 0  # nothing left the device this time
    assert again.host_bytes == 6 * GiB  # but the host still holds it all


async def test_locked_process_is_checkpointed_without_a_second_lock(node: Node) -> None:
    node.driver.states[node.pids[0]] = S.LOCKED
    await node.backend().snapshot(job(node.pids[:1]), OFFLOAD)
    assert node.ops() == [("checkpoint", node.pids[0])]


async def test_discard_mode_still_keeps_the_state(node: Node) -> None:
    result = await node.backend().snapshot(job(node.pids[:1]), pb.SUSPEND_MODE_DISCARD)
    assert result.host_bytes == 1 * GiB


async def test_device_map_restores_onto_another_gpu(node: Node) -> None:
    backend = node.backend(device_map={GPU0: GPU1, GPU1: GPU0})
    saved = await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    await backend.restore(job(state=saved.state))
    assert node.driver.last_gpu_pairs[node.pids[0]] == {GPU0: GPU1, GPU1: GPU0}
    gpus = await backend.accelerators()
    assert [g.memory_used_bytes for g in gpus] == [2 * GiB + 3 * GiB, 1 * GiB]


# --------------------------------------------------------------------------- failures


async def test_lock_timeout_rolls_back_and_is_transient(node: Node) -> None:
    node.driver.lock_times_out(pid=node.pids[1])
    with pytest.raises(base.TransientBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    # The others had been locked; they are unlocked, nothing was checkpointed.
    assert node.states() == [S.RUNNING] * 3
    assert not [op for op, _ in node.ops() if op == "checkpoint"]
    assert sorted(p for op, p in node.ops() if op == "unlock") == sorted(
        [node.pids[0], node.pids[2]]
    )
    message = str(caught.value)
    assert f"failed at pid {node.pids[1]} (2 of 3)" in message
    assert "CUDA_ERROR_NOT_READY" in message
    assert "nothing changed" in message
    assert f"pid {node.pids[0]} unlocked" in message
    assert caught.value.retry_after > 0


async def test_a_lock_timeout_is_confirmed_by_reading_the_state(node: Node) -> None:
    # The driver said "not ready" but the lock took: the snapshot goes on.
    node.driver.lock_times_out(pid=node.pids[0], leave_state=S.LOCKED)
    await node.backend().snapshot(job(node.pids[:1]), OFFLOAD)
    assert node.states()[0] is S.CHECKPOINTED
    # The driver said "not ready" and left the process FAILED: no "try later".
    node.driver.lock_times_out(pid=node.pids[1], leave_state=S.FAILED)
    with pytest.raises(base.FatalBackendError, match="now failed, not running"):
        await node.backend().snapshot(job(node.pids[1:2]), OFFLOAD)


async def test_checkpoint_failure_after_lock_unlocks_and_reports(node: Node) -> None:
    node.driver.fail("checkpoint", pid=node.pids[0], message="out of host memory")
    with pytest.raises(base.FatalBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert node.states() == [S.RUNNING] * 3
    p0, p1, p2 = node.pids
    # All locked, all checkpointed at once; then the failed one unlocked and the
    # others restored and unlocked.
    assert node.ops()[:6] == [("lock", p) for p in node.pids] + [
        ("checkpoint", p) for p in node.pids
    ]
    assert sorted(node.ops()[6:]) == sorted(
        [("unlock", p0), ("restore", p1), ("unlock", p1), ("restore", p2), ("unlock", p2)]
    )
    message = str(caught.value)
    assert "out of host memory" in message
    assert f"pid {p0} unlocked" in message
    assert f"pid {p1} restored" in message
    assert "the job is RUNNING again" in message


async def test_failed_rollback_says_what_each_process_is_now(node: Node) -> None:
    node.driver.fail("checkpoint", pid=node.pids[1])
    node.driver.fail("restore", pid=node.pids[0], message="restore broke")
    with pytest.raises(base.FatalBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert node.states() == [S.CHECKPOINTED, S.RUNNING, S.RUNNING]
    message = str(caught.value)
    assert f"pid {node.pids[0]} NOT rolled back" in message
    p0, p1, p2 = node.pids
    assert f"now: pid {p0} checkpointed, pid {p1} running, pid {p2} running" in message


async def test_driver_unavailable_mid_snapshot_is_rolled_back(node: Node) -> None:
    gone = base.BackendUnavailableError("the driver went away")
    node.driver.fail("get_state", pid=node.pids[0], error=gone)
    with pytest.raises(base.BackendUnavailableError, match="went away"):
        await node.backend().snapshot(job(node.pids), OFFLOAD)  # nothing touched yet
    assert node.ops() == []
    node.driver.fail("checkpoint", pid=node.pids[1], error=gone)
    with pytest.raises(base.FatalBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert "went away" in str(caught.value)
    assert f"pid {node.pids[1]} unlocked" in str(caught.value)
    assert f"pid {node.pids[0]} restored" in str(caught.value)
    assert node.states() == [S.RUNNING] * 3


async def test_process_in_failed_state_is_fatal(node: Node) -> None:
    node.driver.states[node.pids[0]] = S.FAILED
    with pytest.raises(base.FatalBackendError, match="FAILED checkpoint state"):
        await node.backend().snapshot(job(node.pids[:1]), OFFLOAD)


async def test_operation_deadline_during_a_hung_checkpoint(node: Node) -> None:
    node.driver.hang("checkpoint", pid=node.pids[0])
    backend = node.backend(operation_timeout_s=0.2)
    with pytest.raises(base.FatalBackendError) as caught:
        await backend.snapshot(job(node.pids), OFFLOAD)
    assert node.driver.hung.is_set()
    message = str(caught.value)
    assert "deadline passed during checkpoint of pid" in message
    assert "nothing was rolled back" in message
    p0, p1, p2 = node.pids
    assert f"pid {p0} unknown, pid {p1} checkpointed, pid {p2} checkpointed" in message
    node.driver.release()


async def test_restore_failure_before_any_change_is_transient(node: Node) -> None:
    backend = node.backend()
    saved = await backend.snapshot(job(node.pids), OFFLOAD)
    node.driver.fail("restore", pid=node.pids[0], message="out of device memory")
    node.driver.calls.clear()
    with pytest.raises(base.TransientBackendError, match="still checkpointed"):
        await backend.restore(job(state=saved.state))
    # The others came back (still locked, never ran) and were checkpointed again.
    assert node.states() == [S.CHECKPOINTED] * 3
    assert ("unlock", node.pids[1]) not in node.driver.calls
    assert ("checkpoint", node.pids[1]) in node.driver.calls
    # The retry the agent makes then succeeds.
    await backend.restore(job(state=saved.state))
    assert node.states() == [S.RUNNING] * 3


async def test_restore_failure_after_a_change_is_fatal(node: Node) -> None:
    backend = node.backend()
    saved = await backend.snapshot(job(node.pids), OFFLOAD)
    node.driver.fail("unlock", pid=node.pids[1])
    with pytest.raises(base.FatalBackendError) as caught:
        await backend.restore(job(state=saved.state))
    p0, p1, p2 = node.pids
    assert f"now: pid {p0} running, pid {p1} locked, pid {p2} running" in str(caught.value)
    assert node.states() == [S.RUNNING, S.LOCKED, S.RUNNING]


async def test_restore_of_an_exited_process_changes_nothing(node: Node, pids: list[int]) -> None:
    backend = node.backend()
    saved = await backend.snapshot(job(node.pids), OFFLOAD)
    victim = exited_pid()
    state = {**saved.state, "pids": [*saved.state["pids"], victim]}
    node.driver.calls.clear()
    with pytest.raises(base.FatalBackendError, match=rf"\[{victim}\] have exited"):
        await backend.restore(job(state=state))
    assert node.driver.calls == []


async def test_concurrent_operations_never_share_a_process(node: Node) -> None:
    node.driver.hang("checkpoint", pid=node.pids[0])
    backend = node.backend()
    first = asyncio.create_task(backend.snapshot(job(node.pids[:1]), OFFLOAD))
    await node.driver.hung.wait()
    with pytest.raises(base.TransientBackendError, match="by an operation of job"):
        await backend.snapshot(job(node.pids[:1], job_id="rl-b"), OFFLOAD)
    node.driver.release()
    await first
    assert node.states()[0] is S.CHECKPOINTED


# --------------------------------------------------------------------------- targets


async def test_explicit_pid_that_does_not_exist_is_refused(node: Node) -> None:
    gone = exited_pid()
    with pytest.raises(base.FatalBackendError, match=f"pid {gone} does not exist"):
        await node.backend().snapshot(job([node.pids[0], gone]), OFFLOAD)
    assert node.driver.calls == []


async def test_explicit_pid_of_another_job_is_refused(node: Node) -> None:
    node.registry.register(job_id="rl-b", pid=node.pids[0])
    with pytest.raises(base.FatalBackendError, match="part of job 'rl-b'"):
        await node.backend().snapshot(job(node.pids[:1]), OFFLOAD)
    assert node.driver.calls == []


async def test_validate_refuses_bad_explicit_pids_before_any_operation(node: Node) -> None:
    backend = node.backend()
    await backend.validate(job(node.pids))
    await backend.validate(job())  # no explicit PIDs: nothing to check
    with pytest.raises(base.InvalidBackendConfigError, match="must be positive"):
        await backend.validate(job([node.pids[0], 0]))
    gone = exited_pid()
    with pytest.raises(base.InvalidBackendConfigError, match=f"pid {gone} does not exist"):
        await backend.validate(job([gone]))
    node.registry.register(job_id="rl-b", pid=node.pids[1])
    with pytest.raises(base.BackendConfigRefusedError, match="part of job 'rl-b'"):
        await backend.validate(job(node.pids))
    assert node.driver.calls == []


async def test_registered_processes_are_used_in_registration_order(node: Node) -> None:
    for pid in (node.pids[2], node.pids[0]):
        node.registry.register(job_id="rl-a", pid=pid)
    result = await node.backend().snapshot(job(), OFFLOAD)
    assert [p for op, p in node.ops() if op == "checkpoint"] == [node.pids[2], node.pids[0]]
    assert result.state["pids"] == [node.pids[2], node.pids[0]]


async def test_no_known_process_says_how_to_name_them(node: Node) -> None:
    with pytest.raises(base.FatalBackendError, match="announce_process"):
        await node.backend().snapshot(job(), OFFLOAD)


async def test_recorded_processes_survive_an_agent_restart_for_the_next_snapshot(
    node: Node,
) -> None:
    first = node.backend()
    saved = await first.snapshot(job(node.pids[:2]), OFFLOAD)
    restored = await first.restore(job(state=saved.state))
    # The agent restarts: empty registry, request without PIDs (the orchestrator's).
    again = node.backend()
    node.registry.forget("rl-a")
    node.registry.register(job_id="rl-a", pid=node.pids[2])  # a process that joined later
    result = await again.snapshot(job(state=restored.state), OFFLOAD)
    assert result.state["pids"] == node.pids
    assert node.states() == [S.CHECKPOINTED] * 3


# --------------------------------------------------------------------------- groups


def _in_group(group: str, devices: tuple[int, ...] = (), **state: Any) -> base.JobContext:
    return base.JobContext(job_id="rl-a", group=group, devices=devices, state=state)


def _spread(node: Node) -> None:
    """pids[0] and pids[2] on GPU 0 (the trainer's), pids[1] on GPU 1 (the sampler's)."""
    gpu0, gpu1 = node.nvml.gpus
    gpu1.compute[node.pids[1]] = gpu0.compute.pop(node.pids[1])
    for pid in node.pids:
        node.registry.register(job_id="rl-a", pid=pid)


def _checkpointed(node: Node) -> list[int]:
    return [pid for op, pid in node.ops() if op == "checkpoint"]


async def test_a_group_drives_only_the_processes_on_its_devices(node: Node) -> None:
    _spread(node)
    backend = node.backend()
    saved = await backend.snapshot(_in_group("sampler", (1,)), OFFLOAD)
    assert _checkpointed(node) == [node.pids[1]]
    assert saved.state["pids"] == [node.pids[1]]
    assert node.states() == [S.RUNNING, S.CHECKPOINTED, S.RUNNING]
    node.driver.calls.clear()
    await backend.snapshot(_in_group("trainer", (0,)), OFFLOAD)
    assert _checkpointed(node) == [node.pids[0], node.pids[2]]


async def test_a_process_that_announced_its_group_belongs_to_that_group(node: Node) -> None:
    _spread(node)
    # pids[0] holds memory on the trainer's GPU but says it is the sampler's.
    node.registry.register(job_id="rl-a", pid=node.pids[0], group="sampler")
    backend = node.backend()
    await backend.snapshot(_in_group("trainer", (0,)), OFFLOAD)
    assert _checkpointed(node) == [node.pids[2]]
    node.driver.calls.clear()
    await backend.snapshot(_in_group("sampler", (1,)), OFFLOAD)
    assert _checkpointed(node) == [node.pids[0], node.pids[1]]


async def test_a_group_without_devices_named_drives_all_but_other_groups_processes(
    node: Node,
) -> None:
    _spread(node)
    node.registry.register(job_id="rl-a", pid=node.pids[2], group="sampler")
    await node.backend().snapshot(_in_group("trainer"), OFFLOAD)
    assert _checkpointed(node) == [node.pids[0], node.pids[1]]


async def test_recover_reads_only_the_group_s_processes(node: Node) -> None:
    _spread(node)
    backend = node.backend()
    saved = await backend.snapshot(_in_group("sampler", (1,)), OFFLOAD)
    assert await backend.recover(_in_group("sampler", (1,), **saved.state)) == pb.JOB_STATE_SAVED
    # A record that never completed an operation: the group's processes are asked.
    assert await backend.recover(_in_group("trainer", (0,))) == pb.JOB_STATE_RUNNING
    assert node.states() == [S.RUNNING, S.CHECKPOINTED, S.RUNNING]


async def test_devices_without_nvml_refuse_processes_that_named_no_group(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    _spread(node)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # no NVML on this node
    backend = cuda.CudaBackend(
        settings=cuda_settings.CudaSettings(measure_bytes=False),
        driver=node.driver,
        registry=node.registry,
    )
    with pytest.raises(base.RefusedBackendError, match=r"tslice\[gpu\].*group="):
        await backend.snapshot(_in_group("trainer", (0,)), OFFLOAD)
    assert node.ops() == []
    assert await backend.recover(_in_group("trainer", (0,))) is None
    # A process that named its group needs no NVML to be found.
    node.registry.register(job_id="rl-a", pid=node.pids[0], group="sampler")
    node.registry.register(job_id="rl-a", pid=node.pids[1], group="sampler")
    node.registry.register(job_id="rl-a", pid=node.pids[2], group="sampler")
    await backend.snapshot(_in_group("sampler", (1,)), OFFLOAD)
    assert node.states() == [S.CHECKPOINTED] * 3


async def test_forget_of_one_group_keeps_the_other_group_s_processes(node: Node) -> None:
    node.registry.register(job_id="rl-a", pid=node.pids[0], group="sampler")
    node.registry.register(job_id="rl-a", pid=node.pids[1], group="trainer")
    await node.backend().forget(_in_group("sampler"))
    assert node.registry.pids("rl-a") == [node.pids[1]]


# --------------------------------------------------------------------------- recover


async def test_agent_restart_with_a_checkpointed_job_can_still_restore(node: Node) -> None:
    saved = await node.backend().snapshot(job(node.pids), OFFLOAD)
    # New backend instance = restarted agent; the driver (the GPU) kept the state.
    restarted = node.backend()
    ctx = job(state=saved.state)
    assert await restarted.recover(ctx) == pb.JOB_STATE_SAVED
    await restarted.restore(ctx)
    assert node.states() == [S.RUNNING] * 3
    assert await restarted.recover(ctx) == pb.JOB_STATE_RUNNING


async def test_recover_unlocks_a_process_left_locked(node: Node) -> None:
    ctx = job(state={"pids": node.pids})
    node.driver.states[node.pids[1]] = S.LOCKED
    assert await node.backend().recover(ctx) == pb.JOB_STATE_RUNNING
    assert node.states() == [S.RUNNING] * 3


async def test_recover_finishes_a_half_checkpointed_job(node: Node) -> None:
    ctx = job(state={"pids": node.pids})
    node.driver.states[node.pids[0]] = S.CHECKPOINTED
    node.driver.states[node.pids[1]] = S.LOCKED
    assert await node.backend().recover(ctx) == pb.JOB_STATE_SAVED
    assert node.states() == [S.CHECKPOINTED] * 3


async def test_recover_without_repair_reports_mixed_states_as_faulted(node: Node) -> None:
    ctx = job(state={"pids": node.pids})
    node.driver.states[node.pids[0]] = S.CHECKPOINTED
    assert await node.backend(repair_on_recover=False).recover(ctx) == pb.JOB_STATE_FAULTED
    assert node.states() == [S.CHECKPOINTED, S.RUNNING, S.RUNNING]
    node.driver.states[node.pids[0]] = S.LOCKED
    assert await node.backend(repair_on_recover=False).recover(ctx) == pb.JOB_STATE_FAULTED


async def test_recover_with_a_failed_process_is_faulted(node: Node) -> None:
    node.driver.states[node.pids[2]] = S.FAILED
    assert await node.backend().recover(job(state={"pids": node.pids})) == pb.JOB_STATE_FAULTED


async def test_recover_when_processes_exited(node: Node) -> None:
    gone = exited_pid()
    backend = node.backend()
    assert await backend.recover(job(state={"pids": [gone]})) == pb.JOB_STATE_IDLE
    assert await backend.recover(job(state={"pids": [node.pids[0], gone]})) == (
        pb.JOB_STATE_FAULTED
    )


async def test_recover_detects_a_reused_pid(node: Node) -> None:
    saved = await node.backend().snapshot(job(node.pids[:1]), OFFLOAD)
    state = dict(saved.state)
    state["start_times"] = {str(node.pids[0]): 1}  # recorded process started long ago
    assert await node.backend().recover(job(state=state)) == pb.JOB_STATE_IDLE


async def test_recover_after_a_failed_first_snapshot_uses_the_requested_pids(
    node: Node,
) -> None:
    # A failed operation records no state; the request's PIDs still name the job.
    node.driver.fail("checkpoint", pid=node.pids[1])
    with pytest.raises(base.FatalBackendError):
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert await node.backend().recover(job(node.pids)) == pb.JOB_STATE_RUNNING
    node.registry.register(job_id="rl-b", pid=node.pids[2])
    node.driver.states[node.pids[2]] = S.CHECKPOINTED
    assert await node.backend().recover(job(job_id="rl-b")) == pb.JOB_STATE_SAVED


async def test_recover_with_nothing_recorded_trusts_the_agent(node: Node) -> None:
    assert await node.backend().recover(job()) is None


# --------------------------------------------------------------------------- availability


async def test_missing_gpu_stack_is_a_clear_error(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No cuda-bindings in this environment, no cuda-checkpoint anywhere.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(cuda_binary, "FALLBACK_BINARY", str(tmp_path / "cuda-checkpoint"))
    monkeypatch.setitem(__import__("sys").modules, "cuda.bindings.driver", None)
    backend = cuda.CudaBackend.create({})
    for call in (
        backend.check_health(),
        backend.snapshot(job([1]), OFFLOAD),
        backend.restore(job([1])),
    ):
        with pytest.raises(base.BackendUnavailableError) as caught:
            await call
        assert "cuda-bindings is not installed" in str(caught.value)
        assert r"install tslice[gpu]" in str(caught.value)
        assert "cuda-checkpoint" in str(caught.value)
    assert await backend.recover(job(state={"pids": [1]})) is None
    await backend.close()


async def test_health_needs_at_least_one_gpu(node: Node) -> None:
    await node.backend().check_health()
    empty = cuda.CudaBackend(
        driver=cuda_fake.FakeDriver(devices=0), nvml=nvml.FakeNvml(), registry=node.registry
    )
    with pytest.raises(base.BackendUnavailableError, match="no NVIDIA GPU is visible"):
        await empty.check_health()


async def test_without_nvml_bytes_read_zero_and_no_accelerators(node: Node) -> None:
    backend = node.backend(measure_bytes=False)
    result = await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    assert (result.device_bytes, result.host_bytes) == (0, 0)
    assert await backend.accelerators() == []


async def test_fake_driver_from_settings_runs_without_a_gpu(node: Node) -> None:
    node_services = services.NodeServices(
        node="node-a",
        state_dir=Path("/nonexistent"),
        hub=channel.ChannelHub(),
        processes=node.registry,
    )
    backend = cuda.CudaBackend.create_on_node(
        {"driver": "fake", "measure_bytes": False}, node_services
    )
    saved = await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    assert await backend.recover(job(state=saved.state)) == pb.JOB_STATE_SAVED
    await backend.forget(job())
    await backend.close()


# --------------------------------------------------------------------------- settings


def test_settings_are_validated_with_the_field_named() -> None:
    with pytest.raises(errors.ConfigError, match="lock_timeout_ms"):
        cuda.CudaBackend.create({"lock_timeout_ms": 0})
    with pytest.raises(errors.ConfigError, match="lock_timout_ms"):
        cuda.CudaBackend.create({"lock_timout_ms": 5})
    with pytest.raises(errors.ConfigError, match="driver"):
        cuda.CudaBackend.create({"driver": "magic"})
    with pytest.raises(errors.ConfigError, match="not a GPU UUID"):
        cuda.CudaBackend.create({"device_map": {"gpu0": GPU1}})


def test_settings_normalise_the_device_map() -> None:
    backend = cuda.CudaBackend.create(
        {
            "device_map": {
                "00000000-0000-0000-0000-000000000000": GPU1.upper().replace("GPU-", ""),
                GPU1: GPU0,
            },
            "lock_timeout_ms": 500,
        }
    )
    assert backend.settings.device_map == {GPU0: GPU1, GPU1: GPU0}
    assert backend.settings.lock_timeout_ms == 500
    assert backend.registry is registration.default_registry()
    assert backend.name == "cuda"
