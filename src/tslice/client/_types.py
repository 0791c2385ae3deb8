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

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _wire


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
class DegradedNode:
    """A node a group will not switch on until an operator clears it
    (``tslice clear-degraded``): it kept refusing the group's switch."""

    node: str
    #: The agent's refusal, as it last answered.
    reason: str


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
    #: Nodes that kept refusing a switch: the group starts none until they are cleared.
    degraded: tuple[DegradedNode, ...] = ()
    #: An administrator drained the group (`tslice admin drain`): it grants no new turn.
    draining: bool = False
    #: The group's scheduling policy, as an operator reads it ("" from an older server).
    policy: str = ""
    #: When each of ``waiting_jobs`` started waiting (empty from an older server).
    waiting_since: tuple[datetime.datetime, ...] = ()


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


@dataclasses.dataclass(frozen=True)
class StoredEvents:
    """Which of the orchestrator's stored events a ``watch_events`` replays first: those
    from ``since`` (to ``until``), of ``job`` if given; then it follows live unless
    ``until`` is given or ``follow`` is false."""

    since: datetime.datetime
    until: datetime.datetime | None = None
    job: str | None = None
    follow: bool = True

    def fill(self, request: opb.WatchEventsRequest) -> None:
        request.since.FromDatetime(_utc(self.since))
        if self.until is not None:
            request.until.FromDatetime(_utc(self.until))
        if self.job:
            request.job_id = self.job
        request.history_only = not self.follow


def _utc(when: datetime.datetime) -> datetime.datetime:
    """An aware time in UTC (a naive one is taken as local time)."""
    return when.astimezone(datetime.timezone.utc)


def group_state(value: int) -> GroupState:
    """Wire enum → :class:`GroupState`; a number this client does not know is UNSPECIFIED."""
    return _wire.enum_member(GroupState, opb.GroupStatus.State, value, prefix="STATE_")


def agent_job_state(value: int) -> AgentJobState:
    """Wire enum → :class:`AgentJobState`; unknown numbers are UNSPECIFIED."""
    return _wire.enum_member(AgentJobState, opb.SnapshotAgentJobState.State, value, prefix="STATE_")


def acquire_result(response: opb.AcquireResponse) -> AcquireResult:
    return _wire.value(AcquireResult, response)


def yield_result(response: opb.YieldResponse) -> YieldResult:
    return _wire.value(YieldResult, response)


def group_status(response: opb.GetGroupStatusResponse) -> GroupStatus:
    group = response.group
    return _wire.value(
        GroupStatus,
        group,
        group_state=group_state(group.group_state),
        state_timestamp=_wire.time(group, "state_timestamp"),
        waiting_since=tuple(
            t.ToDatetime(tzinfo=datetime.timezone.utc) for t in group.waiting_since
        ),
        degraded=tuple(_wire.value(DegradedNode, node) for node in group.degraded),
        agent_job_states=tuple(
            _wire.value(AgentJobStatus, state, job_state=agent_job_state(state.job_state))
            for state in response.agent_job_states
        ),
    )


def orchestrator_event(message: opb.OrchestratorEvent) -> OrchestratorEvent:
    return _wire.value(
        OrchestratorEvent,
        message,
        time=_wire.time(message, "time"),
        kind=_wire.enum_member(EventKind, opb.OrchestratorEvent.Kind, message.kind, prefix="KIND_"),
    )


def event_kinds(kinds: Iterable[EventKind]) -> list[str]:
    """Wire names of ``kinds`` (for ``WatchEventsRequest.kinds``)."""
    return [f"KIND_{EventKind(k).value}" for k in kinds]
