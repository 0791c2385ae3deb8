"""The checkpoint driver through ``cuda.bindings.driver.cuCheckpointProcess*``.

Package ``cuda-bindings`` (extra ``tslice[gpu]``). Driver calls block, so each one
runs in a worker thread, and cannot be interrupted: a caller's deadline leaves the
process in an unknown state, which the cuda backend accounts for.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
from typing import Any

from tslice.agent.backends import base, cuda_driver

_UNAVAILABLE_CODES = {
    "CUDA_ERROR_NO_DEVICE": "no NVIDIA GPU is visible to the driver",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the NVIDIA driver is too old for this CUDA version",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "the NVIDIA kernel driver and libcuda versions differ",
    "CUDA_ERROR_NOT_SUPPORTED": "the NVIDIA driver does not support checkpointing (need >= 570)",
    "CUDA_ERROR_NOT_FOUND": "the NVIDIA driver lacks the checkpoint API (need >= 570)",
    "CUDA_ERROR_STUB_LIBRARY": "only the CUDA stub library is installed, not the NVIDIA driver",
    "CUDA_ERROR_OPERATING_SYSTEM": "the operating system refused the driver call",
}


class BindingsDriver(cuda_driver.CheckpointDriver):
    """``cuda.bindings.driver.cuCheckpointProcess*``, each call in a worker thread."""

    name = "bindings"

    def __init__(self, *, module: Any | None = None) -> None:
        """``module`` replaces ``cuda.bindings.driver`` (None outside tests)."""
        self._drv = module if module is not None else self._import()
        self._init_driver()

    @staticmethod
    def _import() -> Any:
        try:
            return importlib.import_module("cuda.bindings.driver")
        except ImportError as exc:
            raise base.BackendUnavailableError(
                f"cuda-bindings is not installed ({exc}); {cuda_driver.INSTALL_HINT}"
            ) from exc

    def _init_driver(self) -> None:
        drv = self._drv
        missing = [
            n
            for n in ("cuCheckpointProcessLock", "cuCheckpointProcessGetState")
            if not hasattr(drv, n)
        ]
        if missing:
            raise base.BackendUnavailableError(
                "the installed cuda-bindings lacks the checkpoint API "
                f"({', '.join(missing)}); upgrade to cuda-bindings >= 12.8"
            )
        try:
            (err,) = drv.cuInit(0)
        except RuntimeError as exc:  # libcuda.so could not be loaded at all
            raise base.BackendUnavailableError(
                f"the NVIDIA driver library could not be loaded ({exc}); is the NVIDIA "
                "driver installed and /dev/nvidia* visible to the agent?"
            ) from exc
        self._check_init(err, "cuInit")
        err, version = drv.cuDriverGetVersion()
        self._check_init(err, "cuDriverGetVersion")
        if int(version) < cuda_driver.MIN_DRIVER_VERSION:
            raise base.BackendUnavailableError(
                f"the NVIDIA driver supports CUDA {int(version) // 1000}."
                f"{int(version) % 1000 // 10}; "
                "checkpointing with lock timeouts needs driver >= 570 (CUDA 12.8)"
            )

    def _error_name(self, err: Any) -> str:
        name = getattr(err, "name", None)
        return name if isinstance(name, str) else str(err)

    def _is_success(self, err: Any) -> bool:
        return bool(err == self._drv.CUresult.CUDA_SUCCESS)

    def _check_init(self, err: Any, call: str) -> None:
        if self._is_success(err):
            return
        code = self._error_name(err)
        reason = _UNAVAILABLE_CODES.get(code, "the CUDA driver failed to initialise")
        raise base.BackendUnavailableError(f"{call} failed with {code}: {reason}")

    def _describe(self, err: Any) -> str:
        try:
            res, text = self._drv.cuGetErrorString(err)
            if self._is_success(res) and text:
                return text.decode() if isinstance(text, bytes) else str(text)
        except Exception:  # the description is best effort only
            pass
        return ""

    def _call(self, op: str, pid: int, func: Any, *args: Any) -> tuple[Any, ...]:
        try:
            result = func(pid, *args)
        except RuntimeError as exc:
            # cuda-bindings raises this when libcuda lacks the symbol (driver < 570).
            raise base.BackendUnavailableError(
                f"{op} is not available in this NVIDIA driver ({exc}); driver >= 570 is needed"
            ) from exc
        err, rest = result[0], tuple(result[1:])
        if self._is_success(err):
            return rest
        code = self._error_name(err)
        if code in ("CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NO_DEVICE"):
            raise base.BackendUnavailableError(
                f"{op} of pid {pid} failed with {code}: {_UNAVAILABLE_CODES[code]}"
            )
        detail = self._describe(err)
        message = f"{op} of pid {pid} failed with {code}" + (f": {detail}" if detail else "")
        error_cls = (
            cuda_driver.LockTimeoutError
            if op == "lock" and code in cuda_driver.LOCK_TIMEOUT_CODES
            else cuda_driver.DriverError
        )
        raise error_cls(message, pid=pid, op=op, code=code)

    def _get_state_sync(self, pid: int) -> cuda_driver.ProcessState:
        (state,) = self._call("get_state", pid, self._drv.cuCheckpointProcessGetState)
        states = self._drv.CUprocessState
        for member, attr in (
            (cuda_driver.ProcessState.RUNNING, "CU_PROCESS_STATE_RUNNING"),
            (cuda_driver.ProcessState.LOCKED, "CU_PROCESS_STATE_LOCKED"),
            (cuda_driver.ProcessState.CHECKPOINTED, "CU_PROCESS_STATE_CHECKPOINTED"),
            (cuda_driver.ProcessState.FAILED, "CU_PROCESS_STATE_FAILED"),
        ):
            if state == getattr(states, attr):
                return member
        raise cuda_driver.DriverError(
            f"pid {pid} is in an unknown checkpoint state {state!r}",
            pid=pid,
            op="get_state",
            code="UNKNOWN_STATE",
        )

    def _lock_sync(self, pid: int, timeout_ms: int) -> None:
        args = self._drv.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._call("lock", pid, self._drv.cuCheckpointProcessLock, args)

    def _restore_sync(self, pid: int, gpu_pairs: cuda_driver.GpuPairs | None) -> None:
        keepalive: list[Any] = []
        args = self._restore_args(gpu_pairs, keepalive) if gpu_pairs else None
        self._call("restore", pid, self._drv.cuCheckpointProcessRestore, args)
        del keepalive  # the UUID buffers must outlive the call above

    def _restore_args(self, gpu_pairs: cuda_driver.GpuPairs, keepalive: list[Any]) -> Any:
        drv = self._drv
        pairs = []
        for old, new in gpu_pairs.items():
            pair = drv.CUcheckpointGpuPair()
            pair.oldUuid = self._cuuuid(old, keepalive)
            pair.newUuid = self._cuuuid(new, keepalive)
            pairs.append(pair)
        args = drv.CUcheckpointRestoreArgs()
        args.gpuPairs = pairs
        args.gpuPairsCount = len(pairs)
        return args

    def _cuuuid(self, value: str, keepalive: list[Any]) -> Any:
        raw = bytes.fromhex(cuda_driver.normalize_gpu_uuid(value)[4:].replace("-", ""))
        # CUuuid wraps a pointer to 16 bytes; the buffer is kept alive by the caller.
        buffer = ctypes.create_string_buffer(raw, 16)
        keepalive.append(buffer)
        return self._drv.CUuuid(ctypes.addressof(buffer))

    async def get_state(self, pid: int) -> cuda_driver.ProcessState:
        return await asyncio.to_thread(self._get_state_sync, pid)

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        await asyncio.to_thread(self._lock_sync, pid, timeout_ms)

    async def checkpoint(self, pid: int) -> None:
        await asyncio.to_thread(
            self._call, "checkpoint", pid, self._drv.cuCheckpointProcessCheckpoint, None
        )

    async def restore(self, pid: int, *, gpu_pairs: cuda_driver.GpuPairs | None = None) -> None:
        await asyncio.to_thread(self._restore_sync, pid, gpu_pairs)

    async def unlock(self, pid: int) -> None:
        await asyncio.to_thread(
            self._call, "unlock", pid, self._drv.cuCheckpointProcessUnlock, None
        )

    async def device_count(self) -> int | None:
        def count() -> int:
            err, n = self._drv.cuDeviceGetCount()
            if not self._is_success(err):
                return 0
            return int(n)

        return await asyncio.to_thread(count)
