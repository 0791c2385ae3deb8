"""NVML (GPU inventory and per-process device memory), imported lazily.

The agent needs NVML for three things: the accelerator list in ``Status``, the
device bytes a process holds (measured before and after a checkpoint), and the
candidate PIDs for pod discovery. ``pynvml`` (package ``nvidia-ml-py``, extra
``tslice[gpu]``) is imported only when :func:`open_nvml` is called, so the agent
runs on machines without it. :class:`FakeNvml` is the shipped test double.

Calls are blocking (NVML talks to the kernel driver); callers on the event loop
run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

#: What NVML reports (as an unsigned 64-bit value) when it cannot tell a process's memory.
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1

log = logging.getLogger(__name__)


class NvmlUnavailableError(RuntimeError):
    """NVML cannot be used on this machine; the message says why and what to install."""


@dataclasses.dataclass(frozen=True)
class ProcessMemory:
    """One entry of NVML's running-process lists, as reported (``None`` = not available)."""

    pid: int
    used_bytes: int | None


class Nvml(abc.ABC):
    """The few NVML queries tslice uses. Implementations are thread-safe."""

    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def device_uuid(self, index: int) -> str: ...

    @abc.abstractmethod
    def memory(self, index: int) -> tuple[int, int]:
        """``(used_bytes, total_bytes)`` of device ``index``."""

    @abc.abstractmethod
    def processes(self, index: int) -> list[ProcessMemory]:
        """Compute then graphics processes on device ``index`` (may repeat a PID)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Shut NVML down (idempotent)."""


class PynvmlNvml(Nvml):
    """NVML through ``pynvml``; initialised once for the life of the agent."""

    def __init__(self, *, module: Any | None = None) -> None:
        """``module`` replaces ``pynvml`` (None outside tests)."""
        if module is None:
            try:
                module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailableError(
                    "nvidia-ml-py (pynvml) is not installed; install tslice[gpu]"
                ) from exc
        self._nv = module
        self._lock = threading.Lock()
        self._open = False
        try:
            module.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, NoPermission...
            raise NvmlUnavailableError(
                f"NVML could not be initialised ({type(exc).__name__}: {exc}); is the NVIDIA "
                "driver installed and are /dev/nvidia* visible to the agent?"
            ) from exc
        self._open = True

    def _handle(self, index: int) -> Any:
        return self._nv.nvmlDeviceGetHandleByIndex(index)

    def device_count(self) -> int:
        return int(self._nv.nvmlDeviceGetCount())

    def device_uuid(self, index: int) -> str:
        uuid = self._nv.nvmlDeviceGetUUID(self._handle(index))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)

    def memory(self, index: int) -> tuple[int, int]:
        info = self._nv.nvmlDeviceGetMemoryInfo(self._handle(index))
        return int(info.used), int(info.total)

    def processes(self, index: int) -> list[ProcessMemory]:
        """Compute processes (an error here is raised), then graphics processes, whose
        query's errors are ignored: many data-centre GPUs and drivers refuse it
        (NVMLError_NotSupported), and a CUDA job is a compute process anyway."""
        handle = self._handle(index)
        found = [_entry(proc) for proc in self._nv.nvmlDeviceGetComputeRunningProcesses(handle)]
        try:
            graphics = self._nv.nvmlDeviceGetGraphicsRunningProcesses(handle)
        except Exception as exc:  # NVMLError_*: the compute list above is what counts
            log.debug("NVML graphics process list unavailable on device %d: %s", index, exc)
            graphics = []
        found.extend(_entry(proc) for proc in graphics)
        return found

    def close(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                self._nv.nvmlShutdown()


def _entry(proc: Any) -> ProcessMemory:
    used = getattr(proc, "usedGpuMemory", None)
    return ProcessMemory(int(proc.pid), None if used is None else int(used))


def open_nvml() -> Nvml:
    """NVML for this machine, or :class:`NvmlUnavailableError` saying why not."""
    return PynvmlNvml()


@dataclasses.dataclass
class FakeGpu:
    """One simulated device for :class:`FakeNvml`."""

    uuid: str
    total_bytes: int = 80 * 2**30
    #: Bytes in use by no listed process (driver reservations).
    reserved_bytes: int = 0
    #: pid → used bytes (``None`` or NVML_VALUE_NOT_AVAILABLE = not available).
    compute: dict[int, int | None] = dataclasses.field(default_factory=dict)
    graphics: dict[int, int | None] = dataclasses.field(default_factory=dict)


class FakeNvml(Nvml):
    """In-memory NVML: devices with per-process memory that tests (and FakeDriver) edit."""

    def __init__(self, gpus: Iterable[FakeGpu] = ()) -> None:
        self.gpus = list(gpus)
        self.closed = False
        self._lock = threading.Lock()

    def device_count(self) -> int:
        return len(self.gpus)

    def device_uuid(self, index: int) -> str:
        return self.gpus[index].uuid

    def memory(self, index: int) -> tuple[int, int]:
        gpu = self.gpus[index]
        with self._lock:
            seen = {**gpu.graphics, **gpu.compute}
            used = gpu.reserved_bytes + sum(
                b for b in seen.values() if b is not None and b != NVML_VALUE_NOT_AVAILABLE
            )
        return used, gpu.total_bytes

    def processes(self, index: int) -> list[ProcessMemory]:
        gpu = self.gpus[index]
        with self._lock:
            return [
                ProcessMemory(pid, used)
                for table in (gpu.compute, gpu.graphics)
                for pid, used in table.items()
            ]

    def take_process(self, pid: int) -> list[tuple[str, int | None]]:
        """Remove ``pid`` from every device; return ``(uuid, bytes)`` to put back later."""
        taken: list[tuple[str, int | None]] = []
        with self._lock:
            for gpu in self.gpus:
                if pid in gpu.compute:
                    taken.append((gpu.uuid, gpu.compute.pop(pid)))
                gpu.graphics.pop(pid, None)
        return taken

    def put_process(
        self,
        pid: int,
        entries: Iterable[tuple[str, int | None]],
        *,
        remap: Mapping[str, str] | None = None,
    ) -> None:
        """Put back what :meth:`take_process` removed, on ``remap[uuid]`` if given."""
        by_uuid = {gpu.uuid: gpu for gpu in self.gpus}
        with self._lock:
            for uuid, used in entries:
                target = (remap or {}).get(uuid, uuid)
                by_uuid[target].compute[pid] = used

    def close(self) -> None:
        self.closed = True
