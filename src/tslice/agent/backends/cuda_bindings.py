"""The checkpoint driver through ``cuda.bindings.driver.cuCheckpointProcess*``.

Package ``cuda-bindings`` >= 12.9.1 (extra ``tslice[gpu]``; older ones hold the GIL
during driver calls). Driver calls block, so each one runs on a thread of its own
(:mod:`tslice.agent.backends.cuda_calls`), and cannot be interrupted: a caller's
deadline leaves the process in an unknown state, which the cuda backend accounts for,
and the process busy until the call returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from tslice.agent.backends import base, cuda_calls, cuda_driver

T = TypeVar("T")

_UNAVAILABLE_CODES = {
    "CUDA_ERROR_NO_DEVICE": "no NVIDIA GPU is visible to the driver",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the NVIDIA driver is too old for this CUDA version",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "the NVIDIA kernel driver and libcuda versions differ",
    "CUDA_ERROR_NOT_SUPPORTED": "the NVIDIA driver does not support checkpointing (need >= 570)",
    "CUDA_ERROR_NOT_FOUND": "the NVIDIA driver lacks the checkpoint API (need >= 570)",
    "CUDA_ERROR_STUB_LIBRARY": "only the CUDA stub library is installed, not the NVIDIA driver",
    "CUDA_ERROR_OPERATING_SYSTEM": "the operating system refused the driver call",
}
#: What ``cuCheckpointProcessGetState`` returns for a live process without a CUDA context.
_NO_CONTEXT_CODES = frozenset({"CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_INVALID_VALUE"})
#: The restore-onto-other-GPUs types; most cuda-bindings before 13.0.2 lack them, and 13.3.0.
_DEVICE_MAP_TYPES = ("CUcheckpointRestoreArgs", "CUcheckpointGpuPair", "CUuuid")


class BindingsDriver(cuda_driver.CheckpointDriver):
    """``cuda.bindings.driver.cuCheckpointProcess*``, each call in a worker thread."""

    name = "bindings"

    def __init__(self, *, module: Any | None = None, version: str | None = None) -> None:
        """``module`` replaces ``cuda.bindings.driver`` and ``version`` the installed
        cuda-bindings version (None outside tests)."""
        if module is None:
            module = self._import()
            version = cuda_driver.installed_bindings_version()
        too_old = cuda_driver.bindings_too_old(version)
        if too_old is not None:
            raise base.BackendUnavailableError(too_old)
        self._drv = module
        self._calls = cuda_calls.DriverCalls()
        self.driver_version = 0
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
                f"({', '.join(missing)}); upgrade to cuda-bindings >= 12.9.1"
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
        self.driver_version = int(version)
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
        if code in ("CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NO_DEVICE"):
            raise base.BackendUnavailableError(
                f"{op} of pid {pid} failed with {code}: {_UNAVAILABLE_CODES[code]}"
            )
        if code == "CUDA_ERROR_NOT_SUPPORTED":
            # The driver was checked at start (>= 570): this refusal is the process's.
            raise cuda_driver.ProcessNotSupportedError(
                f"the driver refuses to {op.replace('_', ' ')} pid {pid} ({code}): "
                f"{cuda_driver.NOT_SUPPORTED_WHY}",
                pid=pid,
                op=op,
                code=code,
            )
        detail = self._describe(err)
        message = f"{op} of pid {pid} failed with {code}" + (f": {detail}" if detail else "")
        error_cls: type[cuda_driver.DriverError] = cuda_driver.DriverError
        if op == "lock" and code in cuda_driver.LOCK_TIMEOUT_CODES:
            error_cls = cuda_driver.LockTimeoutError
        elif op == "get_state" and code in _NO_CONTEXT_CODES:
            error_cls = cuda_driver.NoCudaContextError
            message += " (the process has no CUDA context)"
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
        args = None
        if gpu_pairs:
            problem = self._device_map_problem()
            if problem:
                raise base.BackendUnavailableError(
                    f"restore of pid {pid} with a device_map: {problem}"
                )
            args = self._restore_args(gpu_pairs, keepalive)
        self._call("restore", pid, self._drv.cuCheckpointProcessRestore, args)
        del keepalive  # the UUID buffers must outlive the call above

    def _device_map_problem(self) -> str:
        """Why a restore cannot take ``gpuPairs`` here ('' if it can)."""
        drv = self._drv
        missing = [name for name in _DEVICE_MAP_TYPES if not hasattr(drv, name)]
        if not missing:
            try:
                if not hasattr(drv.CUcheckpointRestoreArgs(), "gpuPairs"):
                    missing.append("CUcheckpointRestoreArgs.gpuPairs")
            except Exception as exc:  # a binding that cannot even build the struct
                missing.append(f"CUcheckpointRestoreArgs ({exc})")
        if missing:
            return (
                f"the installed cuda-bindings lacks {', '.join(missing)} (most versions "
                "before 13.0.2 do, and 13.3.0); install one that has them, or remove "
                "device_map from the cuda backend's settings"
            )
        if self.driver_version < cuda_driver.MIN_DEVICE_MAP_DRIVER_VERSION:
            return (
                f"the NVIDIA driver supports CUDA {self.driver_version // 1000}."
                f"{self.driver_version % 1000 // 10}; restoring onto other GPUs needs "
                "driver >= 580 (CUDA 13.0)"
            )
        return ""

    async def check_device_map(self) -> None:
        problem = self._device_map_problem()
        if problem:
            raise base.BackendUnavailableError(f"device_map is configured, but {problem}")

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

    async def _run(self, pid: int, op: str, func: Callable[[], T]) -> T:
        return await self._calls.run(pid, op, func)

    def calls_in_flight(self) -> dict[int, str]:
        return self._calls.in_flight()

    async def get_state(self, pid: int) -> cuda_driver.ProcessState:
        return await self._run(pid, "get_state", lambda: self._get_state_sync(pid))

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        await self._run(pid, "lock", lambda: self._lock_sync(pid, timeout_ms))

    async def checkpoint(self, pid: int) -> None:
        drv = self._drv
        await self._run(
            pid,
            "checkpoint",
            lambda: self._call("checkpoint", pid, drv.cuCheckpointProcessCheckpoint, None),
        )

    async def restore(self, pid: int, *, gpu_pairs: cuda_driver.GpuPairs | None = None) -> None:
        await self._run(pid, "restore", lambda: self._restore_sync(pid, gpu_pairs))

    async def unlock(self, pid: int) -> None:
        drv = self._drv
        await self._run(
            pid, "unlock", lambda: self._call("unlock", pid, drv.cuCheckpointProcessUnlock, None)
        )

    async def device_count(self) -> int | None:
        def count() -> int:
            err, n = self._drv.cuDeviceGetCount()
            if not self._is_success(err):
                return 0
            return int(n)

        return await asyncio.to_thread(count)
