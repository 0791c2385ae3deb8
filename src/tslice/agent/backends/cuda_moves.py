"""A job's processes on this node moved together: lock all, then checkpoint all; restore
all, then unlock all.

Why together, and in phases: a multi-GPU job is one process per GPU (tensor-parallel
engine ranks, FSDP or Megatron ranks). One after another costs the sum of the copies
(about 15 s per H100, minutes per node) although each GPU has its own link; and it is
wrong for ranks that talk to each other: once one rank is checkpointed while the others
still run, their next collective touches memory that is gone (cuda-checkpoint #30,
#45). So every process is locked first (each bounded by the lock timeout), then every
process is checkpointed, one task each, each over its own GPU's link; a restore brings
every process back before any is unlocked. ``parallel`` bounds the tasks of a phase
(0: all at once).

All or nothing, with the single-process rules:

* snapshot: a failure in any phase brings every process back to RUNNING (unlock the
  locked, restore and unlock the checkpointed), all at once; the error says what the
  rollback did, and where it could not, what each process is now. Lock timeouts only
  (confirmed RUNNING) are :class:`~tslice.agent.backends.base.TransientBackendError`;
  per-process refusals (``CUDA_ERROR_NOT_SUPPORTED``) are
  :class:`~tslice.agent.backends.base.RefusedBackendError`; anything else is fatal.
* restore: a failure while every process is still CHECKPOINTED changed nothing and is
  transient; otherwise the error reports exactly what is where (restored processes
  stay LOCKED, never running beside a missing peer; ``recover()`` repairs them).
* a deadline leaves the process in an unknown state: fatal, nothing rolled back.

Processes with no CUDA context, and RUNNING ones known to hold no device memory, are
skipped with a warning (a launcher, a Ray daemon): locking them fails and there is
nothing to move. Workload hooks (:class:`Hooks`) quiesce the processes before the
first lock and resume them after the last unlock (or the rollback).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Literal, Protocol

from tslice.agent.backends import base, cuda_driver, cuda_steps
from tslice.agent.channel import quiesce

log = logging.getLogger(__name__)

RUNNING = cuda_steps.RUNNING
LOCKED = cuda_steps.LOCKED
CHECKPOINTED = cuda_steps.CHECKPOINTED
FAILED = cuda_steps.FAILED
Kind = Literal["snapshot", "restore"]


class Hooks(Protocol):
    """Workload hooks around a move (:class:`tslice.agent.channel.quiesce.ProcessHooks`)."""

    async def quiesce(self, pids: Sequence[int], *, timeout_s: float) -> None:
        """Ask the processes to reach a safe point (communicators suspended) before they
        are locked; raise :class:`tslice.agent.channel.quiesce.HookError` if one cannot."""

    async def resume(self, pids: Sequence[int], *, timeout_s: float) -> None:
        """Let them go on (communicators resumed); never raises."""


@dataclasses.dataclass(frozen=True)
class Moved:
    """What a job move did."""

    #: The processes the job's state is in now: checkpointed (snapshot) or restored.
    pids: list[int]
    #: Processes left alone, and why (no CUDA context, no device memory).
    skipped: dict[int, str] = dataclasses.field(default_factory=dict)
    #: Restore: why the device map was not used ('' = it was, or none was given).
    map_refused: str = ""


class JobMoves:
    """Moves one job's processes; one instance per operation."""

    def __init__(
        self,
        steps: cuda_steps.ProcessSteps,
        *,
        job_id: str,
        deadline: cuda_steps.Deadline,
        rollback_budget_s: float,
        parallel: int = 0,
        hooks: Hooks | None = None,
        hook_timeout_s: float = 60.0,
    ) -> None:
        self.steps = steps
        self.job_id = job_id
        self.deadline = deadline
        self.rollback_budget_s = rollback_budget_s
        self._gate = asyncio.Semaphore(parallel) if parallel > 0 else None
        self.hooks = hooks
        self.hook_timeout_s = hook_timeout_s
        self._order: list[int] = []

    # ------------------------------------------------------------------ snapshot

    async def snapshot(self, pids: Sequence[int], *, idle: Collection[int] = ()) -> Moved:
        """Checkpoint every process of ``pids``; ``idle``: those NVML saw no memory of."""
        self._order = list(pids)
        states, skipped = await self._survey("snapshot", pids)
        for pid, state in states.items():
            if state is RUNNING and pid in idle:
                skipped[pid] = "it holds no device memory"
        for pid, why in skipped.items():
            states.pop(pid, None)
            log.warning(
                "process skipped: %s",
                why,
                extra={"job_id": self.job_id, "pid": pid, "reason": why},
            )
        broken = [pid for pid, state in states.items() if state is FAILED]
        if broken:
            raise base.FatalBackendError(
                f"{self._where('snapshot', broken[0])}: "
                f"{cuda_steps.failed(broken[0], 'the process must be restarted')}; "
                "nothing was changed"
            )
        running = [pid for pid, state in states.items() if state is RUNNING]
        await self._quiesce(running)
        known = dict(states)
        failures = await self._each(running, lambda pid: self.steps.lock(pid, self.deadline))
        for pid in running:
            if pid not in failures:
                known[pid] = LOCKED
        if failures:
            raise await self._undo_snapshot(failures, known, running)
        locked = [pid for pid, state in known.items() if state is LOCKED]
        failures = await self._each(locked, lambda pid: self.steps.checkpoint(pid, self.deadline))
        for pid in locked:
            if pid not in failures:
                known[pid] = CHECKPOINTED
        if failures:
            raise await self._undo_snapshot(failures, known, running)
        return Moved(pids=[pid for pid in pids if pid in known], skipped=skipped)

    async def _undo_snapshot(
        self,
        failures: Mapping[int, BaseException],
        known: dict[int, cuda_driver.ProcessState],
        quiesced: Sequence[int],
    ) -> base.BackendError:
        """Roll the job back to RUNNING after a failed phase; the error to raise."""
        pid, first = self._first(failures)
        where = self._where("snapshot", pid) + self._more(failures)
        hits = {p: e for p, e in failures.items() if isinstance(e, cuda_steps.DeadlineHit)}
        if hits:
            # A call still runs (its thread cannot be stopped): nothing is rolled back.
            hit = next(iter(hits.values()))
            return base.FatalBackendError(
                f"{where}: the {self.deadline.seconds:g} s deadline passed during {hit}; "
                f"its state is unknown; nothing was rolled back; "
                f"{await self._states(known, failures)}"
            )
        ok, report = await self._roll_back([p for p in known if known[p] is not RUNNING])
        await self._resume(quiesced)
        if ok and all(isinstance(e, cuda_driver.LockTimeoutError) for e in failures.values()):
            return base.TransientBackendError(
                f"{where}: {first} (the process kept running); {report}; nothing changed",
                retry_after=1.0,
            )
        if ok and all(
            isinstance(e, (cuda_driver.ProcessNotSupportedError, cuda_driver.LockTimeoutError))
            for e in failures.values()
        ):
            return base.RefusedBackendError(f"{where}: {first}; {report}; nothing changed")
        if not ok:
            now = [f"pid {p} {await self.steps.now(p)}" for p in self._order if p in known]
            return base.FatalBackendError(
                f"{where}: {first}; {report}; the processes are now: {', '.join(now)}"
            )
        return base.FatalBackendError(f"{where}: {first}; {report}; the job is RUNNING again")

    async def _roll_back(self, pids: Sequence[int]) -> tuple[bool, str]:
        """Bring ``pids`` back to RUNNING, all at once; (all ok, report)."""
        ordered = [p for p in self._order if p in pids]
        return await self.steps.rollback(ordered, budget_s=self.rollback_budget_s)

    # ------------------------------------------------------------------ restore

    async def restore(
        self, pids: Sequence[int], *, gpu_pairs: Mapping[str, str] | None = None
    ) -> tuple[Moved, list[int]]:
        """Restore every CHECKPOINTED process, then unlock every one; returns what was
        done and the processes that changed."""
        self._order = list(pids)
        states, skipped = await self._survey("restore", pids)
        for pid, why in skipped.items():
            states.pop(pid, None)
            log.warning("process skipped: %s", why, extra={"job_id": self.job_id, "pid": pid})
        broken = [pid for pid, state in states.items() if state is FAILED]
        if broken:
            raise base.FatalBackendError(
                f"{self._where('restore', broken[0])}: "
                + str(
                    cuda_steps.failed(
                        broken[0], "its device state is lost and the process must be restarted"
                    )
                )
            )
        known = dict(states)
        saved = [pid for pid, state in states.items() if state is CHECKPOINTED]
        refused = ""

        async def bring_back(pid: int) -> None:
            nonlocal refused
            try:
                await self.steps.restore(pid, self.deadline, gpu_pairs=gpu_pairs)
            except (cuda_driver.DriverError, base.BackendUnavailableError) as exc:
                if not gpu_pairs or await self.steps.now(pid) != CHECKPOINTED.value:
                    raise
                # The map was refused: back onto the GPUs the process came from, rather
                # than leaving it checkpointed or retrying the same map for ever.
                refused = refused or str(exc)
                await self.steps.restore(pid, self.deadline, gpu_pairs=None)

        failures = await self._each(saved, bring_back)
        for pid in saved:
            if pid not in failures:
                known[pid] = LOCKED
        if failures:
            raise await self._undo_restore(failures, known, [p for p in saved if p not in failures])
        locked = [pid for pid, state in known.items() if state is LOCKED]
        failures = await self._each(locked, lambda pid: self.steps.unlock(pid, self.deadline))
        for pid in locked:
            if pid not in failures:
                known[pid] = RUNNING
        if failures:
            raise await self._restore_failed(failures, known, changed=locked)
        await self._resume([p for p in pids if p in known])
        moved = Moved(pids=[p for p in pids if p in known], skipped=skipped, map_refused=refused)
        return moved, locked

    async def _undo_restore(
        self,
        failures: Mapping[int, BaseException],
        known: dict[int, cuda_driver.ProcessState],
        restored: Sequence[int],
    ) -> base.BackendError:
        """A restore failed for some processes while others came back (still LOCKED: they
        have not run). Those are checkpointed again, so that the job is SAVED as before
        and the failure changed nothing; where that fails, what is where is reported."""
        if any(isinstance(e, cuda_steps.DeadlineHit) for e in failures.values()):
            return await self._restore_failed(failures, known, changed=restored)
        budget = cuda_steps.Deadline(self.rollback_budget_s)
        undo = await self._each(restored, lambda pid: self.steps.checkpoint(pid, budget))
        for pid in restored:
            if pid not in undo:
                known[pid] = CHECKPOINTED
        if undo:
            return await self._restore_failed(
                {**failures, **undo}, known, changed=[p for p in restored if p in undo]
            )
        return await self._restore_failed(failures, known, changed=[])

    async def _restore_failed(
        self,
        failures: Mapping[int, BaseException],
        known: dict[int, cuda_driver.ProcessState],
        *,
        changed: Sequence[int],
    ) -> base.BackendError:
        pid, first = self._first(failures)
        where = self._where("restore", pid) + self._more(failures)
        if isinstance(first, cuda_steps.DeadlineHit):
            return base.FatalBackendError(
                f"{where}: the {self.deadline.seconds:g} s deadline passed during {first}; "
                f"its state is unknown; {await self._states(known, failures)}"
            )
        if not changed and all(
            not isinstance(e, cuda_steps.DeadlineHit) for e in failures.values()
        ):
            still = [await self.steps.now(p) for p in failures]
            if all(state == CHECKPOINTED.value for state in still):
                return base.TransientBackendError(
                    f"{where}: {first}; nothing changed (all processes are still checkpointed)",
                    retry_after=1.0,
                )
        return base.FatalBackendError(
            f"{where}: {first}; {await self._states(known, failures)}; restored processes stay "
            "locked (none runs beside a missing peer) and nothing is re-checkpointed"
        )

    # ------------------------------------------------------------------ shared

    async def _survey(
        self, kind: Kind, pids: Sequence[int]
    ) -> tuple[dict[int, cuda_driver.ProcessState], dict[int, str]]:
        """Every process's state, read at once; nothing is changed yet."""
        states: dict[int, cuda_driver.ProcessState] = {}
        skipped: dict[int, str] = {}

        async def read(pid: int) -> None:
            states[pid] = await self.steps.state(pid, self.deadline)

        failures = await self._each(pids, read)
        for pid, exc in list(failures.items()):
            if isinstance(exc, cuda_driver.NoCudaContextError):
                skipped[pid] = f"it has no CUDA context ({exc})"
                del failures[pid]
        if failures:
            pid, first = self._first(failures)
            if isinstance(first, base.BackendUnavailableError):
                raise first
            where = self._where(kind, pid) + self._more(failures)
            if isinstance(first, cuda_steps.DeadlineHit):
                raise base.TransientBackendError(
                    f"{where}: reading the state of pid {pid} did not return within "
                    f"{self.steps.state_timeout_s:g} s (the driver may be stuck on that "
                    "process; the agent calls into it again only once that call returned); "
                    "nothing was changed",
                    retry_after=5.0,
                )
            raise base.TransientBackendError(
                f"{where}: {first}; nothing was changed", retry_after=1.0
            )
        return {pid: states[pid] for pid in pids if pid in states}, skipped

    async def _each(
        self, pids: Sequence[int], step: Callable[[int], Awaitable[None]]
    ) -> dict[int, BaseException]:
        """``step(pid)`` for every PID at once (within ``parallel``); the failures."""

        async def one(pid: int) -> BaseException | None:
            try:
                if self._gate is None:
                    await step(pid)
                else:
                    async with self._gate:
                        await step(pid)
            except (
                cuda_driver.DriverError,
                base.BackendUnavailableError,
                cuda_steps.DeadlineHit,
            ) as exc:
                return exc
            return None

        results = await asyncio.gather(*(one(pid) for pid in pids))
        return {pid: exc for pid, exc in zip(pids, results, strict=True) if exc is not None}

    async def _quiesce(self, pids: Sequence[int]) -> None:
        if self.hooks is None or not pids:
            return
        try:
            await self.hooks.quiesce(pids, timeout_s=self.hook_timeout_s)
        except quiesce.HookError as exc:
            await self.hooks.resume(pids, timeout_s=self.hook_timeout_s)
            raise base.RefusedBackendError(
                f"snapshot of job {self.job_id!r}: a workload hook could not quiesce the "
                f"processes before they were locked ({exc}); nothing was changed"
            ) from exc

    async def _resume(self, pids: Sequence[int]) -> None:
        if self.hooks is not None and pids:
            await self.hooks.resume(pids, timeout_s=self.hook_timeout_s)

    def _first(self, failures: Mapping[int, BaseException]) -> tuple[int, BaseException]:
        pid = next(p for p in self._order if p in failures)
        return pid, failures[pid]

    def _where(self, kind: Kind, pid: int) -> str:
        index = self._order.index(pid) if pid in self._order else 0
        return (
            f"{kind} of job {self.job_id!r} failed at pid {pid} ({index + 1} of {len(self._order)})"
        )

    def _more(self, failures: Mapping[int, BaseException]) -> str:
        if len(failures) < 2:
            return ""
        others = [p for p in self._order if p in failures][1:]
        return f" (and at pid(s) {others})"

    async def _states(
        self, known: Mapping[int, cuda_driver.ProcessState], failures: Mapping[int, BaseException]
    ) -> str:
        """What each process is now: as known, the failed ones read (not those whose call
        passed the deadline: it still runs, and nothing may call into the process)."""
        words = []
        for pid in self._order:
            if isinstance(failures.get(pid), cuda_steps.DeadlineHit):
                words.append(f"pid {pid} unknown")
            elif pid in failures:
                words.append(f"pid {pid} {await self.steps.now(pid)}")
            elif pid in known:
                words.append(f"pid {pid} {known[pid].value}")
        return "the processes are now: " + ", ".join(words)
