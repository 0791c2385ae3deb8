"""The CUDA driver checkpoint API behind one small async interface.

The cuda backend needs five per-process primitives (get_state, lock with a
timeout, checkpoint, restore with an optional GPU remap, unlock). NVIDIA exposes
them two ways, and this module hides which one a node has:

* :class:`BindingsDriver` calls ``cuda.bindings.driver.cuCheckpointProcess*``
  (package ``cuda-bindings``, extra ``tslice[gpu]``). Driver calls block, so each
  one runs in a worker thread.
* :class:`BinaryDriver` runs NVIDIA's ``cuda-checkpoint`` tool, one ``--pid`` per
  call, as an asyncio subprocess whose output ends up in the error text.
* :class:`FakeDriver` is the shipped test double: per-PID states that follow the
  driver's state machine, injectable failures, lock timeouts and hangs.

Every method is a coroutine without its own deadline: the caller bounds it with
``asyncio.wait_for``. Cancelling a :class:`BinaryDriver` call kills the tool; a
:class:`BindingsDriver` call cannot be interrupted (the thread finishes on its
own), which the backend accounts for by treating a deadline as "state unknown".

Nothing here is imported from ``cuda`` or ``pynvml`` at module import time.
"""

from __future__ import annotations

import abc
import asyncio
import ctypes
import dataclasses
import enum
import importlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from typing import Any, ClassVar

from tslice.agent.backends import base

#: Where the reference image ships the tool when it is not on PATH.
FALLBACK_BINARY = "/usr/local/bin/cuda-checkpoint"
#: CUDA 12.8 = driver r570: the first with the checkpoint API and lock timeouts.
MIN_DRIVER_VERSION = 12080
INSTALL_HINT = "install tslice[gpu] (cuda-bindings) or put NVIDIA's cuda-checkpoint on PATH"
_MAX_OUTPUT_CHARS = 2000
_UUID_RE = re.compile(
    r"^(?:GPU-)?([0-9a-f]{8}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{4}-?[0-9a-f]{12})$",
    re.IGNORECASE,
)


class ProcessState(enum.Enum):
    """CUDA checkpoint state of one process (``CUprocessState``)."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


class DriverError(Exception):
    """A checkpoint call failed for one process; ``code`` is the driver's error name."""

    def __init__(self, message: str, *, pid: int, op: str, code: str = "") -> None:
        super().__init__(message)
        self.pid = pid
        self.op = op
        self.code = code


class LockTimeoutError(DriverError):
    """The lock did not take within its timeout; the process is still RUNNING."""


GpuPairs = Mapping[str, str]


def normalize_gpu_uuid(value: str) -> str:
    """Return ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` or raise ValueError."""
    match = _UUID_RE.match(value.strip())
    if not match:
        raise ValueError(
            f"{value!r} is not a GPU UUID; use the form nvidia-smi -L prints "
            "(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
        )
    hexdigits = match.group(1).replace("-", "").lower()
    parts = (hexdigits[:8], hexdigits[8:12], hexdigits[12:16], hexdigits[16:20], hexdigits[20:])
    return "GPU-" + "-".join(parts)


class CheckpointDriver(abc.ABC):
    """Per-process checkpoint primitives. Calls for one PID must not overlap."""

    #: Short name reported in logs and persisted with the job ("bindings", "binary", "fake").
    name: ClassVar[str]

    @abc.abstractmethod
    async def get_state(self, pid: int) -> ProcessState:
        """Read the process's checkpoint state. Raises DriverError."""

    @abc.abstractmethod
    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        """RUNNING → LOCKED. Raises LockTimeoutError if it did not take in time."""

    @abc.abstractmethod
    async def checkpoint(self, pid: int) -> None:
        """LOCKED → CHECKPOINTED (device memory copied to host, GPU released)."""

    @abc.abstractmethod
    async def restore(self, pid: int, *, gpu_pairs: GpuPairs | None = None) -> None:
        """CHECKPOINTED → LOCKED, optionally onto other GPUs (old UUID → new UUID)."""

    @abc.abstractmethod
    async def unlock(self, pid: int) -> None:
        """LOCKED → RUNNING."""

    async def device_count(self) -> int | None:
        """GPUs the driver sees, or None if this driver cannot tell."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release driver resources."""


# --------------------------------------------------------------------------- selection


def select_driver(*, preference: str = "auto", binary: str | None = None) -> CheckpointDriver:
    """Pick the driver for this node.

    ``auto``: the bindings if ``cuda.bindings`` is importable and exposes the
    checkpoint API, else the ``cuda-checkpoint`` binary if found, else
    :class:`~tslice.agent.backends.base.BackendUnavailableError`. A missing GPU or
    NVIDIA driver is reported as such (it is not hidden by a fallback).
    """
    if preference == "fake":
        return FakeDriver(auto_add=True)
    if preference == "bindings":
        return BindingsDriver()
    if preference == "binary":
        return BinaryDriver(path=binary)
    if preference != "auto":
        raise base.BackendUnavailableError(
            f"unknown cuda driver {preference!r}; use auto, bindings, binary or fake"
        )
    bindings_problem = _bindings_missing()
    if bindings_problem is None:
        return BindingsDriver()
    path = find_binary(binary)
    if path is not None:
        return BinaryDriver(path=path)
    raise base.BackendUnavailableError(
        f"CUDA checkpointing is unavailable on this node: {bindings_problem}, and "
        f"cuda-checkpoint was not found on PATH or at {binary or FALLBACK_BINARY}; {INSTALL_HINT}"
    )


def find_binary(explicit: str | None = None) -> str | None:
    """Path of ``cuda-checkpoint``: the explicit path, PATH, then the fallback location."""
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("cuda-checkpoint")
    if found:
        return found
    return FALLBACK_BINARY if os.access(FALLBACK_BINARY, os.X_OK) else None


def _bindings_missing() -> str | None:
    """Why the bindings cannot be used (None if they can)."""
    try:
        module = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return "cuda-bindings is not installed"
    except Exception as exc:  # a broken install must not crash driver selection
        return f"cuda-bindings failed to import ({exc})"
    if not hasattr(module, "cuCheckpointProcessLock"):
        return "the installed cuda-bindings predates the checkpoint API (need >= 12.8)"
    return None


# --------------------------------------------------------------------------- bindings

_UNAVAILABLE_CODES = {
    "CUDA_ERROR_NO_DEVICE": "no NVIDIA GPU is visible to the driver",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": "the NVIDIA driver is too old for this CUDA version",
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": "the NVIDIA kernel driver and libcuda versions differ",
    "CUDA_ERROR_NOT_SUPPORTED": "the NVIDIA driver does not support checkpointing (need >= 570)",
    "CUDA_ERROR_NOT_FOUND": "the NVIDIA driver lacks the checkpoint API (need >= 570)",
    "CUDA_ERROR_STUB_LIBRARY": "only the CUDA stub library is installed, not the NVIDIA driver",
    "CUDA_ERROR_OPERATING_SYSTEM": "the operating system refused the driver call",
}


class BindingsDriver(CheckpointDriver):
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
                f"cuda-bindings is not installed ({exc}); {INSTALL_HINT}"
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
        if int(version) < MIN_DRIVER_VERSION:
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
            LockTimeoutError if op == "lock" and code == "CUDA_ERROR_TIMEOUT" else DriverError
        )
        raise error_cls(message, pid=pid, op=op, code=code)

    def _get_state_sync(self, pid: int) -> ProcessState:
        (state,) = self._call("get_state", pid, self._drv.cuCheckpointProcessGetState)
        states = self._drv.CUprocessState
        for member, attr in (
            (ProcessState.RUNNING, "CU_PROCESS_STATE_RUNNING"),
            (ProcessState.LOCKED, "CU_PROCESS_STATE_LOCKED"),
            (ProcessState.CHECKPOINTED, "CU_PROCESS_STATE_CHECKPOINTED"),
            (ProcessState.FAILED, "CU_PROCESS_STATE_FAILED"),
        ):
            if state == getattr(states, attr):
                return member
        raise DriverError(
            f"pid {pid} is in an unknown checkpoint state {state!r}",
            pid=pid,
            op="get_state",
            code="UNKNOWN_STATE",
        )

    def _lock_sync(self, pid: int, timeout_ms: int) -> None:
        args = self._drv.CUcheckpointLockArgs()
        args.timeoutMs = timeout_ms
        self._call("lock", pid, self._drv.cuCheckpointProcessLock, args)

    def _restore_sync(self, pid: int, gpu_pairs: GpuPairs | None) -> None:
        keepalive: list[Any] = []
        args = self._restore_args(gpu_pairs, keepalive) if gpu_pairs else None
        self._call("restore", pid, self._drv.cuCheckpointProcessRestore, args)
        del keepalive  # the UUID buffers must outlive the call above

    def _restore_args(self, gpu_pairs: GpuPairs, keepalive: list[Any]) -> Any:
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
        raw = bytes.fromhex(normalize_gpu_uuid(value)[4:].replace("-", ""))
        # CUuuid wraps a pointer to 16 bytes; the buffer is kept alive by the caller.
        buffer = ctypes.create_string_buffer(raw, 16)
        keepalive.append(buffer)
        return self._drv.CUuuid(ctypes.addressof(buffer))

    async def get_state(self, pid: int) -> ProcessState:
        return await asyncio.to_thread(self._get_state_sync, pid)

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        await asyncio.to_thread(self._lock_sync, pid, timeout_ms)

    async def checkpoint(self, pid: int) -> None:
        await asyncio.to_thread(
            self._call, "checkpoint", pid, self._drv.cuCheckpointProcessCheckpoint, None
        )

    async def restore(self, pid: int, *, gpu_pairs: GpuPairs | None = None) -> None:
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


# --------------------------------------------------------------------------- binary


class BinaryDriver(CheckpointDriver):
    """NVIDIA's ``cuda-checkpoint`` tool, one process per call, one ``--pid`` per call.

    The reference agent passed every PID to a single invocation, which the tool
    does not document; here each PID gets its own call so each step is checked.
    """

    name = "binary"

    def __init__(self, *, path: str | None = None) -> None:
        found = find_binary(path)
        if found is None:
            where = path or f"PATH or {FALLBACK_BINARY}"
            raise base.BackendUnavailableError(
                f"cuda-checkpoint was not found ({where}); {INSTALL_HINT}"
            )
        self.path = found

    async def _run(self, op: str, pid: int, *args: str, lock_timeout_ms: int = 0) -> str:
        started = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                self.path,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as exc:
            raise base.BackendUnavailableError(f"cannot run {self.path}: {exc}") from exc
        try:
            out_bytes, _ = await proc.communicate()
        except asyncio.CancelledError:
            # The caller's deadline passed: do not leave the tool running on its own.
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        output = out_bytes.decode(errors="replace").strip()
        if proc.returncode != 0:
            shown = output[-_MAX_OUTPUT_CHARS:] or "(no output)"
            message = (
                f"{op} of pid {pid} failed: cuda-checkpoint {' '.join(args)} "
                f"exited with {proc.returncode}: {shown}"
            )
            lowered = output.lower()
            # The tool's wording is not specified: a failed lock that mentions a
            # timeout, or that took the whole timeout, is a timeout.
            timed_out = op == "lock" and (
                "timeout" in lowered
                or "timed out" in lowered
                or (time.monotonic() - started) * 1000 >= lock_timeout_ms > 0
            )
            error_cls = LockTimeoutError if timed_out else DriverError
            raise error_cls(message, pid=pid, op=op, code=f"exit {proc.returncode}")
        return output

    async def get_state(self, pid: int) -> ProcessState:
        output = await self._run("get_state", pid, "--get-state", "--pid", str(pid))
        words = output.lower().split()
        for state in ProcessState:
            if state.value in words:
                return state
        raise DriverError(
            f"cuda-checkpoint --get-state --pid {pid} printed {output!r}, "
            "which is not a known state",
            pid=pid,
            op="get_state",
            code="UNKNOWN_STATE",
        )

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        await self._run(
            "lock",
            pid,
            "--action",
            "lock",
            "--pid",
            str(pid),
            "--timeout",
            str(timeout_ms),
            lock_timeout_ms=timeout_ms,
        )

    async def checkpoint(self, pid: int) -> None:
        await self._run("checkpoint", pid, "--action", "checkpoint", "--pid", str(pid))

    async def restore(self, pid: int, *, gpu_pairs: GpuPairs | None = None) -> None:
        args = ["--action", "restore", "--pid", str(pid)]
        if gpu_pairs:
            # r580+: every GPU visible to the process must be listed.
            mapping = ",".join(
                f"{normalize_gpu_uuid(o)}={normalize_gpu_uuid(n)}" for o, n in gpu_pairs.items()
            )
            args += ["--device-map", mapping]
        await self._run("restore", pid, *args)

    async def unlock(self, pid: int) -> None:
        await self._run("unlock", pid, "--action", "unlock", "--pid", str(pid))

    async def check_tool(self) -> None:
        """Raise BackendUnavailableError if the tool predates ``--action`` (driver < 570)."""
        try:
            proc = await asyncio.create_subprocess_exec(
                self.path,
                "--help",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
        except (OSError, asyncio.TimeoutError) as exc:
            raise base.BackendUnavailableError(f"cannot run {self.path} --help: {exc}") from exc
        if b"--action" not in out:
            raise base.BackendUnavailableError(
                f"{self.path} has no --action (lock/checkpoint/restore/unlock): it is older "
                "than r570; install the cuda-checkpoint that matches driver >= 570"
            )


# --------------------------------------------------------------------------- fake


@dataclasses.dataclass
class _Fault:
    op: str
    pid: int | None
    remaining: int
    kind: str  # "error" | "lock-timeout" | "hang"
    message: str
    #: For "error": the state the process is left in (None = unchanged).
    leave_state: ProcessState | None = None
    #: For "error": raise this instead of a DriverError.
    error: Exception | None = None


class FakeDriver(CheckpointDriver):
    """In-memory driver that follows the real state machine; the shipped test double.

    A process must be added (:meth:`add_process`) unless ``auto_add`` is set, in
    which case an unknown PID starts RUNNING. Calls are recorded in :attr:`calls`
    as ``(op, pid)``. Faults are injected with :meth:`fail`, :meth:`lock_times_out`
    and :meth:`hang`; a hung call waits until :meth:`release` or cancellation.

    If ``nvml`` (a :class:`tslice.agent.nvml.FakeNvml`) is given, checkpoint moves
    the process's device memory off its GPUs and restore puts it back (on the
    remapped GPU if ``gpu_pairs`` says so), so byte measurements are real.
    """

    name = "fake"

    def __init__(
        self, *, auto_add: bool = False, nvml: Any | None = None, devices: int | None = 1
    ) -> None:
        self.auto_add = auto_add
        self.nvml = nvml
        self.devices = devices
        self.states: dict[int, ProcessState] = {}
        self.calls: list[tuple[str, int]] = []
        self.last_gpu_pairs: dict[int, dict[str, str]] = {}
        self._faults: list[_Fault] = []
        self._release = asyncio.Event()
        #: Set when a hung call starts waiting, so tests synchronise on it.
        self.hung = asyncio.Event()
        self._parked: dict[int, list[tuple[str, int]]] = {}

    def add_process(self, pid: int, state: ProcessState = ProcessState.RUNNING) -> None:
        self.states[pid] = state

    def remove_process(self, pid: int) -> None:
        """The process exited: the driver no longer knows it."""
        self.states.pop(pid, None)

    def fail(
        self,
        op: str,
        *,
        pid: int | None = None,
        times: int = 1,
        message: str = "injected failure",
        leave_state: ProcessState | None = None,
        error: Exception | None = None,
    ) -> None:
        """Make the next ``times`` calls of ``op`` (for ``pid`` or any) raise DriverError
        (or ``error``), leaving the process in ``leave_state`` if given."""
        self._faults.append(_Fault(op, pid, times, "error", message, leave_state, error))

    def lock_times_out(self, *, pid: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` locks raise LockTimeoutError (the process stays RUNNING)."""
        self._faults.append(_Fault("lock", pid, times, "lock-timeout", "lock timed out"))

    def hang(self, op: str, *, pid: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` calls of ``op`` block until :meth:`release` or cancel."""
        self._faults.append(_Fault(op, pid, times, "hang", "hang"))

    def release(self) -> None:
        self._release.set()

    def _take_fault(self, op: str, pid: int) -> _Fault | None:
        for fault in self._faults:
            if fault.op == op and fault.pid in (None, pid) and fault.remaining > 0:
                fault.remaining -= 1
                return fault
        return None

    async def _enter(self, op: str, pid: int) -> ProcessState:
        self.calls.append((op, pid))
        if pid not in self.states:
            if not self.auto_add:
                raise DriverError(
                    f"{op} of pid {pid} failed with CUDA_ERROR_INVALID_VALUE: "
                    "no CUDA process with that pid",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            self.states[pid] = ProcessState.RUNNING
        fault = self._take_fault(op, pid)
        if fault is not None:
            if fault.kind == "hang":
                self.hung.set()
                await self._release.wait()
            elif fault.kind == "lock-timeout":
                raise LockTimeoutError(
                    f"lock of pid {pid} failed with CUDA_ERROR_TIMEOUT",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_TIMEOUT",
                )
            else:
                if fault.leave_state is not None:
                    self.states[pid] = fault.leave_state
                if fault.error is not None:
                    raise fault.error
                raise DriverError(
                    f"{op} of pid {pid} failed with CUDA_ERROR_UNKNOWN: {fault.message}",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_UNKNOWN",
                )
        return self.states[pid]

    def _expect(self, op: str, pid: int, have: ProcessState, want: ProcessState) -> None:
        if have is not want:
            raise DriverError(
                f"{op} of pid {pid} failed with CUDA_ERROR_ILLEGAL_STATE: "
                f"process is {have.value}, not {want.value}",
                pid=pid,
                op=op,
                code="CUDA_ERROR_ILLEGAL_STATE",
            )

    async def get_state(self, pid: int) -> ProcessState:
        return await self._enter("get_state", pid)

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        state = await self._enter("lock", pid)
        self._expect("lock", pid, state, ProcessState.RUNNING)
        self.states[pid] = ProcessState.LOCKED

    async def checkpoint(self, pid: int) -> None:
        state = await self._enter("checkpoint", pid)
        self._expect("checkpoint", pid, state, ProcessState.LOCKED)
        if self.nvml is not None:
            self._parked[pid] = self.nvml.take_process(pid)
        self.states[pid] = ProcessState.CHECKPOINTED

    async def restore(self, pid: int, *, gpu_pairs: GpuPairs | None = None) -> None:
        state = await self._enter("restore", pid)
        self._expect("restore", pid, state, ProcessState.CHECKPOINTED)
        pairs = {normalize_gpu_uuid(o): normalize_gpu_uuid(n) for o, n in (gpu_pairs or {}).items()}
        self.last_gpu_pairs[pid] = pairs
        if self.nvml is not None:
            self.nvml.put_process(pid, self._parked.pop(pid, []), remap=pairs)
        self.states[pid] = ProcessState.LOCKED

    async def unlock(self, pid: int) -> None:
        state = await self._enter("unlock", pid)
        self._expect("unlock", pid, state, ProcessState.LOCKED)
        self.states[pid] = ProcessState.RUNNING

    async def device_count(self) -> int | None:
        if self.nvml is not None:
            return int(self.nvml.device_count())
        return self.devices
