"""One process through the CUDA checkpoint state machine, each step bounded by a deadline.

Every composite step reads the process's state first and does only what is left:
saving a CHECKPOINTED process does nothing, resuming a RUNNING one does nothing
(never a checkpoint, the reference's ``--toggle`` bug), and a half-done operation
retried finishes. :mod:`tslice.agent.backends.cuda_moves` strings the single steps
together over all of a job's processes at once; the cuda backend decides what a
failure means for the job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TypeVar

from tslice.agent.backends import base, cuda_driver

T = TypeVar("T")
RUNNING = cuda_driver.ProcessState.RUNNING
LOCKED = cuda_driver.ProcessState.LOCKED
CHECKPOINTED = cuda_driver.ProcessState.CHECKPOINTED
FAILED = cuda_driver.ProcessState.FAILED


class DeadlineHit(Exception):
    """The deadline passed during a driver call: the process's state is unknown."""

    def __init__(self, pid: int, op: str) -> None:
        super().__init__(f"{op} of pid {pid}")
        self.pid = pid
        self.op = op


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self._end - time.monotonic())


class ProcessSteps:
    """The per-process steps on one driver; calls for one PID run one at a time."""

    def __init__(
        self,
        driver: cuda_driver.CheckpointDriver,
        *,
        lock_timeout_ms: int,
        state_timeout_s: float = 30.0,
    ) -> None:
        self.driver = driver
        self.lock_timeout_ms = lock_timeout_ms
        #: A state read never takes longer than this (it can hang: cuda-checkpoint #30).
        self.state_timeout_s = state_timeout_s

    @staticmethod
    async def step(
        call: Callable[[], Awaitable[T]],
        deadline: Deadline,
        *,
        pid: int,
        op: str,
        at_most: float | None = None,
    ) -> T:
        remaining = deadline.remaining()
        if at_most is not None:
            remaining = min(remaining, at_most)
        if remaining <= 0:
            raise DeadlineHit(pid, op)
        try:
            return await asyncio.wait_for(call(), timeout=remaining)
        except asyncio.TimeoutError:
            raise DeadlineHit(pid, op) from None

    async def state(self, pid: int, deadline: Deadline) -> cuda_driver.ProcessState:
        return await self.step(
            lambda: self.driver.get_state(pid),
            deadline,
            pid=pid,
            op="get_state",
            at_most=self.state_timeout_s,
        )

    def _lock_timeout_ms(self, deadline: Deadline) -> int:
        # Leave room under the deadline so a lock timeout is reported as such.
        room_ms = int(deadline.remaining() * 900)
        return max(1, min(self.lock_timeout_ms, room_ms))

    async def lock(self, pid: int, deadline: Deadline) -> None:
        """RUNNING → LOCKED within the lock timeout. A timeout the driver reports is
        confirmed by reading the state: still RUNNING, it is a LockTimeoutError (nothing
        changed); LOCKED after all, the lock took; anything else is a DriverError."""
        timeout_ms = self._lock_timeout_ms(deadline)
        try:
            await self.step(
                lambda: self.driver.lock(pid, timeout_ms=timeout_ms),
                deadline,
                pid=pid,
                op="lock",
            )
        except cuda_driver.LockTimeoutError as timed_out:
            now = await self.state(pid, deadline)
            if now is RUNNING:
                raise
            if now is LOCKED:
                return
            raise cuda_driver.DriverError(
                f"{timed_out}, and the process is now {now.value}, not running",
                pid=pid,
                op="lock",
                code=timed_out.code,
            ) from timed_out

    async def checkpoint(self, pid: int, deadline: Deadline) -> None:
        """LOCKED → CHECKPOINTED (the device memory copied out and released)."""
        await self.step(lambda: self.driver.checkpoint(pid), deadline, pid=pid, op="checkpoint")

    async def restore(
        self, pid: int, deadline: Deadline, *, gpu_pairs: Mapping[str, str] | None
    ) -> None:
        """CHECKPOINTED → LOCKED (the device memory back, the process still locked)."""
        await self.step(
            lambda: self.driver.restore(pid, gpu_pairs=gpu_pairs), deadline, pid=pid, op="restore"
        )

    async def unlock(self, pid: int, deadline: Deadline) -> None:
        """LOCKED → RUNNING."""
        await self.step(lambda: self.driver.unlock(pid), deadline, pid=pid, op="unlock")

    async def save(self, pid: int, deadline: Deadline) -> str:
        """Bring one process to CHECKPOINTED, whatever its state; returns what was done."""
        state = await self.state(pid, deadline)
        if state is CHECKPOINTED:
            return "already checkpointed"
        if state is FAILED:
            raise failed(pid, "the process must be restarted")
        if state is RUNNING:
            await self.lock(pid, deadline)
        await self.checkpoint(pid, deadline)
        return "checkpointed"

    async def resume(
        self, pid: int, deadline: Deadline, *, gpu_pairs: Mapping[str, str] | None
    ) -> tuple[str, bool]:
        """Bring one process to RUNNING; returns (what was done, whether it changed)."""
        state = await self.state(pid, deadline)
        if state is RUNNING:
            return "already running", False
        if state is FAILED:
            raise failed(pid, "its device state is lost and the process must be restarted")
        done = "unlocked"
        if state is CHECKPOINTED:
            await self.restore(pid, deadline, gpu_pairs=gpu_pairs)
            done = "restored"
        await self.unlock(pid, deadline)
        return done, True

    async def rollback(self, pids: Sequence[int], *, budget_s: float) -> tuple[bool, str]:
        """Bring ``pids`` back to RUNNING, all at once, onto the GPUs they came from (no
        remap); returns (all ok, report)."""
        deadline = Deadline(budget_s)

        async def back(pid: int) -> tuple[bool, str]:
            try:
                done, _ = await self.resume(pid, deadline, gpu_pairs=None)
            except (cuda_driver.DriverError, base.BackendUnavailableError) as exc:
                return False, f"pid {pid} NOT rolled back ({exc})"
            except DeadlineHit as hit:
                return False, (
                    f"pid {pid} NOT rolled back ({hit} passed the "
                    f"{deadline.seconds:g} s rollback budget)"
                )
            return True, f"pid {pid} {done}"

        results = await asyncio.gather(*(back(pid) for pid in pids))
        notes = [note for _, note in results]
        return all(ok for ok, _ in results), "rolled back: " + (", ".join(notes) or "nothing")

    async def now(self, pid: int) -> str:
        """The process's state as a word for a report ('unknown' if it cannot be read)."""
        try:
            state = await asyncio.wait_for(self.driver.get_state(pid), timeout=self.state_timeout_s)
        except (cuda_driver.DriverError, base.BackendUnavailableError, asyncio.TimeoutError):
            return "unknown"
        return state.value


def failed(pid: int, consequence: str) -> cuda_driver.DriverError:
    return cuda_driver.DriverError(
        f"pid {pid} is in the driver's FAILED checkpoint state; {consequence}",
        pid=pid,
        op="get_state",
        code="CU_PROCESS_STATE_FAILED",
    )
