"""Frozen values the client hands back, converted from the wire messages.

Field names and order of the first fields follow llm-d's Python client so that
positional construction and attribute access written for it keep working; tslice
extensions come after, with defaults.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Iterable

from google.protobuf import timestamp_pb2

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb


class GroupState(str, enum.Enum):
    """State of a group as the orchestrator reports it (see DESIGN.md)."""

    UNSPECIFIED = "UNSPECIFIED"
    UNKNOWN = "UNKNOWN"
    IDLE = "IDLE"
    IDLE_YIELDED = "IDLE_YIELDED"
    LOCKED = "LOCKED"
    SWITCHING = "SWITCHING"


class AgentJobState(str, enum.Enum):
    """State of one job on one node, as its snapshot agent reports it."""

    UNSPECIFIED = "UNSPECIFIED"
    IDLE = "IDLE"
    RUNNING = "RUNNING"
    TRANSITIONING = "TRANSITIONING"
    SAVED = "SAVED"
    FAULTED = "FAULTED"


class EventKind(str, enum.Enum):
    """Kind of an orchestrator event (``WatchEvents``)."""

    UNSPECIFIED = "UNSPECIFIED"
    QUEUED = "QUEUED"
    GRANTED = "GRANTED"
    YIELDED = "YIELDED"
    SWITCH_STARTED = "SWITCH_STARTED"
    SNAPSHOT_DONE = "SNAPSHOT_DONE"
    RESTORE_DONE = "RESTORE_DONE"
    SWITCH_DONE = "SWITCH_DONE"
    SWITCH_FAILED = "SWITCH_FAILED"
    CANCELLED = "CANCELLED"


@dataclasses.dataclass(frozen=True)
class AcquireResult:
    """Outcome of ``acquire()``: the job holds the group and its state is resident."""

    success: bool
    #: Time spent waiting for the grant, as measured by the orchestrator.
    waited_ms: int
    #: True only when the job's saved state was really restored for this grant.
    context_restored: bool
    #: Grant counter of the group (fencing token); 0 in no-op mode.
    grant_epoch: int = 0


@dataclasses.dataclass(frozen=True)
class YieldResult:
    """Outcome of ``yield_()``: the lock is released (the call never waits for a switch)."""

    success: bool
    #: Jobs that were waiting for the group when it was released.
    pending_waiters: int
    #: True when nobody waited, so the job stays resident and re-acquires for free.
    snapshot_deferred: bool


@dataclasses.dataclass(frozen=True)
class AgentJobStatus:
    """One (node, job) state inside a group status (llm-d: ``SnapshotAgentJobState``)."""

    agent: str
    job_id: str
    job_state: AgentJobState


@dataclasses.dataclass(frozen=True)
class GroupStatus:
    """Snapshot of one group's lock, queue and residency."""

    group_id: str
    group_state: GroupState
    state_timestamp: datetime.datetime | None
    #: The job holding the lock ("" when nobody does).
    locking_job: str
    #: The job whose state should be resident.
    active_job: str
    waiter_queue_depth: int
    #: The job verified resident on every node.
    loaded_job: str
    waiting_jobs: tuple[str, ...] = ()
    nodes: tuple[str, ...] = ()
    grant_epoch: int = 0
    switch_count: int = 0
    #: Why the state is UNKNOWN (which agents are unreachable), else "".
    detail: str = ""
    agent_job_states: tuple[AgentJobStatus, ...] = ()


@dataclasses.dataclass(frozen=True)
class OrchestratorEvent:
    """One event of the orchestrator's ``WatchEvents`` stream."""

    time: datetime.datetime | None
    kind: EventKind
    group_id: str
    job_id: str = ""
    node: str = ""
    duration_ms: int = 0
    from_job: str = ""
    detail: str = ""
    grant_epoch: int = 0
    bytes: int = 0


def _enum_suffix(full_name: str, prefix: str) -> str:
    return full_name[len(prefix) :] if full_name.startswith(prefix) else full_name


def _time(stamp: timestamp_pb2.Timestamp, *, present: bool) -> datetime.datetime | None:
    return stamp.ToDatetime(tzinfo=datetime.timezone.utc) if present else None


def group_state(value: int) -> GroupState:
    """Wire enum → :class:`GroupState`; a number this client does not know is UNSPECIFIED."""
    try:
        name = opb.GroupStatus.State.Name(value)
    except ValueError:
        return GroupState.UNSPECIFIED
    return GroupState(_enum_suffix(name, "STATE_"))


def agent_job_state(value: int) -> AgentJobState:
    """Wire enum → :class:`AgentJobState`; unknown numbers are UNSPECIFIED."""
    try:
        name = opb.SnapshotAgentJobState.State.Name(value)
    except ValueError:
        return AgentJobState.UNSPECIFIED
    return AgentJobState(_enum_suffix(name, "STATE_"))


def acquire_result(response: opb.AcquireResponse) -> AcquireResult:
    return AcquireResult(
        success=response.success,
        waited_ms=response.waited_ms,
        context_restored=response.context_restored,
        grant_epoch=response.grant_epoch,
    )


def yield_result(response: opb.YieldResponse) -> YieldResult:
    return YieldResult(
        success=response.success,
        pending_waiters=response.pending_waiters,
        snapshot_deferred=response.snapshot_deferred,
    )


def group_status(response: opb.GetGroupStatusResponse) -> GroupStatus:
    group = response.group
    return GroupStatus(
        group_id=group.group_id,
        group_state=group_state(group.group_state),
        state_timestamp=_time(group.state_timestamp, present=group.HasField("state_timestamp")),
        locking_job=group.locking_job,
        active_job=group.active_job,
        waiter_queue_depth=group.waiter_queue_depth,
        loaded_job=group.loaded_job,
        waiting_jobs=tuple(group.waiting_jobs),
        nodes=tuple(group.nodes),
        grant_epoch=group.grant_epoch,
        switch_count=group.switch_count,
        detail=group.detail,
        agent_job_states=tuple(
            AgentJobStatus(
                agent=state.agent,
                job_id=state.job_id,
                job_state=agent_job_state(state.job_state),
            )
            for state in response.agent_job_states
        ),
    )


def orchestrator_event(message: opb.OrchestratorEvent) -> OrchestratorEvent:
    try:
        kind = EventKind(_enum_suffix(opb.OrchestratorEvent.Kind.Name(message.kind), "KIND_"))
    except ValueError:
        kind = EventKind.UNSPECIFIED
    return OrchestratorEvent(
        time=_time(message.time, present=message.HasField("time")),
        kind=kind,
        group_id=message.group_id,
        job_id=message.job_id,
        node=message.node,
        duration_ms=message.duration_ms,
        from_job=message.from_job,
        detail=message.detail,
        grant_epoch=message.grant_epoch,
        bytes=message.bytes,
    )


def event_kinds(kinds: Iterable[EventKind]) -> list[str]:
    """Wire names of ``kinds`` (for ``WatchEventsRequest.kinds``)."""
    return [f"KIND_{EventKind(k).value}" for k in kinds]
