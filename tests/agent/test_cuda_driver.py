"""Checkpoint drivers: the cuda-checkpoint binary (a real subprocess standing in for the
tool), the bindings driver's error mapping (over a stand-in for ``cuda.bindings.driver``,
since no GPU is here), driver selection, and the FakeDriver's state machine."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent.cuda_doubles import CuProcessState, CuResult, FakeCudaModule, FakeTool
from tslice.agent.backends import (
    base,
    cuda,
    cuda_binary,
    cuda_bindings,
    cuda_driver,
    cuda_fake,
    cuda_select,
    cuda_settings,
)
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

S = cuda_driver.ProcessState
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-12345678-9abc-def0-1234-56789abcdef0"

# --------------------------------------------------------------------------- the binary


async def test_binary_driver_walks_the_state_machine_one_pid_per_call(tool: FakeTool) -> None:
    tool.set(states={42: "running"})
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    assert await driver.get_state(42) is S.RUNNING
    await driver.lock(42, timeout_ms=1500)
    assert await driver.get_state(42) is S.LOCKED
    await driver.checkpoint(42)
    assert await driver.get_state(42) is S.CHECKPOINTED
    await driver.restore(42, gpu_pairs={GPU0.lower(): GPU1})
    await driver.unlock(42)
    assert tool.states() == {42: "running"}
    calls = [c for c in tool.read()["calls"] if c[0] != "--get-state"]
    assert calls == [
        ["--action", "lock", "--pid", "42", "--timeout", "1500"],
        ["--action", "checkpoint", "--pid", "42"],
        ["--action", "restore", "--pid", "42", "--device-map", f"{GPU0}={GPU1}"],
        ["--action", "unlock", "--pid", "42"],
    ]


async def test_binary_driver_errors_carry_the_tool_output(tool: FakeTool) -> None:
    tool.set(states={42: "locked"}, faults={"checkpoint": "CUDA error: UVM is not supported"})
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    with pytest.raises(cuda_driver.DriverError) as caught:
        await driver.checkpoint(42)
    assert not isinstance(caught.value, cuda_driver.LockTimeoutError)
    assert "exited with 2: CUDA error: UVM is not supported" in str(caught.value)
    assert (caught.value.pid, caught.value.op) == (42, "checkpoint")
    with pytest.raises(cuda_driver.DriverError, match="Could not find CUDA process 7"):
        await driver.get_state(7)


@pytest.mark.parametrize(("fault", "said"), [("timeout", "timed out"), ("not-ready", "NOT_READY")])
async def test_binary_driver_recognises_a_lock_timeout(
    tool: FakeTool, fault: str, said: str
) -> None:
    tool.set(states={42: "running"}, faults={"lock": fault})
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    # A long timeout: the tool's words say it, not the time the call took.
    with pytest.raises(cuda_driver.LockTimeoutError, match=said):
        await driver.lock(42, timeout_ms=600_000)
    assert tool.states() == {42: "running"}


def _children_of_this_process() -> list[int]:
    me = str(os.getpid())
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[1] == me:
                found.append(int(entry.name))
    return found


async def test_a_deadline_kills_the_tool(tool: FakeTool) -> None:
    tool.set(states={42: "locked"}, faults={"checkpoint": "hang"})
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    before = set(_children_of_this_process())
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(driver.checkpoint(42), timeout=1.0)
    # The tool was killed and reaped, not left running on its own.
    assert set(_children_of_this_process()) <= before


async def test_check_tool_refuses_a_pre_570_tool(tool: FakeTool) -> None:
    driver = cuda_binary.BinaryDriver(path=str(tool.path))
    await driver.check_tool()
    tool.set(help="--toggle --pid <pid>")
    with pytest.raises(base.BackendUnavailableError, match="older than r570"):
        await driver.check_tool()


def test_binary_driver_needs_the_tool(tmp_path: Path) -> None:
    with pytest.raises(base.BackendUnavailableError, match=r"tslice\[gpu\]"):
        cuda_binary.BinaryDriver(path=str(tmp_path / "nope"))


@pytest.fixture
def sleepers(sleeping: Callable[[int], list[int]]) -> list[int]:
    return sleeping(2)


async def test_backend_over_the_binary_end_to_end(tool: FakeTool, sleepers: list[int]) -> None:
    tool.set(states=dict.fromkeys(sleepers, "running"))
    backend = cuda.CudaBackend(
        settings=cuda_settings.parse_settings(
            {"driver": "binary", "binary": str(tool.path), "measure_bytes": False}
        ),
        registry=registration.ProcessRegistry(),
    )
    config = pb.BackendConfig(
        cuda=pb.CudaBackendConfig(explicit_target=pb.ProcessTarget(pids=sleepers))
    )
    saved = await backend.snapshot(base.JobContext("rl-a", "g", config), pb.SUSPEND_MODE_OFFLOAD)
    assert tool.states() == dict.fromkeys(sleepers, "checkpointed")
    assert saved.state["driver"] == "binary"
    ctx = base.JobContext("rl-a", "g", None, state=saved.state)
    assert await backend.recover(ctx) == pb.JOB_STATE_SAVED
    await backend.restore(ctx)
    assert tool.states() == dict.fromkeys(sleepers, "running")
    # Restoring again is a no-op: only --get-state calls, never a toggle/checkpoint.
    count = len(tool.read()["calls"])
    await backend.restore(ctx)
    assert all(c[0] == "--get-state" for c in tool.read()["calls"][count:])
    await backend.check_health()


# --------------------------------------------------------------------------- selection


def test_select_driver(tool: FakeTool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    monkeypatch.setattr(cuda_binary, "FALLBACK_BINARY", str(tmp_path / "absent"))
    monkeypatch.setenv("PATH", str(tmp_path))  # the fake tool is on PATH
    chosen = cuda_select.select_driver()
    assert isinstance(chosen, cuda_binary.BinaryDriver)
    assert chosen.path == str(tool.path)
    assert isinstance(cuda_select.select_driver(preference="fake"), cuda_fake.FakeDriver)
    with pytest.raises(base.BackendUnavailableError, match="cuda-bindings is not installed"):
        cuda_select.select_driver(preference="bindings")
    with pytest.raises(base.BackendUnavailableError, match="unknown cuda driver"):
        cuda_select.select_driver(preference="magic")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(base.BackendUnavailableError, match="put NVIDIA's cuda-checkpoint on PATH"):
        cuda_select.select_driver()


@pytest.mark.parametrize(
    ("given", "normal"),
    [
        (GPU1, GPU1),
        (GPU1.upper(), GPU1),
        (GPU1[4:], GPU1),
        ("123456789abcdef0123456789abcdef0", GPU1),
    ],
)
def test_normalize_gpu_uuid(given: str, normal: str) -> None:
    assert cuda_driver.normalize_gpu_uuid(given) == normal


def test_normalize_gpu_uuid_refuses_indexes() -> None:
    with pytest.raises(ValueError, match="nvidia-smi -L"):
        cuda_driver.normalize_gpu_uuid("0")


# --------------------------------------------------------------------------- the bindings


async def test_bindings_driver_calls_and_state_mapping() -> None:
    module = FakeCudaModule(version=13000)
    driver = cuda_bindings.BindingsDriver(module=module)
    for raw, state in zip(CuProcessState, S, strict=True):
        module.state = raw
        assert await driver.get_state(5) is state
    await driver.lock(5, timeout_ms=2500)
    assert module.seen["lock_timeout"] == 2500
    await driver.checkpoint(5)
    await driver.restore(5)
    assert "pairs" not in module.seen
    await driver.restore(5, gpu_pairs={GPU0: GPU1})
    assert module.seen["pairs"] == [(bytes(16), bytes.fromhex(GPU1[4:].replace("-", "")))]
    assert module.seen["count"] == 1
    await driver.unlock(5)
    assert await driver.device_count() == 8


@pytest.mark.parametrize("code", [CuResult.CUDA_ERROR_NOT_READY, CuResult.CUDA_ERROR_TIMEOUT])
async def test_bindings_driver_takes_not_ready_as_the_lock_timeout(code: CuResult) -> None:
    # cuCheckpointProcessLock documents CUDA_ERROR_NOT_READY for a timeoutMs that ran out.
    module = FakeCudaModule()
    driver = cuda_bindings.BindingsDriver(module=module)
    module.errors["lock"] = code
    with pytest.raises(cuda_driver.LockTimeoutError, match=code.name):
        await driver.lock(5, timeout_ms=10)
    # The same code from another call is no timeout.
    module.errors["checkpoint"] = code
    with pytest.raises(cuda_driver.DriverError) as caught:
        await driver.checkpoint(5)
    assert not isinstance(caught.value, cuda_driver.LockTimeoutError)


async def test_bindings_driver_maps_errors() -> None:
    module = FakeCudaModule()
    driver = cuda_bindings.BindingsDriver(module=module)
    module.errors["checkpoint"] = CuResult.CUDA_ERROR_ILLEGAL_STATE
    with pytest.raises(cuda_driver.DriverError) as caught:
        await driver.checkpoint(5)
    assert caught.value.code == "CUDA_ERROR_ILLEGAL_STATE"
    assert "description of CUDA_ERROR_ILLEGAL_STATE" in str(caught.value)
    # NOT_SUPPORTED from a call for one process is that process's refusal (UVM, IPC,
    # vGPU), not an old driver (checked at start).
    module.errors["restore"] = CuResult.CUDA_ERROR_NOT_SUPPORTED
    with pytest.raises(cuda_driver.ProcessNotSupportedError) as refused:
        await driver.restore(5)
    assert "need >= 570" not in str(refused.value)
    assert "refuses to restore pid 5" in str(refused.value)
    assert "CUDA IPC memory" in str(refused.value)
    module.errors["get_state"] = CuResult.CUDA_ERROR_NOT_FOUND
    with pytest.raises(base.BackendUnavailableError, match="need >= 570"):
        await driver.get_state(5)


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (FakeCudaModule(init=CuResult.CUDA_ERROR_NO_DEVICE), "no NVIDIA GPU is visible"),
        (FakeCudaModule(version=12040), "needs driver >= 570"),
    ],
    ids=["no-device", "old-driver"],
)
def test_bindings_driver_unavailable_at_init(module: FakeCudaModule, message: str) -> None:
    with pytest.raises(base.BackendUnavailableError, match=message):
        cuda_bindings.BindingsDriver(module=module)


def test_bindings_driver_without_libcuda_or_checkpoint_api() -> None:
    class NoLibcuda(FakeCudaModule):
        def cuInit(self, flags: int) -> tuple[CuResult]:
            raise RuntimeError("Failed to dlopen libcuda.so.1")

    with pytest.raises(base.BackendUnavailableError, match="could not be loaded"):
        cuda_bindings.BindingsDriver(module=NoLibcuda())

    class Old:
        pass

    with pytest.raises(base.BackendUnavailableError, match="lacks the checkpoint API"):
        cuda_bindings.BindingsDriver(module=Old())


# --------------------------------------------------------------------------- the fake


async def test_fake_driver_times_out_a_lock_as_the_driver_does() -> None:
    driver = cuda_fake.FakeDriver()
    driver.add_process(1)
    driver.lock_times_out(pid=1)
    with pytest.raises(cuda_driver.LockTimeoutError) as caught:
        await driver.lock(1, timeout_ms=1)
    assert caught.value.code == "CUDA_ERROR_NOT_READY"
    assert await driver.get_state(1) is S.RUNNING


async def test_fake_driver_enforces_the_driver_state_machine() -> None:
    driver = cuda_fake.FakeDriver()
    with pytest.raises(cuda_driver.DriverError, match="no CUDA process"):
        await driver.get_state(1)
    driver.add_process(1)
    with pytest.raises(cuda_driver.DriverError, match="ILLEGAL_STATE"):
        await driver.checkpoint(1)
    with pytest.raises(cuda_driver.DriverError, match="ILLEGAL_STATE"):
        await driver.restore(1)
    await driver.lock(1, timeout_ms=1)
    with pytest.raises(cuda_driver.DriverError, match="ILLEGAL_STATE"):
        await driver.lock(1, timeout_ms=1)
    driver.fail("checkpoint", leave_state=S.FAILED)
    with pytest.raises(cuda_driver.DriverError):
        await driver.checkpoint(1)
    assert await driver.get_state(1) is S.FAILED
    driver.remove_process(1)
    assert 1 not in driver.states
