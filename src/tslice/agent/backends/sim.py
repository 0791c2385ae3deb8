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

Moves that hide their cost (issue 9 §2), each a setting: ``chunks`` splits every copy
into pieces (chunked offload: a snapshot frees its memory piece by piece, a restore
lands it piece by piece); ``overlap`` declares that a snapshot and a restore may run at
once (each direction has its own link, one copy at a time per direction; a restore
lands a piece only where there is free memory, waiting while a snapshot is freeing
some, failing loudly when nothing is); ``prefetch`` declares :meth:`SimBackend.prefetch`
(a saved state copied into free memory ahead of its grant, dropped whenever that memory
is needed). ``suspend_mode: discard`` makes a snapshot that names no mode discard the
state (the application re-sends it, e.g. the sampler's weights at the next weight
sync): nothing is copied either way, the restore only allocates.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from tslice.agent.backends import base
from tslice.agent.backends import simdevice as device
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

    from tslice.agent.backends import services

_MODES = {"offload": pb.SUSPEND_MODE_OFFLOAD, "discard": pb.SUSPEND_MODE_DISCARD}


class SimBackend(base.Backend):
    """Simulated node: ``devices`` devices of ``capacity_bytes`` each.

    ``state_dir`` (injected by the agent) holds the device state and the journal so that
    the simulated memory outlives an agent crash; ``None`` keeps it in memory.
    """

    name: ClassVar[str] = "sim"
    #: Simulated states hold no host memory: never counted against the host budget.
    holds_host_memory: ClassVar[bool] = False

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
        chunks: int = 1,
        overlap: bool = False,
        prefetch: bool = False,
        suspend_mode: str = "offload",
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
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1 (got {chunks})")
        if suspend_mode not in _MODES:
            raise ValueError(f"suspend_mode must be one of {sorted(_MODES)} (got {suspend_mode!r})")
        self.chunks = chunks
        self.overlaps_moves = bool(overlap)
        self.prefetches = bool(prefetch)
        self.default_mode = _MODES[suspend_mode]
        #: When each direction's link is free again (loop time): one link each way, one
        #: piece at a time on it, at the direction's rate.
        self._link_free: dict[device.Direction, float] = {"snapshot": 0.0, "restore": 0.0}
        #: Notified whenever a snapshot frees memory (overlapping restores wait on it).
        self._room = asyncio.Condition()
        #: Prefetches in flight, and the restores that take them over.
        self._prefetching: dict[device.Key, asyncio.Event] = {}
        self._taken_over: set[device.Key] = set()
        #: Restores in flight (a prefetch of one of them would land its bytes twice).
        self._restoring: set[device.Key] = set()

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

    def _pieces(self, bytes_per_device: int) -> list[int]:
        """A copy of ``bytes_per_device`` as ``chunks`` pieces (the last takes the rest)."""
        if bytes_per_device <= 0:
            return []
        size = max(bytes_per_device // self.chunks, 1)
        pieces = [size] * min(self.chunks - 1, bytes_per_device // size)
        return [*pieces, bytes_per_device - sum(pieces)]

    async def _move(self, what: device.Direction, bytes_per_device: int, due: float) -> float:
        """One piece over the link of direction ``what``, starting at ``due`` (loop time)
        or once the link is free; returns when it ends. Scheduled against the clock, so
        late wake-ups of earlier pieces do not add up."""
        loop = asyncio.get_running_loop()
        start = max(due, self._link_free[what])
        end = self._link_free[what] = start + bytes_per_device / self.speed.rate(what)
        await asyncio.sleep(max(0.0, end - loop.time()))
        return end

    async def _copy(
        self,
        *,
        job: base.JobContext,
        bytes_per_device: int,
        what: device.Direction,
        moved: Callable[[int], Awaitable[bool]] | None = None,
    ) -> None:
        """Take the time the copy takes in direction ``what``, then apply injected faults.

        Piece by piece (``chunks``), each over its direction's link; ``moved`` is awaited
        before each piece of a restore (to land it) and after each of a snapshot (it is
        freed; a restore's ``moved`` returns whether it had to wait for room). A failing
        or hanging copy moves nothing: its dice are rolled first.
        """
        # Roll both dice up front so that a seeded run is reproducible whatever the timing.
        hang = self._random.random() < self.hang_probability
        fail = self._random.random() < self.fail_probability
        loop = asyncio.get_running_loop()
        due = loop.time() + self.speed.latency_s + self.extra_latency_s
        pieces = [] if hang or fail else self._pieces(bytes_per_device)
        for piece in pieces:
            if moved is not None and what == "restore" and await moved(piece):
                due = max(due, loop.time())  # it waited for a snapshot to free memory
            due = await self._move(what, piece, due)
            if moved is not None and what == "snapshot":
                await moved(piece)
        if not pieces:
            copy_s = bytes_per_device / self.speed.rate(what) if hang or fail else 0.0
            await asyncio.sleep(max(0.0, due + copy_s - loop.time()))
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
            # Prefetched copies of others never stand in the way: they are dropped for it.
            self.node.check_fits(
                job=job.job_id, group=job.group, bytes_per_device=footprint, counting_cached=False
            )
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
        if mode == pb.SUSPEND_MODE_UNSPECIFIED:
            mode = self.default_mode
        discard = mode == pb.SUSPEND_MODE_DISCARD

        async def freed(piece: int) -> bool:
            self.node.leave(**key, bytes_per_device=piece)
            async with self._room:
                self._room.notify_all()
            return False

        self.node.begin_leaving(**key)
        try:
            # A failure or cancellation before park() leaves the allocation: nothing moved.
            await self._copy(
                job=job, bytes_per_device=0 if discard else footprint, what="snapshot", moved=freed
            )
        except BaseException:
            self.node.stay(**key)
            raise
        host_bytes = 0 if discard else self._total(footprint)
        self.node.park(
            **key,
            saved=device.SavedState(footprint_bytes=footprint, host_bytes=host_bytes),
        )
        async with self._room:
            self._room.notify_all()
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
        k = (job.job_id, job.group)
        self._restoring.add(k)
        try:
            return await self._restore_saved(job, saved)
        finally:
            self._restoring.discard(k)

    async def _restore_saved(self, job: base.JobContext, saved: device.SavedState) -> base.OpResult:
        key = {"job": job.job_id, "group": job.group}
        await self._take_over_prefetch(job.job_id, job.group)
        footprint = saved.footprint_bytes
        # A discarded state has nothing to copy back: the restore only allocates.
        to_copy = footprint - self.node.landed_bytes(**key) if saved.host_bytes else 0
        try:
            if self.overlaps_moves:
                await self._copy(
                    job=job, bytes_per_device=to_copy, what="restore", moved=self._land(job)
                )
                self.node.allocate(**key, bytes_per_device=footprint)
            else:
                # The bytes start landing now, so they count against capacity for the whole copy.
                self.node.allocate(**key, bytes_per_device=footprint)
                await self._copy(job=job, bytes_per_device=to_copy, what="restore")
        except device.CapacityError as err:
            # Nothing usable landed and the host copy is intact: the job stays SAVED.
            self.node.drop_landed(**key)
            raise base.RefusedBackendError(str(err)) from err
        except BaseException:
            # A failed restore gives its partial allocation back; the host copy is intact.
            self.node.drop_landed(**key)
            self.node.free(**key)
            raise
        self.node.unpark(**key)
        return base.OpResult(device_bytes=self._total(footprint), state={"footprint": footprint})

    def _land(self, job: base.JobContext) -> Callable[[int], Awaitable[bool]]:
        """How an overlapping restore lands a piece: in free memory, waiting while a
        snapshot is freeing some; prefetched copies of others are dropped first; when
        nothing is leaving and it still does not fit, CapacityError (fail loudly)."""
        j, g = job.job_id, job.group

        async def land(piece: int) -> bool:
            waited = False
            async with self._room:
                while not self.node.make_room(job=j, group=g, bytes_per_device=piece):
                    if not self.node.leaving():
                        break
                    waited = True
                    await self._room.wait()
            if self.node.free_bytes() < piece:
                landed = self.node.landed_bytes(job=j, group=g)
                self.node.check_fits(job=j, group=g, bytes_per_device=landed + piece)
            self.node.land(job=j, group=g, bytes_per_device=piece)
            return waited

        return land

    async def prefetch(self, job: base.JobContext) -> int:
        """Land the saved state piece by piece in free memory (never waiting for any, never
        dropping anything); stops when the next piece does not fit or a restore of the
        job takes over. The copy is dropped whenever another state needs the memory."""
        k = (job.job_id, job.group)
        key = {"job": job.job_id, "group": job.group}
        saved = self.node.saved(**key)
        if not self.prefetches or saved is None or k in self._prefetching or k in self._restoring:
            return self.node.landed_bytes(**key)
        done = self._prefetching[k] = asyncio.Event()
        try:
            if not saved.host_bytes:
                return 0  # discarded: nothing to bring in ahead, the restore only allocates
            left = saved.footprint_bytes - self.node.landed_bytes(**key)
            for piece in self._pieces(left):
                fits = piece <= self.node.free_bytes()
                if k in self._taken_over or not fits:
                    break
                self.node.land(job=job.job_id, group=job.group, bytes_per_device=piece, cached=True)
                await self._move("restore", piece, asyncio.get_running_loop().time())
                if not self.node.cached(**key) and k not in self._taken_over:
                    break  # dropped meanwhile: somebody needed the memory
            return self.node.landed_bytes(**key)
        finally:
            del self._prefetching[k]
            done.set()

    async def _take_over_prefetch(self, job_id: str, group: str) -> None:
        """A restore of the job continues from what its prefetch landed."""
        k = (job_id, group)
        running = self._prefetching.get(k)
        if running is not None:
            self._taken_over.add(k)
            try:
                await running.wait()
            finally:
                self._taken_over.discard(k)

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
