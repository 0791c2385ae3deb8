"""llm-d's snapshot-agent client result types (frozen dataclasses), with tslice's
extension fields appended after llm-d's, each with a default."""

from __future__ import annotations

import dataclasses

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


@dataclasses.dataclass(frozen=True)
class SnapshotResponse:
    operation_id: str


@dataclasses.dataclass(frozen=True)
class RestoreResponse:
    operation_id: str


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


def _enum_name(enum: object, value: int) -> str:
    try:
        return enum.Name(value)  # type: ignore[attr-defined, no-any-return]
    except ValueError:
        return str(value)


def operation(response: pb.GetOperationResponse) -> GetOperationResponse:
    return GetOperationResponse(
        status=_enum_name(pb.OperationStatus, response.status),
        elapsed_ms=response.elapsed_ms,
        storage_bytes=response.storage_bytes if response.HasField("storage_bytes") else None,
        snapshot_device_bytes=(
            response.snapshot_device_bytes if response.HasField("snapshot_device_bytes") else None
        ),
        error=response.error if response.HasField("error") else None,
        job_id=response.job_id,
        kind=response.kind,
    )


def job_state_name(value: int) -> str:
    return _enum_name(pb.JobState, value)


def status(response: pb.StatusResponse) -> StatusResponse:
    return StatusResponse(
        job_statuses=[
            JobStatus(
                job_id=job.job_id,
                state=job_state_name(job.state),
                group=job.group,
                operation_id=job.operation_id,
                device_bytes=job.device_bytes,
                host_bytes=job.host_bytes,
                backend=job.backend,
                error=job.error,
            )
            for job in response.job_statuses
        ],
        accelerator_statuses=[
            AcceleratorStatus(
                id=accelerator.id,
                memory_used_bytes=accelerator.memory_used_bytes,
                memory_total_bytes=accelerator.memory_total_bytes,
            )
            for accelerator in response.accelerator_statuses
        ],
        node=response.node,
    )
