"""The shipped test double of the checkpoint driver.

Per-PID states that follow the driver's state machine, injectable failures, lock
timeouts and hangs; with a fake NVML, checkpoint and restore really move the
process's device memory, so byte measurements are real.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from tslice.agent.backends import base, cuda_driver

T = TypeVar("T")
#: What NVML reports for a process whose memory it cannot tell (MIG, vGPU).
NOT_AVAILABLE = 2**64 - 1


def _forget(task: asyncio.Task[Any]) -> None:
    """An abandoned call's outcome: nobody waits for it any more."""
    if not task.cancelled():
        task.exception()


@dataclasses.dataclass
class _Fault:
    op: str
    pid: int | None
    remaining: int
    kind: str  # "error" | "lock-timeout" | "hang" | "stuck"
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
        self,
        *,
        auto_add: bool = False,
        nvml: Any | None = None,
        devices: int | None = 1,
        copy_bytes_per_s: float | None = None,
    ) -> None:
        self.auto_add = auto_add
        #: Why restores cannot take a GPU map here ('' = they can): :meth:`check_device_map`.
        self.device_map_problem = ""
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
        self._in_flight: dict[int, str] = {}
        self._stuck: set[asyncio.Task[Any]] = set()
        self._running: dict[str, int] = {}
        self._held: dict[int, int] = {}
        #: Most calls of each operation that ran at once (lock, checkpoint, ...).
        self.peak_in_flight: dict[str, int] = {}
        #: Device bytes per process where there is no ``nvml`` (for the copy time).
        self.device_bytes: dict[int, int] = {}
        #: Each process's own link, bytes per second: checkpoint and restore take
        #: ``bytes / copy_bytes_per_s`` (None: no time at all).
        self.copy_bytes_per_s = copy_bytes_per_s
        #: A model of the processes (tests with real ones): the lock waits, up to its
        #: timeout, until ``lock_ready(pid)`` (the process has no CUDA call in flight,
        #: e.g. not inside a collective), then ``on_lock(pid)`` stops it from making
        #: more; ``on_unlock(pid)`` lets it go on.
        self.lock_ready: Callable[[int], bool] | None = None
        #: Processes whose checkpoint succeeds but leaves their memory on the device
        #: (what the freed-memory check must catch).
        self.keeps_memory: set[int] = set()
        self.on_lock: Callable[[int], None] | None = None
        self.on_unlock: Callable[[int], None] | None = None

    def add_process(
        self,
        pid: int,
        state: cuda_driver.ProcessState = cuda_driver.ProcessState.RUNNING,
        *,
        device_bytes: int = 0,
    ) -> None:
        self.states[pid] = state
        if device_bytes:
            self.device_bytes[pid] = device_bytes

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

    def hang(
        self, op: str, *, pid: int | None = None, times: int = 1, uninterruptible: bool = False
    ) -> None:
        """Make the next ``times`` calls of ``op`` block until :meth:`release` or cancel.

        ``uninterruptible``: as a real driver call on its thread, the call goes on after
        its caller gave up (a deadline), until :meth:`release`, and its PID stays in
        :meth:`calls_in_flight` until then.
        """
        kind = "stuck" if uninterruptible else "hang"
        self._faults.append(_Fault(op, pid, times, kind, "hang"))

    def calls_in_flight(self) -> dict[int, str]:
        return dict(self._in_flight)

    def stuck_calls(self) -> list[asyncio.Task[Any]]:
        """The uninterruptible calls still running (tests await them after release)."""
        return list(self._stuck)

    def release(self) -> None:
        self._release.set()

    def _take_fault(self, op: str, pid: int) -> _Fault | None:
        for fault in self._faults:
            if fault.op == op and fault.pid in (None, pid) and fault.remaining > 0:
                fault.remaining -= 1
                return fault
        return None

    async def _enter(self, op: str, pid: int) -> bool:
        """Record the call and apply an injected fault; True for an uninterruptible hang."""
        self.calls.append((op, pid))
        if pid not in self.states:
            if not self.auto_add:
                raise cuda_driver.NoCudaContextError(
                    f"{op} of pid {pid} failed with CUDA_ERROR_INVALID_VALUE: "
                    "no CUDA process with that pid",
                    pid=pid,
                    op=op,
                    code="CUDA_ERROR_INVALID_VALUE",
                )
            self.states[pid] = cuda_driver.ProcessState.RUNNING
        fault = self._take_fault(op, pid)
        if fault is None:
            return False
        if fault.kind == "hang":
            self.hung.set()
            await self._release.wait()
            return False
        if fault.kind == "stuck":
            return True
        if fault.leave_state is not None:
            self.states[pid] = fault.leave_state
        if fault.kind == "lock-timeout":
            # What the driver returns when the lock's timeoutMs runs out.
            raise cuda_driver.LockTimeoutError(
                f"lock of pid {pid} failed with CUDA_ERROR_NOT_READY: device not ready",
                pid=pid,
                op=op,
                code="CUDA_ERROR_NOT_READY",
            )
        if fault.error is not None:
            raise fault.error
        raise cuda_driver.DriverError(
            f"{op} of pid {pid} failed with CUDA_ERROR_UNKNOWN: {fault.message}",
            pid=pid,
            op=op,
            code="CUDA_ERROR_UNKNOWN",
        )

    async def _call(self, op: str, pid: int, effect: Callable[[], Awaitable[T]]) -> T:
        """One driver call: its faults, then ``effect`` (what the driver does), counted in
        :attr:`peak_in_flight`. An uninterruptible hang runs both in a task of its own that
        a cancelled caller leaves running, the PID in :meth:`calls_in_flight` until then."""
        stuck = await self._enter(op, pid)

        async def run() -> T:
            self._running[op] = self._running.get(op, 0) + 1
            self.peak_in_flight[op] = max(self.peak_in_flight.get(op, 0), self._running[op])
            try:
                return await effect()
            finally:
                self._running[op] -= 1

        if not stuck:
            return await run()

        async def stuck_call() -> T:
            try:
                await self._release.wait()
                return await run()
            finally:
                self._in_flight.pop(pid, None)

        self._in_flight[pid] = op
        task = asyncio.get_running_loop().create_task(stuck_call())
        self._stuck.add(task)
        task.add_done_callback(self._stuck.discard)
        task.add_done_callback(_forget)
        self.hung.set()
        return await asyncio.shield(task)

    def _expect(self, op: str, pid: int, want: cuda_driver.ProcessState) -> None:
        have = self.states.get(pid)
        if have is not want:
            shown = have.value if have is not None else "gone"
            raise cuda_driver.DriverError(
                f"{op} of pid {pid} failed with CUDA_ERROR_ILLEGAL_STATE: "
                f"process is {shown}, not {want.value}",
                pid=pid,
                op=op,
                code="CUDA_ERROR_ILLEGAL_STATE",
            )

    async def _wait_lockable(self, pid: int, timeout_ms: int) -> None:
        """As the driver's lock: wait for the process's calls in flight to end, at most
        ``timeout_ms``; then CUDA_ERROR_NOT_READY, the process still running."""
        ready = self.lock_ready
        if ready is None:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_ms / 1000
        while not ready(pid):
            if loop.time() >= end:
                raise cuda_driver.LockTimeoutError(
                    f"lock of pid {pid} failed with CUDA_ERROR_NOT_READY: device not ready",
                    pid=pid,
                    op="lock",
                    code="CUDA_ERROR_NOT_READY",
                )
            await asyncio.sleep(0.002)  # the driver polls the process's calls too

    async def _copy(self, pid: int, nbytes: int) -> None:
        """The time a copy of the process's memory takes over its own link."""
        if self.copy_bytes_per_s:
            await asyncio.sleep(nbytes / self.copy_bytes_per_s)

    def _bytes_of(self, pid: int) -> int:
        if self.nvml is not None:
            return sum(
                used or 0
                for gpu in self.nvml.gpus
                for p, used in gpu.compute.items()
                if p == pid and used != NOT_AVAILABLE
            )
        return self.device_bytes.get(pid, 0)

    async def get_state(self, pid: int) -> cuda_driver.ProcessState:
        async def read() -> cuda_driver.ProcessState:
            return self.states[pid]

        return await self._call("get_state", pid, read)

    async def lock(self, pid: int, *, timeout_ms: int) -> None:
        async def lock() -> None:
            self._expect("lock", pid, cuda_driver.ProcessState.RUNNING)
            await self._wait_lockable(pid, timeout_ms)
            if self.on_lock is not None:
                self.on_lock(pid)
            self.states[pid] = cuda_driver.ProcessState.LOCKED

        await self._call("lock", pid, lock)

    async def checkpoint(self, pid: int) -> None:
        async def checkpoint() -> None:
            self._expect("checkpoint", pid, cuda_driver.ProcessState.LOCKED)
            nbytes = self._bytes_of(pid)
            await self._copy(pid, nbytes)
            self._held[pid] = nbytes
            if self.nvml is not None and pid not in self.keeps_memory:
                self._parked[pid] = self.nvml.take_process(pid)
            self.states[pid] = cuda_driver.ProcessState.CHECKPOINTED

        await self._call("checkpoint", pid, checkpoint)

    async def restore(self, pid: int, *, gpu_pairs: cuda_driver.GpuPairs | None = None) -> None:
        async def restore() -> None:
            self._expect("restore", pid, cuda_driver.ProcessState.CHECKPOINTED)
            pairs = {
                cuda_driver.normalize_gpu_uuid(o): cuda_driver.normalize_gpu_uuid(n)
                for o, n in (gpu_pairs or {}).items()
            }
            await self._copy(pid, self._held.pop(pid, 0))
            self.last_gpu_pairs[pid] = pairs
            if self.nvml is not None:
                self.nvml.put_process(pid, self._parked.pop(pid, []), remap=pairs)
            self.states[pid] = cuda_driver.ProcessState.LOCKED

        await self._call("restore", pid, restore)

    async def unlock(self, pid: int) -> None:
        async def unlock() -> None:
            self._expect("unlock", pid, cuda_driver.ProcessState.LOCKED)
            if self.on_unlock is not None:
                self.on_unlock(pid)
            self.states[pid] = cuda_driver.ProcessState.RUNNING

        await self._call("unlock", pid, unlock)

    async def check_device_map(self) -> None:
        if self.device_map_problem:
            raise base.BackendUnavailableError(self.device_map_problem)

    async def device_count(self) -> int | None:
        if self.nvml is not None:
            return int(self.nvml.device_count())
        return self.devices
