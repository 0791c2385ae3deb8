"""The shipped test double of the checkpoint driver.

Per-PID states that follow the driver's state machine, injectable failures, lock
timeouts and hangs; with a fake NVML, checkpoint and restore really move the
process's device memory, so byte measurements are real.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tslice.agent.backends import cuda_driver


@dataclasses.dataclass
class _Fault:
    op: str
    pid: int | None
    remaining: int
    kind: str  # "error" | "lock-timeout" | "hang"
    message: str
    #: For "error": the state the process is left in (None = unchanged).
    leave_state: cuda_driver.ProcessState | None = None
    #: For "error": raise this instead of a cuda_driver.DriverError.
    error: Exception | None = None


class FakeDriver(cuda_driver.CheckpointDriver):
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
        self.states: dict[int, cuda_driver.ProcessState] = {}
        self.calls: list[tuple[str, int]] = []
        self.last_gpu_pairs: dict[int, dict[str, str]] = {}
        self._faults: list[_Fault] = []
        self._release = asyncio.Event()
        #: Set when a hung call starts waiting, so tests synchronise on it.
        self.hung = asyncio.Event()
        self._parked: dict[int, list[tuple[str, int]]] = {}

    def add_process(
        self, pid: int, state: cuda_driver.ProcessState = cuda_driver.ProcessState.RUNNING
    ) -> None:
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
        leave_state: cuda_driver.ProcessState | None = None,
        error: Exception | None = None,
    ) -> None:
        """Make the next ``times`` calls of ``op`` (for ``pid`` or any) raise DriverError
        (or ``error``), leaving the process in ``leave_state`` if given."""
        self._faults.append(_Fault(op, pid, times, "error", message, leave_state, error))

    def lock_times_out(
        self,
        *,
        pid: int | None = None,
        times: int = 1,
        leave_state: cuda_driver.ProcessState | None = None,
    ) -> None:
        """Make the next ``times`` locks report the driver's timeout (CUDA_ERROR_NOT_READY);
        the process stays RUNNING unless ``leave_state`` says otherwise."""
        self._faults.append(
            _Fault("lock", pid, times, "lock-timeout", "lock timed out", leave_state)
        )

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

    async def _enter(self, op: str, pid: int) -> cuda_driver.ProcessState:
        self.calls.append((op, pid))
        if pid not in self.states:
            if not self.auto_add:
                raise cuda_driver.DriverError(
                    f"{op} of pid {pid} failed with CUDA_ERROR_INVALID_VALUE: "
                    "no CUDA process with that pid",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            self.states[pid] = cuda_driver.ProcessState.RUNNING
        fault = self._take_fault(op, pid)
        if fault is not None:
            if fault.kind == "hang":
                self.hung.set()
                await self._release.wait()
            elif fault.kind == "lock-timeout":
                if fault.leave_state is not None:
                    self.states[pid] = fault.leave_state
                # What the driver returns when the lock's timeoutMs runs out.
                raise cuda_driver.LockTimeoutError(
                    f"lock of pid {pid} failed with CUDA_ERROR_NOT_READY: device not ready",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_NOT_READY",
                )
            else:
                if fault.leave_state is not None:
                    self.states[pid] = fault.leave_state
                if fault.error is not None:
                    raise fault.error
                raise cuda_driver.DriverError(
                    f"{op} of pid {pid} failed with CUDA_ERROR_UNKNOWN: {fault.message}",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_UNKNOWN",
                )
        return self.states[pid]

    def _expect(
        self, op: str, pid: int, have: cuda_driver.ProcessState, want: cuda_driver.ProcessState
    ) -> None:
        if have is not want:
            raise cuda_driver.DriverError(
                f"{op} of pid {pid} failed with CUDA_ERROR_ILLEGAL_STATE: "
                f"process is {have.value}, not {want.value}",
                pid=pid,
                op=op,
                code="CUDA_ERROR_ILLEGAL_STATE",
            )

    async def get_state(self, pid: int) -> cuda_driver.ProcessState:
        return await self._enter("get_state", pid)

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        state = await self._enter("lock", pid)
        self._expect("lock", pid, state, cuda_driver.ProcessState.RUNNING)
        self.states[pid] = cuda_driver.ProcessState.LOCKED

    async def checkpoint(self, pid: int) -> None:
        state = await self._enter("checkpoint", pid)
        self._expect("checkpoint", pid, state, cuda_driver.ProcessState.LOCKED)
        if self.nvml is not None:
            self._parked[pid] = self.nvml.take_process(pid)
        self.states[pid] = cuda_driver.ProcessState.CHECKPOINTED

    async def restore(self, pid: int, *, gpu_pairs: cuda_driver.GpuPairs | None = None) -> None:
        state = await self._enter("restore", pid)
        self._expect("restore", pid, state, cuda_driver.ProcessState.CHECKPOINTED)
        pairs = {
            cuda_driver.normalize_gpu_uuid(o): cuda_driver.normalize_gpu_uuid(n)
            for o, n in (gpu_pairs or {}).items()
        }
        self.last_gpu_pairs[pid] = pairs
        if self.nvml is not None:
            self.nvml.put_process(pid, self._parked.pop(pid, []), remap=pairs)
        self.states[pid] = cuda_driver.ProcessState.LOCKED

    async def unlock(self, pid: int) -> None:
        state = await self._enter("unlock", pid)
        self._expect("unlock", pid, state, cuda_driver.ProcessState.LOCKED)
        self.states[pid] = cuda_driver.ProcessState.RUNNING

    async def device_count(self) -> int | None:
        if self.nvml is not None:
            return int(self.nvml.device_count())
        return self.devices
