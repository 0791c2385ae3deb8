"""Which processes a cuda-backend operation drives (the rule of :mod:`tslice.agent.backends.cuda`).

Explicit PIDs from the request (checked to exist and not to belong to another job),
else the processes that announced themselves for the job's group together with the
PIDs recorded at the last operation of that (job, group) that are still the same
processes (PID plus start time).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from tslice.agent import discovery
from tslice.agent import nvml as nvml_mod
from tslice.agent.backends import base, cuda_settings
from tslice.agent.channel import registration


@dataclasses.dataclass(frozen=True)
class Target:
    pid: int
    start_time: int | None


class TargetFinder:
    """Finds a job's processes on this node."""

    def __init__(
        self,
        *,
        settings: cuda_settings.CudaSettings,
        registry: registration.ProcessRegistry,
        open_nvml: Callable[[], Awaitable[nvml_mod.Nvml | None]],
        nvml_problem: Callable[[], str | None],
    ) -> None:
        self.settings = settings
        self.registry = registry
        self._open_nvml = open_nvml
        self._nvml_problem = nvml_problem

    def alive(self, target: Target) -> bool:
        root = self.settings.proc_root
        now = discovery.process_start_time(target.pid, proc_root=root)
        if now is None or not discovery.process_exists(target.pid, proc_root=root):
            return False
        return target.start_time is None or target.start_time == now

    def target(self, pid: int) -> Target:
        return Target(pid, discovery.process_start_time(pid, proc_root=self.settings.proc_root))

    @staticmethod
    def recorded(job: base.JobContext) -> list[Target]:
        starts = job.state.get("start_times", {})
        return [Target(int(pid), starts.get(str(pid))) for pid in job.state.get("pids", [])]

    @staticmethod
    def explicit(job: base.JobContext) -> list[int]:
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

    def explicit_pids(self, job: base.JobContext) -> list[int]:
        """The request's PIDs, checked: InvalidBackendConfigError if one is not a process
        here, BackendConfigRefusedError if one belongs to another job."""
        try:
            pids = discovery.validate_pids(self.explicit(job), proc_root=self.settings.proc_root)
        except discovery.InvalidPidError as exc:
            raise base.InvalidBackendConfigError(
                f"CudaBackendConfig.explicit_target.pids for job {job.job_id!r}: {exc}"
            ) from exc
        foreign = self._foreign_owner(job, pids)
        if foreign:
            raise base.BackendConfigRefusedError(foreign)
        return pids

    async def group_pids(self, job: base.JobContext) -> list[int]:
        """The processes announced for the job that belong to ``job.group`` here, in
        registration order; no group = all of the job's."""
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
                f"{what} needs NVML, which is unavailable ({self._nvml_problem()}): install "
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

    async def for_snapshot(self, job: base.JobContext) -> list[Target]:
        if self.explicit(job):
            try:
                pids = self.explicit_pids(job)
            except base.InvalidBackendConfigError as exc:
                raise base.FatalBackendError(
                    f"cannot snapshot job {job.job_id!r}: {exc}; nothing was changed"
                ) from exc
            return [self.target(pid) for pid in pids]
        targets = [t for t in self.recorded(job) if self.alive(t)]
        known = {t.pid for t in targets}
        targets += [self.target(pid) for pid in await self.group_pids(job) if pid not in known]
        if not targets:
            in_group = f" in group {job.group!r}" if job.group else ""
            raise base.FatalBackendError(
                f"no processes are known for job {job.job_id!r}{in_group} on this node: pass "
                "CudaBackendConfig.explicit_target.pids, or call "
                "tslice.workload.process.announce_process(job_id) in each GPU process of "
                "the job; nothing was changed"
            )
        return targets

    def for_restore(self, job: base.JobContext) -> list[Target]:
        targets = self.recorded(job)
        known = {t.pid for t in targets}
        for pid in self.explicit(job):
            if pid > 0 and pid not in known:
                targets.append(self.target(pid))
                known.add(pid)
        if not targets and "pids" in job.state:
            return []  # the snapshot found nothing to move (no process held device state)
        if not targets:
            raise base.FatalBackendError(
                f"no processes were recorded for job {job.job_id!r}: it was not snapshotted "
                "by the cuda backend on this node; pass CudaBackendConfig.explicit_target.pids"
            )
        gone = [t.pid for t in targets if not self.alive(t)]
        if gone:
            raise base.FatalBackendError(
                f"cannot restore job {job.job_id!r}: process(es) {gone} have exited, so their "
                "checkpointed device state is lost; nothing was restored. Restart the job "
                "(or ResetJob after killing its remaining processes)"
            )
        return targets
