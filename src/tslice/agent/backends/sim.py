"""The ``sim`` backend: jobs occupy bytes of simulated devices (``simdevice``).

A snapshot takes ``bytes_per_device / bandwidth + latency`` seconds, a restore
``bytes_per_device / restore_bandwidth + latency`` (``restore_bandwidth`` unset = the
snapshot rate; devices copy in parallel, each over its own link; see
:class:`tslice.agent.backends.simdevice.CopySpeed`). A restore checks capacity first and lands
its bytes at the *start* of the copy, so two jobs of a group that are ever resident
together overcommit the device and fail loudly. Fault injection (failure probability,
extra latency, hangs) lets tests drive every failure path of the agent.

The footprint of a job, per device: ``SimBackendConfig.footprint_bytes`` if given, else
the footprint the orchestrator sent with the grant, else ``default_footprint_bytes``.
Byte counts reported to the agent are node totals (footprint x devices).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tslice.agent.backends import base
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

    from tslice.agent.backends import services


class SimBackend(base.Backend):
    """Simulated node: ``devices`` devices of ``capacity_bytes`` each.

    ``state_dir`` (injected by the agent) holds the device state and the journal so that
    the simulated memory outlives an agent crash; ``None`` keeps it in memory.
    """

    name: ClassVar[str] = "sim"

    def __init__(
        self,
        *,
        node: str = "sim-node",
        state_dir: str | Path | None = None,
        devices: int = 1,
        capacity_bytes: int = device.DEFAULT_CAPACITY_BYTES,
        bandwidth_bytes_per_s: int = device.DEFAULT_BANDWIDTH_BYTES_PER_S,
        restore_bandwidth_bytes_per_s: int | None = None,
        latency_s: float = device.DEFAULT_LATENCY_S,
        default_footprint_bytes: int | None = None,
        fail_probability: float = 0.0,
        extra_latency_s: float = 0.0,
        hang_probability: float = 0.0,
        seed: int | None = None,
    ) -> None:
        # Validates both rates and the latency.
        self.speed = device.CopySpeed(
            bandwidth_bytes_per_s=bandwidth_bytes_per_s,
            restore_bandwidth_bytes_per_s=restore_bandwidth_bytes_per_s,
            latency_s=latency_s,
        )
        if extra_latency_s < 0:
            raise ValueError(f"extra_latency_s must be >= 0 (got {extra_latency_s})")
        probabilities = {"fail_probability": fail_probability, "hang_probability": hang_probability}
        for label, p in probabilities.items():
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"{label} must be between 0 and 1 (got {p})")
        self.node = device.SimNode(
            node=node,
            devices=devices,
            capacity_bytes=capacity_bytes,
            state_dir=Path(state_dir) if state_dir is not None else None,
        )
        if default_footprint_bytes is None:
            default_footprint_bytes = int(capacity_bytes * device.DEFAULT_FOOTPRINT_SHARE)
        if not 0 < default_footprint_bytes <= capacity_bytes:
            raise ValueError(
                f"default_footprint_bytes must be between 1 and the capacity {capacity_bytes} "
                f"(got {default_footprint_bytes})"
            )
        self.default_footprint_bytes = default_footprint_bytes
        self.fail_probability = fail_probability
        self.extra_latency_s = extra_latency_s
        self.hang_probability = hang_probability
        self._random = random.Random(seed)

    @classmethod
    def create_on_node(
        cls, settings: Mapping[str, Any], node_services: services.NodeServices
    ) -> Self:
        """On an agent, the devices are the node's and persist in its state directory."""
        return cls.create(
            {"node": node_services.node, "state_dir": node_services.state_dir, **settings}
        )

    # ---- helpers --------------------------------------------------------------------

    def footprint(self, job: base.JobContext) -> int:
        """Device bytes per device the job occupies when resident."""
        config = job.config
        if (
            config is not None
            and config.WhichOneof("backend") == "sim"
            and config.sim.footprint_bytes
        ):
            return int(config.sim.footprint_bytes)
        if job.footprint_bytes > 0:
            return job.footprint_bytes
        return self.default_footprint_bytes

    def _total(self, bytes_per_device: int) -> int:
        return bytes_per_device * self.node.devices

    async def _copy(
        self, *, job: base.JobContext, bytes_per_device: int, what: device.Direction
    ) -> None:
        """Take the time the copy takes in direction ``what``, then apply injected faults."""
        # Roll both dice up front so that a seeded run is reproducible whatever the timing.
        hang = self._random.random() < self.hang_probability
        fail = self._random.random() < self.fail_probability
        await asyncio.sleep(
            self.speed.seconds(bytes_per_device=bytes_per_device, direction=what)
            + self.extra_latency_s
        )
        if hang:
            self.node.record_fault(job=job.job_id, group=job.group, kind="hang", direction=what)
            # Stuck like a wedged driver call: only the agent's operation deadline ends it.
            await asyncio.Event().wait()
        if fail:
            self.node.record_fault(job=job.job_id, group=job.group, kind="fail", direction=what)
            raise base.FatalBackendError(
                f"injected failure: {what} of job {job.job_id} on sim node {self.node.node} "
                f"failed (fail_probability={self.fail_probability})"
            )

    # ---- backend contract --------------------------------------------------------------

    async def validate(self, job: base.JobContext) -> None:
        footprint = self.footprint(job)
        reason = self.node.never_fits(job=job.job_id, group=job.group, bytes_per_device=footprint)
        if reason:
            raise base.NeverFitsError(reason)

    async def fits(self, job: base.JobContext) -> bool:
        saved = self.node.saved(job=job.job_id, group=job.group)
        footprint = saved.footprint_bytes if saved is not None else self.footprint(job)
        try:
            self.node.check_fits(job=job.job_id, group=job.group, bytes_per_device=footprint)
        except device.CapacityError:
            return False
        return True

    async def activate(self, job: base.JobContext) -> base.OpResult:
        key = {"job": job.job_id, "group": job.group}
        held = self.node.resident_bytes(**key)
        if held is not None:
            return base.OpResult(device_bytes=self._total(held))
        if self.node.saved(**key) is not None:
            raise base.FatalBackendError(
                f"job {job.job_id} has saved state for group {job.group} on sim node "
                f"{self.node.node}; restore it instead of granting it as new"
            )
        footprint = self.footprint(job)
        try:
            self.node.allocate(**key, bytes_per_device=footprint, action="activation")
        except device.CapacityError as err:
            # Nothing landed: the job keeps its state and the grant may be retried.
            raise base.RefusedBackendError(str(err)) from err
        return base.OpResult(device_bytes=self._total(footprint), state={"footprint": footprint})

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        key = {"job": job.job_id, "group": job.group}
        footprint = self.node.resident_bytes(**key)
        if footprint is None:
            raise base.FatalBackendError(
                f"job {job.job_id} holds no memory for group {job.group} on sim node "
                f"{self.node.node}, so there is nothing to snapshot; grant the job first"
            )
        # A failure or cancellation before park() leaves the allocation: nothing moved.
        await self._copy(job=job, bytes_per_device=footprint, what="snapshot")
        host_bytes = 0 if mode == pb.SUSPEND_MODE_DISCARD else self._total(footprint)
        self.node.park(
            **key,
            saved=device.SavedState(footprint_bytes=footprint, host_bytes=host_bytes),
        )
        return base.OpResult(
            device_bytes=self._total(footprint),
            host_bytes=host_bytes,
            state={"footprint": footprint},
        )

    async def restore(self, job: base.JobContext) -> base.OpResult:
        key = {"job": job.job_id, "group": job.group}
        saved = self.node.saved(**key)
        if saved is None:
            held = self.node.resident_bytes(**key)
            if held is not None:
                return base.OpResult(device_bytes=self._total(held))
            raise base.FatalBackendError(
                f"job {job.job_id} has no saved state for group {job.group} on sim node "
                f"{self.node.node}; nothing to restore"
            )
        footprint = saved.footprint_bytes
        try:
            # The bytes start landing now, so they count against capacity for the whole copy.
            self.node.allocate(**key, bytes_per_device=footprint)
        except device.CapacityError as err:
            # Nothing landed and the host copy is intact: the job stays SAVED.
            raise base.RefusedBackendError(str(err)) from err
        try:
            await self._copy(job=job, bytes_per_device=footprint, what="restore")
        except BaseException:
            # A failed restore gives its partial allocation back; the host copy is intact.
            self.node.free(**key)
            raise
        self.node.unpark(**key)
        return base.OpResult(device_bytes=self._total(footprint), state={"footprint": footprint})

    async def recover(self, job: base.JobContext) -> pb.JobState | None:
        key = {"job": job.job_id, "group": job.group}
        resident = self.node.resident_bytes(**key) is not None
        saved = self.node.saved(**key) is not None
        if resident and saved:
            # A restore was cut short (agent killed mid-copy): the landed bytes are not usable.
            self.node.free(**key)
            return pb.JOB_STATE_SAVED
        if resident:
            return pb.JOB_STATE_RUNNING
        if saved:
            return pb.JOB_STATE_SAVED
        return pb.JOB_STATE_IDLE

    async def forget(self, job: base.JobContext) -> None:
        self.node.forget(job=job.job_id, group=job.group)

    async def accelerators(self) -> list[base.Accelerator]:
        used = self.node.used_bytes()  # every device holds the same states
        return [
            base.Accelerator(
                id=d, memory_used_bytes=used, memory_total_bytes=self.node.capacity_bytes
            )
            for d in self.node.device_ids()
        ]
