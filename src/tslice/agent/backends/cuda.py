"""The ``cuda`` backend: whole-process CUDA state moved by the driver checkpoint API.

A job's processes on this node move together (:mod:`tslice.agent.backends.cuda_moves`):
every process is locked (each with a timeout), then every process is checkpointed,
one task each over its own GPU's link; a restore brings every process back, then
unlocks every one. Every step reads the state first and does only what is left, so a
restore aimed at a running process is a no-op, never a checkpoint (the reference's
``--toggle`` bug), and retrying a half-done operation finishes it. The failure rules
(all or nothing: a failed snapshot is rolled back to RUNNING; lock timeouts are
transient, per-process refusals refused, the rest fatal; a restore that changed
nothing is transient) are in that module's docstring.

Which processes: :mod:`tslice.agent.backends.cuda_targets`. Residency is per (job,
group): a process that named its group belongs to that group; one that named none
belongs to each group of the job, unless the group names the device indices it uses
on this node (``JobContext.devices``), in which case it belongs to the groups whose
devices it holds memory on, as NVML reports. The list is persisted in
``OpResult.state`` so restore and ``recover()`` work after an agent restart. Processes
with no CUDA context, or (NVML says) no device memory, are skipped with a warning.

Bytes are measured with NVML (per-process used memory summed over devices) before and
after each operation; without NVML they are reported as 0. After a snapshot, NVML must
show the processes' memory released (:mod:`tslice.agent.backends.cuda_verify`).

A process is never driven by two operations at once, nor called into while a driver
call of an earlier operation (one whose deadline passed) still runs on its thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from tslice.agent import discovery
from tslice.agent import nvml as nvml_mod
from tslice.agent.backends import (
    base,
    cuda_binary,
    cuda_driver,
    cuda_moves,
    cuda_select,
    cuda_settings,
    cuda_steps,
    cuda_targets,
    cuda_verify,
    services,
)
from tslice.agent.channel import registration
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger(__name__)


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
        self._driver_checked = False
        self._nvml = nvml
        self._nvml_problem: str | None = None
        self._busy: dict[int, str] = {}
        self._said_unknown: set[int] = set()
        #: Why the driver refused ``device_map`` at a restore: it is not tried again.
        self.map_refused = ""
        self.targets = cuda_targets.TargetFinder(
            settings=self.settings,
            registry=self.registry,
            open_nvml=self._open_nvml,
            nvml_problem=lambda: self._nvml_problem,
        )

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
                cuda_select.select_driver,
                preference=self.settings.driver,
                binary=self.settings.binary,
            )
            log.info("cuda checkpoint driver selected", extra={"driver": self._driver.name})
        if not self._driver_checked:
            if self.settings.device_map:
                await self._check_device_map(self._driver)
            self._driver_checked = True
        return self._driver

    async def _check_device_map(self, driver: cuda_driver.CheckpointDriver) -> None:
        """A configured map needs the driver's support and must be a permutation of the
        GPUs NVML lists (the driver wants every checkpointed GPU in it)."""
        await driver.check_device_map()
        nvml = await self._open_nvml()
        if nvml is None:
            raise base.BackendUnavailableError(
                "device_map is configured, but NVML is unavailable to check that it maps "
                f"every GPU of this node ({self._nvml_problem}); install tslice[gpu]"
            )
        found = await asyncio.to_thread(
            lambda: {nvml.device_uuid(i) for i in range(nvml.device_count())}
        )
        uuids = {cuda_driver.normalize_gpu_uuid(u) for u in found}
        mapped = set(self.settings.device_map)
        if mapped != uuids or set(self.settings.device_map.values()) != uuids:
            raise base.BackendUnavailableError(
                "device_map must map every GPU of this node to one of them (a permutation "
                f"of the GPUs NVML lists: {sorted(uuids)}); it maps {sorted(mapped)} to "
                f"{sorted(self.settings.device_map.values())}. The driver restores only "
                "with every checkpointed GPU in the map"
            )

    async def _steps(self) -> cuda_steps.ProcessSteps:
        driver = await self._get_driver()
        return cuda_steps.ProcessSteps(
            driver,
            lock_timeout_ms=self.settings.lock_timeout_ms,
            state_timeout_s=self.settings.state_timeout_s,
        )

    def _moves(self, steps: cuda_steps.ProcessSteps, job: base.JobContext) -> cuda_moves.JobMoves:
        return cuda_moves.JobMoves(
            steps,
            job_id=job.job_id,
            deadline=cuda_steps.Deadline(self.settings.operation_timeout_s),
            rollback_budget_s=self.settings.rollback_timeout_s,
            parallel=self.settings.parallel_processes,
            hooks=self.registry.hooks,
            hook_timeout_s=self.settings.hook_timeout_s,
        )

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

    async def _read(self, pids: list[int]) -> cuda_verify.Reading:
        """What NVML says the processes hold now (never raises: measuring must not fail
        an operation, the reading says why it is missing)."""
        nvml = await self._get_nvml()
        if nvml is None:
            why = self._nvml_problem or "measure_bytes is off"
            return cuda_verify.unread(why, pids)
        try:
            reading = await asyncio.to_thread(cuda_verify.read, nvml, pids)
        except Exception as exc:
            log.warning("NVML query failed; bytes read 0", exc_info=exc)
            return cuda_verify.unread(f"the NVML query failed ({exc})", pids)
        if reading.unknown - self._said_unknown:
            self._said_unknown |= reading.unknown
            log.warning(
                "NVML cannot tell the device memory of processes %s (N/A: a MIG-enabled "
                "GPU, or vGPU): bytes moved read 0 for them, and that they released "
                "their memory cannot be checked per process",
                sorted(reading.unknown),
            )
        return reading

    @contextlib.asynccontextmanager
    async def _claim(
        self, job_id: str, pids: list[int], driver: cuda_driver.CheckpointDriver
    ) -> AsyncIterator[None]:
        """Never drive one process from two operations at once, nor call into one whose
        earlier driver call (its caller's deadline passed) has not returned yet."""
        clash = {pid: self._busy[pid] for pid in pids if pid in self._busy}
        if clash:
            raise base.TransientBackendError(
                f"process(es) {sorted(clash)} of job {job_id!r} are being checkpointed or "
                f"restored by an operation of job(s) {sorted(set(clash.values()))}"
            )
        stuck = {pid: op for pid, op in driver.calls_in_flight().items() if pid in pids}
        if stuck:
            calls = ", ".join(f"{op} of pid {pid}" for pid, op in sorted(stuck.items()))
            raise base.TransientBackendError(
                f"job {job_id!r}: a driver call of an earlier operation has not returned yet "
                f"({calls}; its deadline passed); the agent calls into those processes again "
                "only once it returns",
                retry_after=5.0,
            )
        self._busy.update(dict.fromkeys(pids, job_id))
        try:
            yield
        finally:
            for pid in pids:
                self._busy.pop(pid, None)

    def _state(
        self,
        targets: list[cuda_targets.Target],
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
        self.targets.explicit_pids(job)

    async def snapshot(self, job: base.JobContext, mode: int) -> base.OpResult:
        """Checkpoint every process of the job (DISCARD is treated as OFFLOAD: the
        driver always keeps the state in host memory)."""
        steps = await self._steps()
        targets = await self.targets.for_snapshot(job)
        pids = [t.pid for t in targets]
        self._refuse_unquiesced_nccl(job, pids)
        async with self._claim(job.job_id, pids, steps.driver):
            before = await self._read(pids)
            moved = await self._moves(steps, job).snapshot(pids, idle=before.idle)
            after = await self._read(pids)
        kept = [t for t in targets if t.pid in moved.pids]
        held = cuda_verify.still_held(
            after, moved.pids, tolerance=self.settings.released_tolerance_bytes
        )
        if held:
            shown = ", ".join(f"pid {pid} {n} bytes" for pid, n in held.items())
            raise base.FatalBackendError(
                f"snapshot of job {job.job_id!r}: the driver checkpointed its processes, but "
                f"NVML still shows {sum(held.values())} bytes of theirs on the device "
                f"({shown}; tolerance {self.settings.released_tolerance_bytes} bytes): the "
                "memory is not free for the next job, so the job is not SAVED"
            )
        previous = {int(k): int(v) for k, v in job.state.get("saved_bytes", {}).items()}
        saved = {t.pid: before.bytes.get(t.pid, 0) or previous.get(t.pid, 0) for t in kept}
        state = self._state(kept, steps.driver, saved)
        state["released"] = cuda_verify.verification(after, moved.pids)
        if moved.skipped:
            state["skipped"] = {str(pid): why for pid, why in moved.skipped.items()}
        return base.OpResult(
            device_bytes=max(0, before.total() - after.total()),
            host_bytes=sum(saved.values()),
            state=state,
        )

    def _refuse_unquiesced_nccl(self, job: base.JobContext, pids: list[int]) -> None:
        """Refuse, before anything is touched, ranks that would hang once one is locked."""
        if not self.settings.nccl_guard:
            return
        root = self.settings.proc_root
        ranks = [pid for pid in pids if discovery.holds_nccl_peers(pid, proc_root=root)]
        bare = [pid for pid in pids if not self.registry.hooks.has(pid)]
        if ranks and bare:
            raise base.RefusedBackendError(
                f"job {job.job_id!r}: process(es) {ranks} hold NCCL communicators with peers "
                "on this node (they map /dev/shm/nccl-* segments), and process(es) "
                f"{bare} announced no quiesce hook. Locked from the outside, one rank makes "
                "the others' collectives hang (cuda-checkpoint #30, #45). Suspend the "
                "communicators first: announce every process with hooks "
                "(tslice.workload.process.announce_process(job_id, quiesce=..., resume=...): "
                "ncclCommSuspend/ncclCommResume from NCCL 2.29.7, or parking each rank at "
                "the end of a step), or move the job with the app-channel backend. Nothing "
                "was changed (the cuda backend's nccl_guard: false turns this check off)"
            )

    async def host_bytes_needed(self, job: base.JobContext) -> int | None:
        """What the job's processes hold on the device now, per NVML (the driver copies it
        all to host memory); None where NVML cannot tell."""
        try:
            targets = await self.targets.for_snapshot(job)
        except base.BackendError:
            return None
        reading = await self._read([t.pid for t in targets])
        if reading.missing or reading.unknown:
            return None
        return reading.total()

    async def restore(self, job: base.JobContext) -> base.OpResult:
        """Restore and unlock every process of the job (no-op for running ones)."""
        steps = await self._steps()
        targets = self.targets.for_restore(job)
        pids = [t.pid for t in targets]
        pairs = dict(self.settings.device_map) if not self.map_refused else {}
        async with self._claim(job.job_id, pids, steps.driver):
            before = await self._read(pids)
            moved, _changed = await self._moves(steps, job).restore(pids, gpu_pairs=pairs or None)
            after = await self._read(pids)
        if moved.map_refused:
            self.map_refused = moved.map_refused
            log.error(
                "the driver refused device_map; the job was restored onto the GPUs it came "
                "from, and the map is not used again until the agent restarts",
                extra={"job_id": job.job_id, "reason": moved.map_refused},
            )
        landed = max(0, after.total() - before.total())
        state = self._state(targets, steps.driver, {})
        if moved.map_refused:
            state["device_map_refused"] = moved.map_refused
        return base.OpResult(device_bytes=landed, host_bytes=0, state=state)

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
        targets = self.targets.recorded(job)
        if not targets:
            try:
                announced = await self.targets.group_pids(job)
            except base.BackendError as exc:
                log.warning(
                    "cannot recover job: its processes are unknown",
                    extra={"job_id": job.job_id, "group_id": job.group, "reason": str(exc)},
                )
                return None
            pids = dict.fromkeys([*self.targets.explicit(job), *announced])
            targets = [self.targets.target(pid) for pid in pids if pid > 0]
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
        alive = [t for t in targets if self.targets.alive(t)]
        if not alive:
            return pb.JOB_STATE_IDLE
        if len(alive) < len(targets):
            log.warning(
                "some processes of the job have exited",
                extra={"job_id": job.job_id, "gone": [t.pid for t in targets if t not in alive]},
            )
            return pb.JOB_STATE_FAULTED
        stuck = {t.pid: op for t in targets if (op := steps.driver.calls_in_flight().get(t.pid))}
        if stuck:
            log.warning(
                "cannot recover job: a driver call of an earlier operation has not returned",
                extra={"job_id": job.job_id, "calls": stuck},
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
            async with self._claim(job.job_id, pids, steps.driver):
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
