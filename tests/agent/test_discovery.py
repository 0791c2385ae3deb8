"""Process discovery: NVML process lists, pod matching on fixture /proc trees, PID checks."""

from __future__ import annotations

import os
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest

from tslice.agent import discovery, nvml

PROC = Path(__file__).parent / "fixtures" / "proc"
POD = "6f0e3c2a-1b2c-4d5e-8f90-a1b2c3d4e5f6"
NA = nvml.NVML_VALUE_NOT_AVAILABLE


def _gpu(n: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{n:012d}"


# --------------------------------------------------------------------------- NVML lists


def test_gpu_processes_merges_lists_drops_empty_keeps_unknown_memory() -> None:
    fake = nvml.FakeNvml(
        [
            nvml.FakeGpu(
                _gpu(0),
                compute={10: 4096, 11: 0, 12: None, 13: NA, 14: 1024},
                # 10 again in the graphics list (reported by both): one entry, max bytes.
                graphics={10: 2048, 15: 512},
            ),
            nvml.FakeGpu(_gpu(1), compute={10: 100, 16: 7}),
        ]
    )
    found = discovery.gpu_processes(fake)
    assert found == [
        discovery.GpuProcess(10, 0, _gpu(0), 4096),
        discovery.GpuProcess(10, 1, _gpu(1), 100),
        # N/A (None from pynvml, or the raw value): on a MIG-enabled GPU every process
        # reads so. Dropping them dropped every process of a MIG node; they are kept,
        # their memory unknown.
        discovery.GpuProcess(12, 0, _gpu(0), 0, memory_known=False),
        discovery.GpuProcess(13, 0, _gpu(0), 0, memory_known=False),
        discovery.GpuProcess(14, 0, _gpu(0), 1024),
        discovery.GpuProcess(15, 0, _gpu(0), 512),
        discovery.GpuProcess(16, 1, _gpu(1), 7),
    ]
    assert discovery.device_bytes_by_pid(found) == {
        10: 4196,
        12: 0,
        13: 0,
        14: 1024,
        15: 512,
        16: 7,
    }
    assert discovery.memory_unknown(found) == {12, 13}
    # A process maps to every device it is on (11 holds nothing there).
    assert discovery.pids_on_devices(found, [1]) == {10, 16}
    assert discovery.pids_on_devices(found, [0]) == {10, 12, 13, 14, 15}
    assert discovery.pids_on_devices(found, [2]) == set()


def test_gpu_processes_with_no_devices_is_empty() -> None:
    assert discovery.gpu_processes(nvml.FakeNvml()) == []


class _FakePynvml:
    """Just enough of pynvml's surface (module-level functions) for PynvmlNvml."""

    def __init__(self, *, init_error: Exception | None = None) -> None:
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"handle{index}"

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return _gpu(7).encode()  # old pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return types.SimpleNamespace(used=300, total=1000, free=700)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        # pynvml turns NVML_VALUE_NOT_AVAILABLE into None.
        return [
            types.SimpleNamespace(pid=5, usedGpuMemory=200),
            types.SimpleNamespace(pid=6, usedGpuMemory=None),
        ]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list[Any]:
        return [types.SimpleNamespace(pid=5, usedGpuMemory=200)]


def test_pynvml_wrapper_reads_devices_and_processes() -> None:
    module = _FakePynvml()
    wrapped = nvml.PynvmlNvml(module=module)
    assert wrapped.device_count() == 1
    assert wrapped.device_uuid(0) == _gpu(7)
    assert wrapped.memory(0) == (300, 1000)
    assert discovery.gpu_processes(wrapped) == [
        discovery.GpuProcess(5, 0, _gpu(7), 200),
        discovery.GpuProcess(6, 0, _gpu(7), 0, memory_known=False),
    ]
    wrapped.close()
    wrapped.close()
    assert module.shutdowns == 1


def test_a_failing_graphics_query_does_not_lose_the_compute_processes() -> None:
    class NVMLError_NotSupported(Exception):
        pass

    class NoGraphics(_FakePynvml):
        def nvmlDeviceGetGraphicsRunningProcesses(self, handle: str) -> list[Any]:
            raise NVMLError_NotSupported("Not Supported")

    wrapped = nvml.PynvmlNvml(module=NoGraphics())
    assert [p.pid for p in wrapped.processes(0)] == [5, 6]

    class NoCompute(_FakePynvml):
        def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
            raise NVMLError_NotSupported("Not Supported")

    # The compute list is what counts: its error is not hidden.
    with pytest.raises(NVMLError_NotSupported):
        nvml.PynvmlNvml(module=NoCompute()).processes(0)


def test_pynvml_init_failure_is_a_clear_unavailable_error() -> None:
    class NVMLError_DriverNotLoaded(Exception):
        pass

    with pytest.raises(nvml.NvmlUnavailableError, match="NVIDIA driver installed"):
        nvml.PynvmlNvml(module=_FakePynvml(init_error=NVMLError_DriverNotLoaded("not loaded")))


def test_open_nvml_without_pynvml_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # pynvml is not installed in the test environment; make sure of it.
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    with pytest.raises(nvml.NvmlUnavailableError, match=r"tslice\[gpu\]"):
        nvml.open_nvml()


# --------------------------------------------------------------------------- pod matching


def test_pids_for_pod_matches_dash_and_underscore_forms_v1_and_v2() -> None:
    candidates = [1001, 1002, 1003, 1004, 1005, 1006, 1007, 9999, 1001]
    # 1001: cgroup v1, cgroupfs driver (dashes); 1002: v2 systemd (underscores);
    # 1006: v1 systemd (underscores); 1003: another pod; 1004: no cgroup file;
    # 1005: cgroup is a directory (unreadable); 1007: host process; 9999: no such pid.
    assert discovery.pids_for_pod(POD, candidates, proc_root=PROC) == [1001, 1002, 1006]


def test_pids_for_pod_other_pod_and_empty_uid() -> None:
    other = "11111111-2222-3333-4444-555555555555"
    assert discovery.pids_for_pod(other, [1001, 1002, 1003], proc_root=PROC) == [1003]
    assert (
        discovery.pids_for_pod("aaaaaaaa-0000-0000-0000-000000000000", [1001], proc_root=PROC) == []
    )
    with pytest.raises(ValueError, match=r"metadata\.uid"):
        discovery.pids_for_pod("  ", [1001], proc_root=PROC)


def test_pids_for_pod_on_the_real_proc_does_not_match_this_process() -> None:
    assert discovery.pids_for_pod(POD, [os.getpid()]) == []


# --------------------------------------------------------------------------- pid checks


def test_process_exists_and_start_time_on_fixtures() -> None:
    # The command name contains spaces and ')' — parsing must use the last ')'.
    assert discovery.process_exists(1001, proc_root=PROC)
    assert discovery.process_start_time(1001, proc_root=PROC) == 123456
    assert discovery.process_start_time(1004, proc_root=PROC) == 5000
    assert not discovery.process_exists(1008, proc_root=PROC)  # zombie
    assert not discovery.process_exists(1002, proc_root=PROC)  # no stat file
    assert discovery.process_start_time(9999, proc_root=PROC) is None


def test_process_start_time_changes_with_the_process() -> None:
    first = subprocess.Popen(["sleep", "30"])
    try:
        start = discovery.process_start_time(first.pid)
        assert start is not None and start > 0
        assert discovery.process_exists(first.pid)
    finally:
        first.kill()
        first.wait()
    assert not discovery.process_exists(first.pid)
    assert discovery.process_start_time(first.pid) is None


def test_validate_pids_keeps_order_and_drops_duplicates() -> None:
    assert discovery.validate_pids([1004, 1001, 1004], proc_root=PROC) == [1004, 1001]


@pytest.mark.parametrize(
    ("pids", "message"),
    [
        ([0], "must be positive"),
        ([-3], "must be positive"),
        ([1001, 9999], "pid 9999 does not"),
        ([1008], "pid 1008 does not"),
    ],
    ids=["zero", "negative", "missing", "zombie"],
)
def test_validate_pids_refuses_bad_pids(pids: list[int], message: str) -> None:
    with pytest.raises(discovery.InvalidPidError, match=message):
        discovery.validate_pids(pids, proc_root=PROC)
