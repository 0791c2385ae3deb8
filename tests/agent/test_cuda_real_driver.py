"""The cuda backend against what the real driver does (issue 20 §0): hung calls, per-process
refusals, processes without a CUDA context, the cuda-bindings floor and restores onto
other GPUs (``device_map``).

Each of these was a bug found by reading the driver API, the cuda-checkpoint sources and
the cuda-bindings release notes against the backend.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.agent.cuda_doubles import (
    GPU0,
    GPU1,
    FakeCudaModule,
    FakeTool,
    GiB,
    Node,
    job,
)
from tslice.agent.backends import (
    base,
    cuda,
    cuda_binary,
    cuda_bindings,
    cuda_calls,
    cuda_driver,
    cuda_select,
    cuda_settings,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import errors

S = cuda_driver.ProcessState
OFFLOAD = pb.SUSPEND_MODE_OFFLOAD


# --------------------------------------------------------------------------- hung calls


def _thread_named(prefix: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name.startswith(prefix))


async def test_a_driver_call_keeps_its_pid_busy_until_its_thread_returns() -> None:
    calls = cuda_calls.DriverCalls()
    go = threading.Event()
    seen: list[str] = []

    def stuck() -> str:
        seen.append(threading.current_thread().name)
        go.wait(60)
        return "done"

    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(calls.run(42, "get_state", stuck), timeout=0.1)
    # The caller gave up; the call did not: the process stays busy.
    assert calls.in_flight() == {42: "get_state"}
    # Its own daemon thread, not the loop's default pool (which NVML shares).
    assert seen == ["tslice-cuda-get_state-42"]
    thread = _thread_named("tslice-cuda-get_state-42")
    assert thread.daemon
    go.set()
    await asyncio.to_thread(thread.join, 10)
    assert calls.in_flight() == {}
    assert await calls.run(42, "get_state", lambda: "again") == "again"


async def test_bindings_calls_run_on_their_own_threads() -> None:
    module = FakeCudaModule()
    names: list[str] = []
    original = module.cuCheckpointProcessGetState

    def get_state(pid: int) -> Any:
        names.append(threading.current_thread().name)
        return original(pid)

    module.cuCheckpointProcessGetState = get_state  # type: ignore[method-assign]
    driver = cuda_bindings.BindingsDriver(module=module, version="13.0.0")
    assert await driver.get_state(7) is S.RUNNING
    assert names == ["tslice-cuda-get_state-7"]
    assert driver.calls_in_flight() == {}


async def test_a_call_past_its_deadline_keeps_the_process_out_of_reach(node: Node) -> None:
    p0 = node.pids[0]
    node.driver.hang("checkpoint", pid=p0, uninterruptible=True)
    backend = node.backend(operation_timeout_s=0.3)
    with pytest.raises(base.FatalBackendError, match="deadline passed during checkpoint"):
        await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    assert node.driver.calls_in_flight() == {p0: "checkpoint"}
    node.driver.calls.clear()
    # ResetJob's recover() must not call into the process while the old call runs...
    assert await backend.recover(job(node.pids[:1])) == pb.JOB_STATE_FAULTED
    # ... nor may a new operation.
    with pytest.raises(base.TransientBackendError, match="has not returned yet"):
        await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    assert node.driver.calls == []
    node.driver.release()
    await asyncio.gather(*node.driver.stuck_calls())
    assert node.driver.calls_in_flight() == {}
    assert await backend.recover(job(node.pids[:1])) == pb.JOB_STATE_SAVED


async def test_a_hung_state_read_fails_the_snapshot_changing_nothing(node: Node) -> None:
    node.driver.hang("get_state", pid=node.pids[1], uninterruptible=True)
    backend = node.backend(state_timeout_s=0.2)
    with pytest.raises(base.TransientBackendError, match=r"did not return within 0\.2 s"):
        await backend.snapshot(job(node.pids), OFFLOAD)
    assert node.ops() == []
    assert node.states() == [S.RUNNING] * 3
    node.driver.release()


# --------------------------------------------------------------------------- refusals


async def test_not_supported_for_one_process_is_refused_and_rolled_back(node: Node) -> None:
    refusal = cuda_driver.ProcessNotSupportedError(
        f"the driver refuses to checkpoint pid {node.pids[1]} (CUDA_ERROR_NOT_SUPPORTED): "
        f"{cuda_driver.NOT_SUPPORTED_WHY}",
        pid=node.pids[1],
        op="checkpoint",
        code="CUDA_ERROR_NOT_SUPPORTED",
    )
    node.driver.fail("checkpoint", pid=node.pids[1], error=refusal)
    with pytest.raises(base.RefusedBackendError) as caught:
        await node.backend().snapshot(job(node.pids), OFFLOAD)
    assert not isinstance(caught.value, base.FatalBackendError)
    message = str(caught.value)
    assert "refuses to checkpoint" in message
    assert "need >= 570" not in message
    assert "nothing changed" in message
    assert node.states() == [S.RUNNING] * 3


async def test_binary_not_supported_is_the_process_s_refusal(tool: FakeTool) -> None:
    tool.set(states={42: "locked"}, faults={"checkpoint": "CUDA_ERROR_NOT_SUPPORTED"})
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    with pytest.raises(cuda_driver.ProcessNotSupportedError, match="CUDA IPC memory"):
        await driver.checkpoint(42)


# --------------------------------------------------------------------------- no context


async def test_a_process_without_a_cuda_context_is_skipped_with_a_warning(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = node.pids[1]
    node.driver.remove_process(launcher)  # a live process that never initialised CUDA
    for pid in node.pids:
        node.registry.register(job_id="rl-a", pid=pid)
    backend = node.backend()
    with caplog.at_level(logging.WARNING):
        saved = await backend.snapshot(job(), OFFLOAD)
    assert saved.state["pids"] == [node.pids[0], node.pids[2]]
    assert [node.driver.states[p] for p in saved.state["pids"]] == [S.CHECKPOINTED] * 2
    assert any("no CUDA context" in r.getMessage() for r in caplog.records)
    assert ("lock", launcher) not in node.driver.calls
    await backend.restore(job(state=saved.state))
    assert [node.driver.states[p] for p in saved.state["pids"]] == [S.RUNNING] * 2


async def test_a_job_whose_processes_hold_no_context_moves_nothing(node: Node) -> None:
    for pid in node.pids:
        node.driver.remove_process(pid)
    backend = node.backend()
    saved = await backend.snapshot(job(node.pids), OFFLOAD)
    assert (saved.device_bytes, saved.host_bytes, saved.state["pids"]) == (0, 0, [])
    restored = await backend.restore(job(state=saved.state))
    assert restored.device_bytes == 0
    assert node.ops() == []


async def test_binary_get_state_of_a_process_without_cuda(tool: FakeTool) -> None:
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    with pytest.raises(cuda_driver.NoCudaContextError):
        await driver.get_state(7)


# --------------------------------------------------------------------------- bindings


@pytest.mark.parametrize(
    ("version", "usable"),
    [("12.8.0", False), ("12.9.0", False), ("12.9.1", True), ("13.0.0", True), (None, True)],
)
def test_cuda_bindings_that_hold_the_gil_are_refused(version: str | None, usable: bool) -> None:
    if usable:
        cuda_bindings.BindingsDriver(module=FakeCudaModule(), version=version)
    else:
        with pytest.raises(base.BackendUnavailableError, match="holds the GIL"):
            cuda_bindings.BindingsDriver(module=FakeCudaModule(), version=version)


def test_the_extra_requires_bindings_that_release_the_gil() -> None:
    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"cuda-bindings>=12.9.1"' in text


def test_auto_falls_back_to_the_tool_past_old_bindings(
    tool: FakeTool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = FakeCudaModule()
    package = type(sys)("cuda.bindings")
    package.__version__ = "12.8.0"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "cuda.bindings", package)
    monkeypatch.setenv("PATH", str(tmp_path))
    chosen = cuda_select.select_driver()
    assert isinstance(chosen, cuda_binary.BinaryDriver)


# --------------------------------------------------------------------------- device_map


class NoGpuPairs(FakeCudaModule):
    """cuda-bindings 13.3.0's shape: the checkpoint API without the restore-onto-GPUs types."""

    def __getattribute__(self, name: str) -> Any:
        if name == "CUcheckpointGpuPair":
            raise AttributeError(name)
        return super().__getattribute__(name)


async def test_a_device_map_without_the_binding_types_is_a_clear_error() -> None:
    module = NoGpuPairs(version=13000)
    assert not hasattr(module, "CUcheckpointGpuPair")
    driver = cuda_bindings.BindingsDriver(module=module, version="13.3.0")
    with pytest.raises(base.BackendUnavailableError, match="lacks CUcheckpointGpuPair"):
        await driver.check_device_map()
    # At a restore too: never an AttributeError escaping every handler.
    with pytest.raises(base.BackendUnavailableError, match="lacks CUcheckpointGpuPair"):
        await driver.restore(5, gpu_pairs={GPU0: GPU1, GPU1: GPU0})
    await driver.restore(5)  # no map: fine


async def test_a_device_map_needs_driver_580() -> None:
    driver = cuda_bindings.BindingsDriver(module=FakeCudaModule(version=12080), version="13.0.2")
    with pytest.raises(base.BackendUnavailableError, match="needs driver >= 580"):
        await driver.check_device_map()
    fine = cuda_bindings.BindingsDriver(module=FakeCudaModule(version=13000), version="13.0.2")
    await fine.check_device_map()


async def test_the_tool_must_know_device_map(tool: FakeTool) -> None:
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    with pytest.raises(base.BackendUnavailableError, match="no --device-map"):
        await driver.check_device_map()
    tool.set(help="--action lock|checkpoint|restore|unlock --pid <pid> --device-map <map>")
    await driver.check_device_map()


async def test_a_map_the_driver_cannot_take_stops_the_backend_at_start(node: Node) -> None:
    node.driver.device_map_problem = "the installed cuda-bindings lacks CUcheckpointGpuPair"
    backend = node.backend(device_map={GPU0: GPU1, GPU1: GPU0})
    with pytest.raises(base.BackendUnavailableError, match="lacks CUcheckpointGpuPair"):
        await backend.check_health()
    with pytest.raises(base.BackendUnavailableError):
        await backend.snapshot(job(node.pids), OFFLOAD)
    assert node.driver.calls == []


async def test_the_map_must_be_a_permutation_of_the_node_s_gpus(node: Node) -> None:
    other = "GPU-00000000-0000-0000-0000-0000000000ff"
    backend = node.backend(device_map={GPU0: other, other: GPU0})
    with pytest.raises(base.BackendUnavailableError, match="permutation of the GPUs NVML"):
        await backend.check_health()
    with pytest.raises(errors.ConfigError, match="permutation"):
        cuda.CudaBackend.create({"device_map": {GPU0: GPU1}})


async def test_a_map_the_driver_refuses_lands_the_job_where_it_was_once(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    backend = node.backend(device_map={GPU0: GPU1, GPU1: GPU0})
    saved = await backend.snapshot(job(node.pids[:1]), OFFLOAD)
    node.driver.fail("restore", pid=node.pids[0], message="invalid device map")
    with caplog.at_level(logging.ERROR):
        restored = await backend.restore(job(state=saved.state))
    # Never left checkpointed, never retried for ever: back on the GPU it came from.
    assert node.states()[0] is S.RUNNING
    assert node.driver.last_gpu_pairs[node.pids[0]] == {}
    assert [g.memory_used_bytes for g in await backend.accelerators()] == [6 * GiB, 0]
    assert "invalid device map" in restored.state["device_map_refused"]
    assert any("refused device_map" in r.getMessage() for r in caplog.records)
    # The map is not tried again.
    again = await backend.snapshot(job(node.pids[:1], state=restored.state), OFFLOAD)
    node.driver.calls.clear()
    await backend.restore(job(state=again.state))
    assert [c for c in node.driver.calls if c[0] == "restore"] == [("restore", node.pids[0])]
    assert node.driver.last_gpu_pairs[node.pids[0]] == {}


async def test_settings_reject_a_map_that_is_no_permutation() -> None:
    with pytest.raises(errors.ConfigError, match="permutation"):
        cuda_settings.parse_settings({"device_map": {GPU0: GPU1, GPU1: GPU1}})


# --------------------------------------------------------------------------- NVML on MIG


async def test_on_a_mig_gpu_processes_are_found_and_the_unknown_bytes_said(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # Per-process memory reads N/A on a MIG-enabled GPU: the processes must still be
    # matched to the group's devices (they were all dropped), and the log says why the
    # bytes read 0.
    gpu0 = node.nvml.gpus[0]
    for pid in node.pids:
        gpu0.compute[pid] = None
        node.registry.register(job_id="rl-a", pid=pid)
    backend = node.backend()
    ctx = base.JobContext(job_id="rl-a", group="pool", devices=(0,))
    with caplog.at_level(logging.WARNING):
        saved = await backend.snapshot(ctx, OFFLOAD)
    assert saved.state["pids"] == node.pids
    assert node.states() == [S.CHECKPOINTED] * 3
    assert any("MIG-enabled" in r.getMessage() for r in caplog.records)
