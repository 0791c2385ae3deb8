"""The contract between the agent and a backend (the thing that moves one job's
device state on one node).

The agent owns the per-job state machine, operation bookkeeping, persistence and
deadlines; a backend only moves bytes. The agent calls a backend through a private
wrapper that enforces the operation deadline, converts stray exceptions into
:class:`FatalBackendError` and records metrics, so a backend may stay simple.

Retry semantics live in the exception type, never in message text:
:class:`TransientBackendError` means "nothing changed, try again later";
:class:`RefusedBackendError` means "nothing changed, and trying again won't help";
:class:`FatalBackendError` means the job's state may be inconsistent (the job
becomes FAULTED until reset).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb

if TYPE_CHECKING:
    from typing_extensions import Self

    from tslice.agent.backends import services


class BackendError(Exception):
    """Root of backend failures; ``str(err)`` is shown to users as the operation error."""


class TransientBackendError(BackendError):
    """Nothing was changed; the same call may succeed after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: float = 0.5) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RefusedBackendError(BackendError):
    """Nothing was changed and retrying will not help (e.g. no workload registered, an engine
    started without sleep mode): the operation fails, the job keeps its state."""


class FatalBackendError(BackendError):
    """The operation failed and the job's device state may be partly moved."""


class InvalidBackendConfigError(BackendError):
    """The request's backend config cannot be served; nothing was done (INVALID_ARGUMENT)."""


class BackendConfigRefusedError(InvalidBackendConfigError):
    """The config is well-formed but refused by policy, e.g. a host outside the allow-list
    (FAILED_PRECONDITION); nothing was done."""


class NeverFitsError(BackendConfigRefusedError):
    """The job's state is larger than the devices: it can never be resident here
    (RESOURCE_EXHAUSTED); nothing was done."""


class BackendUnavailableError(BackendError):
    """The backend cannot work on this node at all (no driver, no GPU, missing binary)."""


@dataclasses.dataclass(frozen=True)
class JobContext:
    """Read-only description of the job an operation is about."""

    job_id: str
    group: str
    #: Backend config from the request (or the one recorded at grant); ``None`` = defaults.
    config: pb.BackendConfig | None = None
    #: Device bytes the job occupies when resident (0 = the backend's default).
    footprint_bytes: int = 0
    #: Opaque per-job state this backend asked the agent to persist (see ``OpResult.state``).
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Device indices of this node that the group uses (``GrantRequest.devices``); empty = all.
    devices: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class OpResult:
    """What an operation did, measured, not estimated."""

    #: Device bytes freed (snapshot) or brought back (restore/activate).
    device_bytes: int = 0
    #: Host bytes holding the job's saved state after the operation.
    host_bytes: int = 0
    #: Opaque JSON-able state the agent persists with the job and hands back in
    #: ``JobContext.state`` (e.g. PIDs of a checkpointed process).
    state: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: A snapshot of selected tags left part of the job on the device: it stays RUNNING.
    still_resident: bool = False


@dataclasses.dataclass(frozen=True)
class Accelerator:
    id: str
    memory_used_bytes: int
    memory_total_bytes: int


class Backend(abc.ABC):
    """Moves one job's device state to host memory and back on this node.

    Methods are coroutines and may take as long as the copy takes; the agent
    runs at most one operation per job at a time but may run operations of
    different jobs concurrently, so shared state must be guarded.
    """

    #: Registry name, also the gRPC health ``service`` name (``sim``, ``noop``, ``cuda``...).
    name: ClassVar[str]
    #: Overlap (issue 9 §2): a snapshot of one job and a restore of another may run at
    #: once on this node (opposite copy directions; the restore lands only in memory the
    #: snapshot has already freed, chunk by chunk), so a switch costs about the longer of
    #: the two copies. A Grant then starts its bring-in together with its evictions.
    overlaps_moves: bool = False
    #: Prefetch (issue 9 §2): :meth:`prefetch` copies a SAVED job's state into free
    #: device memory ahead of its grant, keeping the host copy; the backend drops that
    #: copy whenever the memory is needed, and a later restore finds it there.
    prefetches: bool = False
    #: The states this backend parks hold the node's host memory, so they count against
    #: its budget for parked states (:mod:`tslice.agent.moves.parking`). False for simulated
    #: states (``sim``, ``noop``).
    holds_host_memory: ClassVar[bool] = True

    @classmethod
    def create(cls, settings: Mapping[str, Any]) -> Self:
        """Build the backend from its section of the agent config (validated by the backend)."""
        return cls(**settings)

    @classmethod
    def create_on_node(
        cls, settings: Mapping[str, Any], node_services: services.NodeServices
    ) -> Self:
        """How the agent builds the backend: its config section plus the node's services.

        Default: the backend needs none of them, ``create(settings)``. A backend that uses
        one (the workload channel hub, the process registry) overrides this.
        """
        return cls.create(settings)

    @abc.abstractmethod
    async def snapshot(self, job: JobContext, mode: pb.SuspendMode) -> OpResult:
        """Move the job's device state off the device.

        Called only for a RUNNING job. Raise TransientBackendError if nothing
        changed, FatalBackendError if the state may be partly moved.
        """

    @abc.abstractmethod
    async def restore(self, job: JobContext) -> OpResult:
        """Bring a SAVED job's state back onto the device.

        Must fail (FatalBackendError or TransientBackendError) rather than
        overcommit the device. Called only for a SAVED job.
        """

    async def validate(self, job: JobContext) -> None:
        """Check ``job.config`` before any operation is created; no I/O, no side effects.

        Raise InvalidBackendConfigError / BackendConfigRefusedError; the agent answers the
        RPC with INVALID_ARGUMENT / FAILED_PRECONDITION and the job's state is untouched.
        """
        return None  # optional hook

    async def activate(self, job: JobContext) -> OpResult:
        """The job was granted with nothing to restore: it now owns the device.

        Default: nothing to do. The sim backend allocates the job's footprint here.
        Must be idempotent.
        """
        return OpResult()

    async def fits(self, job: JobContext) -> bool | None:
        """Whether the job's state would fit on the devices next to what is resident now.

        Asked before a Grant makes another group's deferred resident give way (only
        then): ``False`` makes room first, ``True`` brings the job in beside it.
        ``None`` (the default) means the backend cannot tell, and room is made. No side
        effects; may raise NeverFitsError.
        """
        return None

    async def host_bytes_needed(self, job: JobContext) -> int | None:
        """Host bytes a snapshot of the RUNNING job would park now, asked before the
        snapshot is started (the budget check, :mod:`tslice.agent.moves.parking`); ``None``
        (the default) if the backend cannot tell: the agent then takes the device bytes
        the job was last seen to hold. No side effects; may block briefly (I/O)."""
        return None

    async def prefetch(self, job: JobContext) -> int:
        """Bring the SAVED job's state in ahead of its grant, into free memory only.

        Called only where :attr:`prefetches` is declared, for a SAVED job, never while an
        operation runs on it; the job stays SAVED (the host copy is the state). Never
        takes memory that is in use, and gives its copy up whenever memory is needed
        (a restore or activation of another state): a prefetch never costs anyone
        memory. Returns the bytes per device now on the device (0: nothing fitted).
        """
        return 0

    async def missing_tags(self, job: JobContext, tags: Sequence[str]) -> list[str]:
        """Staged restore: which of ``tags`` are not resident although the job is RUNNING.

        A Restore with tags of a RUNNING job reaches the backend only if this returns a
        non-empty list (e.g. ``kv_cache`` after an earlier ``weights``-only wake).
        Default: every tag is resident whenever the job runs.
        """
        return []

    async def forget(self, job: JobContext) -> None:
        """The job is gone; drop whatever the backend holds for it. Idempotent."""
        return None  # optional hook

    async def recover(self, job: JobContext) -> pb.JobState | None:
        """After an agent restart, read back the real state of a job the agent knew.

        Return the state the backend observes (e.g. from the driver), or ``None``
        if it cannot tell, in which case the persisted state is trusted.
        """
        return None

    async def check_health(self) -> None:
        """Raise BackendUnavailableError (with the reason) if the backend cannot serve."""
        return None  # optional hook

    async def accelerators(self) -> list[Accelerator]:
        """Device memory on this node, for ``StatusResponse.accelerator_statuses``."""
        return []

    async def close(self) -> None:
        """Release resources at agent shutdown."""
        return None  # optional hook
