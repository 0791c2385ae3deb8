"""The ``cuda`` backend: whole-process CUDA state moved by the driver checkpoint API.

Snapshot, for each process of the job, one at a time, in the job's PID order:
read the state; RUNNING → lock (with a timeout) → checkpoint; LOCKED →
checkpoint; CHECKPOINTED → already done; FAILED → error. Restore, same order:
CHECKPOINTED → restore (optionally onto other GPUs) → unlock; LOCKED → unlock;
RUNNING → nothing. Because every step reads the state first, a restore aimed at
a running process is a no-op, never a checkpoint (the reference's ``--toggle``
bug), and retrying a half-done operation finishes it.

Failure rules (the agent branches on the exception class):

* a snapshot that fails after touching some processes is rolled back: every
  process handled so far (and the failing one) is brought back to RUNNING, so
  the job is consistently resident;
* a lock that times out (the process keeps running) then raises
  ``TransientBackendError``: nothing changed, try again later;
* any other snapshot failure raises ``FatalBackendError`` naming the failing
  step and what the rollback did (the job is RUNNING again if it succeeded;
  ResetJob confirms that from the driver);
* a restore that fails before changing anything (the first process is still
  CHECKPOINTED) is transient; later failures are fatal (nothing is re-checkpointed);
* the operation deadline (``operation_timeout_s``) leaves the current process in
  an unknown state: fatal, no rollback, ``recover()`` reads the truth later.

Which processes: explicit PIDs from the request (checked to exist and not to be
registered to another job), else the processes that announced themselves for the
job's group (:mod:`tslice.agent.registration`) together with the PIDs recorded at
the last operation of that (job, group) that are still the same processes. Residency
is per (job, group): a process that named its group belongs to that group; one that
named none belongs to each group of the job, unless the group names the device
indices it uses on this node (``JobContext.devices``, from the topology through
``GrantRequest.devices``), in which case it belongs to the groups whose devices it
holds memory on, as NVML reports. The list is persisted in ``OpResult.state`` so
restore and ``recover()`` work after an agent restart, when no process is visible to
NVML any more.

Bytes are measured with NVML (per-process used memory summed over devices)
before and after each operation; without NVML they are reported as 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from tslice.agent import discovery, registration
from tslice.agent import nvml as nvml_mod
from tslice.agent.backends import (
    base,
    cuda_binary,
    cuda_driver,
    cuda_settings,
    cuda_steps,
    services,
)
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Target:
    pid: int
    start_time: int | None


class CudaBackend(base.Backend):
    """Checkpoints whole CUDA processes through the driver (see the module docstring)."""

    name = "cuda"

    def __init__(
        self,
        *,
        settings: cuda_settings.CudaSettings | None = None,
        driver: cuda_driver.CheckpointDriver | None = None,
        nvml: nvml_mod.Nvml | None = None,
        registry: registration.ProcessRegistry | None = None,
    ) -> None:
        """``driver``/``nvml`` replace the node's real ones (None: chosen on first use)."""
        self.settings = settings if settings is not None else cuda_settings.CudaSettings()
        self.registry = registry if registry is not None else registration.default_registry()
        self._driver = driver
        self._nvml = nvml
        self._nvml_problem: str | None = None
        self._busy: dict[int, str] = {}

    @classmethod
    def create(cls, settings: Mapping[str, Any]) -> Self:
        """Build from the agent config section, with the process-wide registry."""
        return cls(settings=cuda_settings.parse_settings(settings))

    @classmethod
    def create_on_node(
        cls, settings: Mapping[str, Any], node_services: services.NodeServices
    ) -> Self:
        """Build for the agent: processes are looked up in the agent's registry."""
        return cls(
            settings=cuda_settings.parse_settings(settings), registry=node_services.processes
        )

    # ----------------------------------------------------------------- resources

    async def _get_driver(self) -> cuda_driver.CheckpointDriver:
        if self._driver is None:
            # cuInit can take a while on a big node; keep it off the event loop.
            self._driver = await asyncio.to_thread(
                cuda_driver.select_driver,
                preference=self.settings.driver,
                binary=self.settings.binary,
            )
            log.info("cuda checkpoint driver selected", extra={"driver": self._driver.name})
        return self._driver

    async def _steps(self) -> cuda_steps.ProcessSteps:
        driver = await self._get_driver()
        return cuda_steps.ProcessSteps(driver, lock_timeout_ms=self.settings.lock_timeout_ms)

    async def _rollback(self, steps: cuda_steps.ProcessSteps, pids: list[int]) -> tuple[bool, str]:
        return await steps.rollback(pids, budget_s=self.settings.rollback_timeout_s)

    async def _open_nvml(self) -> nvml_mod.Nvml | None:
        """NVML, opened on first use; None where it cannot be (why: ``_nvml_problem``)."""
        if self._nvml is None and self._nvml_problem is None:
            try:
                self._nvml = await asyncio.to_thread(nvml_mod.open_nvml)
            except nvml_mod.NvmlUnavailableError as exc:
                self._nvml_problem = str(exc)
                log.warning(
                    "NVML unavailable: bytes moved by the cuda backend read 0, and processes "
                    "that named no group cannot be matched to a group's devices",
                    extra={"reason": str(exc)},
                )
        return self._nvml

    async def _get_nvml(self) -> nvml_mod.Nvml | None:
        """NVML for measuring bytes and listing accelerators (``measure_bytes``)."""
        if not self.settings.measure_bytes:
            return None
        return await self._open_nvml()

    async def _measure(self, pids: list[int]) -> dict[int, int]:
        """Device bytes per PID now (empty if NVML is unavailable)."""
        nvml = await self._get_nvml()
        if nvml is None:
            return {}
        try:
            procs = await asyncio.to_thread(discovery.gpu_processes, nvml)
        except Exception as exc:  # measuring must never fail an operation
            log.warning("NVML query failed; bytes read 0", exc_info=exc)
            return {}
        totals = discovery.device_bytes_by_pid(procs)
        return {pid: totals.get(pid, 0) for pid in pids}

    # ----------------------------------------------------------------- targets

    def _alive(self, target: _Target) -> bool:
        now = discovery.process_start_time(target.pid, proc_root=self.settings.proc_root)
        if now is None or not discovery.process_exists(
            target.pid, proc_root=self.settings.proc_root
        ):
            return False
        return target.start_time is None or target.start_time == now

    def _target(self, pid: int) -> _Target:
        return _Target(pid, discovery.process_start_time(pid, proc_root=self.settings.proc_root))

    @staticmethod
    def _recorded(job: base.JobContext) -> list[_Target]:
        starts = job.state.get("start_times", {})
        return [_Target(int(pid), starts.get(str(pid))) for pid in job.state.get("pids", [])]

    @staticmethod
    def _explicit(job: base.JobContext) -> list[int]:
        config = job.config
        if config is None or config.WhichOneof("backend") != "cuda":
            return []
        return list(config.cuda.explicit_target.pids)

    def _foreign_owner(self, job: base.JobContext, pids: list[int]) -> str:
        """Why one of ``pids`` may not be driven for ``job`` ('' if none)."""
        for pid in pids:
            owner = self.registry.job_of(pid)
            if owner is not None and owner != job.job_id:
                return (
                    f"pid {pid} registered itself as part of job {owner!r}, not "
                    f"{job.job_id!r}; a process belongs to one job"
                )
        return ""

    def _explicit_pids(self, job: base.JobContext) -> list[int]:
        """The request's PIDs, checked: InvalidBackendConfigError if one is not a process
        here, BackendConfigRefusedError if one belongs to another job."""
        try:
            pids = discovery.validate_pids(self._explicit(job), proc_root=self.settings.proc_root)
        except discovery.InvalidPidError as exc:
            raise base.InvalidBackendConfigError(
                f"CudaBackendConfig.explicit_target.pids for job {job.job_id!r}: {exc}"
            ) from exc
        foreign = self._foreign_owner(job, pids)
        if foreign:
            raise base.BackendConfigRefusedError(foreign)
        return pids

    async def _group_pids(self, job: base.JobContext) -> list[int]:
        """The processes announced for the job that belong to ``job.group`` here (the rule
        of the module docstring), in registration order; no group = all of the job's."""
        announced = [r for r in self.registry.registrations() if r.job_id == job.job_id]
        if not job.group:
            return [r.pid for r in announced]
        unnamed = [r.pid for r in announced if not r.group]
        if job.devices and unnamed:
            on_devices = await self._pids_on_devices(job)
            unnamed = [pid for pid in unnamed if pid in on_devices]
        return [r.pid for r in announced if r.group == job.group or r.pid in unnamed]

    async def _pids_on_devices(self, job: base.JobContext) -> set[int]:
        nvml = await self._open_nvml()
        what = (
            f"matching the processes of job {job.job_id!r} that named no group to the "
            f"devices {list(job.devices)} of group {job.group!r}"
        )
        if nvml is None:
            raise base.RefusedBackendError(
                f"{what} needs NVML, which is unavailable ({self._nvml_problem}): install "
                "tslice[gpu] on the agent, or announce each process with its group "
                "(tslice.workload.process.announce_process(job_id, group=...)); nothing "
                "was changed"
            )
        try:
            procs = await asyncio.to_thread(discovery.gpu_processes, nvml)
        except Exception as exc:  # an NVML hiccup: nothing was touched, try again
            raise base.TransientBackendError(
                f"{what}: the NVML query failed ({exc}); nothing was changed"
            ) from exc
        return discovery.pids_on_devices(procs, job.devices)

    async def _snapshot_targets(self, job: base.JobContext) -> list[_Target]:
        if self._explicit(job):
            try:
                pids = self._explicit_pids(job)
            except base.InvalidBackendConfigError as exc:
                raise base.FatalBackendError(
                    f"cannot snapshot job {job.job_id!r}: {exc}; nothing was changed"
                ) from exc
            return [self._target(pid) for pid in pids]
        targets = [t for t in self._recorded(job) if self._alive(t)]
        known = {t.pid for t in targets}
        targets += [self._target(pid) for pid in await self._group_pids(job) if pid not in known]
        if not targets:
            in_group = f" in group {job.group!r}" if job.group else ""
            raise base.FatalBackendError(
                f"no processes are known for job {job.job_id!r}{in_group} on this node: pass "
                "CudaBackendConfig.explicit_target.pids, or call "
                "tslice.workload.process.announce_process(job_id) in each GPU process of "
                "the job; nothing was changed"
            )
        return targets

    def _restore_targets(self, job: base.JobContext) -> list[_Target]:
        targets = self._recorded(job)
        known = {t.pid for t in targets}
        for pid in self._explicit(job):
            if pid > 0 and pid not in known:
                targets.append(self._target(pid))
                known.add(pid)
        if not targets:
            raise base.FatalBackendError(
                f"no processes were recorded for job {job.job_id!r}: it was not snapshotted "
                "by the cuda backend on this node; pass CudaBackendConfig.explicit_target.pids"
            )
        gone = [t.pid for t in targets if not self._alive(t)]
        if gone:
            raise base.FatalBackendError(
                f"cannot restore job {job.job_id!r}: process(es) {gone} have exited, so their "
                "checkpointed device state is lost; nothing was restored. Restart the job "
                "(or ResetJob after killing its remaining processes)"
            )
        return targets

    @contextlib.asynccontextmanager
    async def _claim(self, job_id: str, pids: list[int]) -> AsyncIterator[None]:
        """Never drive one process from two operations at once."""
        clash = {pid: self._busy[pid] for pid in pids if pid in self._busy}
        if clash:
            raise base.TransientBackendError(
                f"process(es) {sorted(clash)} of job {job_id!r} are being checkpointed or "
                f"restored by an operation of job(s) {sorted(set(clash.values()))}"
            )
        self._busy.update(dict.fromkeys(pids, job_id))
        try:
            yield
        finally:
            for pid in pids:
                self._busy.pop(pid, None)

    def _state(
        self,
        targets: list[_Target],
        driver: cuda_driver.CheckpointDriver,
        saved_bytes: Mapping[int, int],
    ) -> dict[str, Any]:
        return {
            "pids": [t.pid for t in targets],
            "start_times": {str(t.pid): t.start_time for t in targets},
            "saved_bytes": {str(pid): n for pid, n in saved_bytes.items()},
            "driver": driver.name,
        }

    # ----------------------------------------------------------------- contract

    async def validate(self, job: base.JobContext) -> None:
        """Refuse explicit PIDs that are not processes on this node, or belong to another job."""
        self._explicit_pids(job)

    async def snapshot(self, job: base.JobContext, mode: int) -> base.OpResult:
        """Checkpoint every process of the job (DISCARD is treated as OFFLOAD: the
        driver always keeps the state in host memory)."""
        steps = await self._steps()
        targets = await self._snapshot_targets(job)
        pids = [t.pid for t in targets]
        async with self._claim(job.job_id, pids):
            deadline = cuda_steps.Deadline(self.settings.operation_timeout_s)
            before = await self._measure(pids)
            done: list[int] = []
            touched: list[int] = []
            for index, pid in enumerate(pids):
                where = _where("snapshot", job, pid, index, len(pids))
                try:
                    outcome = await steps.save(pid, deadline, touched=touched)
                except cuda_steps.DeadlineHit as hit:
                    raise _deadline_passed(
                        where, deadline, hit, "nothing was rolled back"
                    ) from None
                except base.BackendUnavailableError as exc:
                    if not touched:
                        raise  # failed reading the first state: nothing changed
                    _, report = await self._rollback(steps, [*done, pid])
                    raise base.FatalBackendError(f"{where}: {exc}; {report}") from exc
                except cuda_driver.DriverError as exc:
                    ok, report = await self._rollback(steps, [*done, pid])
                    if ok and isinstance(exc, cuda_driver.LockTimeoutError):
                        raise base.TransientBackendError(
                            f"{where}: {exc} (the process kept running); {report}; nothing changed",
                            retry_after=1.0,
                        ) from exc
                    suffix = (
                        "; the job is RUNNING again" if ok else "; the job is partly checkpointed"
                    )
                    raise base.FatalBackendError(f"{where}: {exc}; {report}{suffix}") from exc
                log.info(
                    "process checkpointed",
                    extra={"job_id": job.job_id, "pid": pid, "outcome": outcome},
                )
                done.append(pid)
            after = await self._measure(pids)
        previous = {int(k): int(v) for k, v in job.state.get("saved_bytes", {}).items()}
        saved = {pid: before.get(pid, 0) or previous.get(pid, 0) for pid in pids}
        freed = max(0, sum(before.values()) - sum(after.values()))
        return base.OpResult(
            device_bytes=freed,
            host_bytes=sum(saved.values()),
            state=self._state(targets, steps.driver, saved),
        )

    async def restore(self, job: base.JobContext) -> base.OpResult:
        """Restore and unlock every process of the job (no-op for running ones)."""
        steps = await self._steps()
        targets = self._restore_targets(job)
        pids = [t.pid for t in targets]
        pairs = dict(self.settings.device_map) or None
        async with self._claim(job.job_id, pids):
            deadline = cuda_steps.Deadline(self.settings.operation_timeout_s)
            before = await self._measure(pids)
            changed: list[int] = []
            for index, pid in enumerate(pids):
                where = _where("restore", job, pid, index, len(pids))
                try:
                    outcome, did_change = await steps.resume(pid, deadline, gpu_pairs=pairs)
                except cuda_steps.DeadlineHit as hit:
                    so_far = f"restored so far: {changed or 'none'}"
                    raise _deadline_passed(where, deadline, hit, so_far) from None
                except base.BackendUnavailableError:
                    if not changed:
                        raise
                    raise base.FatalBackendError(
                        f"{where}: the driver became unavailable; restored so far: {changed}"
                    ) from None
                except cuda_driver.DriverError as exc:
                    if not changed and await steps.still(pid, cuda_steps.CHECKPOINTED):
                        raise base.TransientBackendError(
                            f"{where}: {exc}; nothing changed (all processes are still "
                            "checkpointed)",
                            retry_after=1.0,
                        ) from exc
                    raise base.FatalBackendError(
                        f"{where}: {exc}; restored so far: {changed or 'none'}; nothing is "
                        "re-checkpointed"
                    ) from exc
                log.info(
                    "process restored", extra={"job_id": job.job_id, "pid": pid, "outcome": outcome}
                )
                if did_change:
                    changed.append(pid)
            after = await self._measure(pids)
        landed = max(0, sum(after.values()) - sum(before.values()))
        return base.OpResult(
            device_bytes=landed, host_bytes=0, state=self._state(targets, steps.driver, {})
        )

    async def recover(self, job: base.JobContext) -> pb.JobState | None:
        """Read every recorded process's state back from the driver.

        All RUNNING (or LOCKED, whose memory is still on the GPU) → RUNNING, LOCKED
        ones unlocked; all CHECKPOINTED → SAVED; a mix → the resident ones are
        checkpointed too → SAVED (with ``repair_on_recover``, else FAULTED); all
        processes gone → IDLE; some gone or FAILED → FAULTED; nothing recorded or
        no driver → None (the agent keeps its persisted state).

        Known processes: those recorded by the last successful operation, else (a
        job whose first snapshot failed) the request's explicit PIDs and the
        processes registered for the job's group (None if they cannot be told).
        """
        targets = self._recorded(job)
        if not targets:
            try:
                announced = await self._group_pids(job)
            except base.BackendError as exc:
                log.warning(
                    "cannot recover job: its processes are unknown",
                    extra={"job_id": job.job_id, "group_id": job.group, "reason": str(exc)},
                )
                return None
            pids = dict.fromkeys([*self._explicit(job), *announced])
            targets = [self._target(pid) for pid in pids if pid > 0]
        if not targets:
            return None
        try:
            steps = await self._steps()
        except base.BackendUnavailableError as exc:
            log.warning(
                "cannot recover job: no checkpoint driver",
                extra={"job_id": job.job_id, "reason": str(exc)},
            )
            return None
        alive = [t for t in targets if self._alive(t)]
        if not alive:
            return pb.JOB_STATE_IDLE
        if len(alive) < len(targets):
            log.warning(
                "some processes of the job have exited",
                extra={"job_id": job.job_id, "gone": [t.pid for t in targets if t not in alive]},
            )
            return pb.JOB_STATE_FAULTED
        deadline = cuda_steps.Deadline(self.settings.operation_timeout_s)
        states: dict[int, cuda_driver.ProcessState] = {}
        try:
            for t in targets:
                states[t.pid] = await steps.state(t.pid, deadline)
        except (
            cuda_driver.DriverError,
            base.BackendUnavailableError,
            cuda_steps.DeadlineHit,
        ) as exc:
            log.warning(
                "cannot read process states", extra={"job_id": job.job_id, "reason": str(exc)}
            )
            return pb.JOB_STATE_FAULTED
        values = set(states.values())
        if cuda_steps.FAILED in values:
            return pb.JOB_STATE_FAULTED
        if values == {cuda_steps.CHECKPOINTED}:
            return pb.JOB_STATE_SAVED
        if values == {cuda_steps.RUNNING}:
            return pb.JOB_STATE_RUNNING
        if not self.settings.repair_on_recover:
            return pb.JOB_STATE_FAULTED
        if cuda_steps.CHECKPOINTED not in values:
            locked = [p for p, s in states.items() if s is cuda_steps.LOCKED]
            return await self._repair(job, steps, locked, to_saved=False)
        resident = [p for p, s in states.items() if s is not cuda_steps.CHECKPOINTED]
        return await self._repair(job, steps, resident, to_saved=True)

    async def _repair(
        self,
        job: base.JobContext,
        steps: cuda_steps.ProcessSteps,
        pids: list[int],
        *,
        to_saved: bool,
    ) -> pb.JobState:
        deadline = cuda_steps.Deadline(self.settings.operation_timeout_s)
        try:
            async with self._claim(job.job_id, pids):
                for pid in pids:
                    if to_saved:
                        await steps.save(pid, deadline)
                    else:
                        await steps.resume(pid, deadline, gpu_pairs=None)
        except (cuda_driver.DriverError, base.BackendError, cuda_steps.DeadlineHit) as exc:
            log.warning("could not repair job", extra={"job_id": job.job_id, "reason": str(exc)})
            return pb.JOB_STATE_FAULTED
        log.info(
            "job repaired after restart",
            extra={"job_id": job.job_id, "pids": pids, "now": "saved" if to_saved else "running"},
        )
        return pb.JOB_STATE_SAVED if to_saved else pb.JOB_STATE_RUNNING

    async def forget(self, job: base.JobContext) -> None:
        self.registry.forget(job.job_id, job.group)

    async def check_health(self) -> None:
        """Healthy = a checkpoint driver works and at least one GPU is visible."""
        driver = await self._get_driver()
        if isinstance(driver, cuda_binary.BinaryDriver):
            await driver.check_tool()
        count = await driver.device_count()
        if count is None:
            nvml = await self._get_nvml()
            if nvml is not None:
                count = await asyncio.to_thread(nvml.device_count)
        if count == 0:
            raise base.BackendUnavailableError(
                "no NVIDIA GPU is visible on this node (is the agent's container given the "
                "GPUs, e.g. NVIDIA_VISIBLE_DEVICES=all?)"
            )

    async def accelerators(self) -> list[base.Accelerator]:
        nvml = await self._get_nvml()
        if nvml is None:
            return []

        def read() -> list[base.Accelerator]:
            found = []
            for index in range(nvml.device_count()):
                used, total = nvml.memory(index)
                found.append(base.Accelerator(nvml.device_uuid(index), used, total))
            return found

        try:
            return await asyncio.to_thread(read)
        except Exception as exc:  # Status must not fail because NVML hiccuped
            log.warning("NVML query failed", exc_info=exc)
            return []

    async def close(self) -> None:
        if self._driver is not None:
            await self._driver.close()
        if self._nvml is not None:
            await asyncio.to_thread(self._nvml.close)


def _where(kind: str, job: base.JobContext, pid: int, index: int, count: int) -> str:
    return f"{kind} of job {job.job_id!r} failed at pid {pid} ({index + 1} of {count})"


def _deadline_passed(
    where: str, deadline: cuda_steps.Deadline, hit: cuda_steps.DeadlineHit, consequence: str
) -> base.FatalBackendError:
    return base.FatalBackendError(
        f"{where}: the {deadline.seconds:g} s deadline passed during {hit}; its state is "
        f"unknown; {consequence}"
    )
