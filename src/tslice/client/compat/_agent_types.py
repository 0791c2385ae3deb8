"""llm-d's snapshot-agent client result types (frozen dataclasses), with tslice's
extension fields appended after llm-d's, each with a default."""

from __future__ import annotations

import dataclasses

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.client import _wire


@dataclasses.dataclass(frozen=True)
class _Started:
    """An operation the agent started; poll it by ``operation_id``."""

    operation_id: str


class SnapshotResponse(_Started):
    """A snapshot the agent started."""


class RestoreResponse(_Started):
    """A restore the agent started."""


@dataclasses.dataclass(frozen=True)
class HealthResponse:
    #: Serving status name, e.g. ``"SERVING"``.
    status: str


@dataclasses.dataclass(frozen=True)
class GetOperationResponse:
    #: Enum name, e.g. ``"OPERATION_STATUS_COMPLETE"``.
    status: str
    elapsed_ms: int
    storage_bytes: int | None = None
    snapshot_device_bytes: int | None = None
    error: str | None = None
    #: tslice: job the operation belongs to.
    job_id: str = ""
    #: tslice: "snapshot" or "restore".
    kind: str = ""

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


FINISHED = frozenset(
    {
        pb.OperationStatus.Name(pb.OPERATION_STATUS_COMPLETE),
        pb.OperationStatus.Name(pb.OPERATION_STATUS_FAILED),
    }
)


@dataclasses.dataclass(frozen=True)
class JobStatus:
    job_id: str
    #: Enum name, e.g. ``"JOB_STATE_RUNNING"``.
    state: str
    group: str = ""
    operation_id: str = ""
    device_bytes: int = 0
    host_bytes: int = 0
    backend: str = ""
    error: str = ""


@dataclasses.dataclass(frozen=True)
class AcceleratorStatus:
    id: str
    memory_used_bytes: int
    memory_total_bytes: int


@dataclasses.dataclass(frozen=True)
class StatusResponse:
    job_statuses: list[JobStatus]
    accelerator_statuses: list[AcceleratorStatus]
    #: tslice: the node's name.
    node: str = ""


def operation(response: pb.GetOperationResponse) -> GetOperationResponse:
    return _wire.value(
        GetOperationResponse,
        response,
        status=_wire.enum_name(pb.OperationStatus, response.status),
    )


def job_state_name(value: int) -> str:
    return _wire.enum_name(pb.JobState, value)


def status(response: pb.StatusResponse) -> StatusResponse:
    return _wire.value(
        StatusResponse,
        response,
        job_statuses=[
            _wire.value(JobStatus, job, state=job_state_name(job.state))
            for job in response.job_statuses
        ],
        accelerator_statuses=[
            _wire.value(AcceleratorStatus, a) for a in response.accelerator_statuses
        ],
    )
