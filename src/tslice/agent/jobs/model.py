"""The records of the node agent's per-job state machine, and the plans it returns.

A job's :class:`State` (and its wire value, :func:`to_pb`); what a node keeps of a
job, per (job, group) (:class:`Job`, keyed by :data:`Key`),
of each snapshot/restore/activate (:class:`Operation`) and of each group's newest
grant (:class:`GrantMark`); the backend a request is served by (:class:`Route`); and
what the rules of :mod:`tslice.agent.jobs.rules` are given (:class:`Request`, a backend's
:class:`Outcome`) and return (:class:`Start`, :class:`Done`, :class:`Unchanged`).
All frozen: the store persists them (``tslice.agent.state``), the runner and the pure
rules (``rules``, ``routing``, ``tslice.agent.moves.grant_plan``) pass them around, and
nothing here decides a transition.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from tslice.agent.backends import base
from tslice.agent.channel import rules as channel_rules
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


class State(enum.Enum):
    IDLE = "IDLE"
    RUNNING = "RUNNING"
    TRANSITIONING = "TRANSITIONING"
    SAVED = "SAVED"
    FAULTED = "FAULTED"


class Kind(enum.Enum):
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    #: A granted job with nothing to restore takes the device (``Backend.activate``).
    ACTIVATE = "activate"


class OpStatus(enum.Enum):
    PENDING = "PENDING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"


#: Each state as the wire's ``JobState`` (a table: the servicer reads it once per reply).
STATE_TO_PB: Mapping[State, pb.JobState] = {
    State.IDLE: pb.JOB_STATE_IDLE,
    State.RUNNING: pb.JOB_STATE_RUNNING,
    State.TRANSITIONING: pb.JOB_STATE_TRANSITIONING,
    State.SAVED: pb.JOB_STATE_SAVED,
    State.FAULTED: pb.JOB_STATE_FAULTED,
}
_FROM_PB: Mapping[int, State] = {int(v): k for k, v in STATE_TO_PB.items()}


def from_pb(value: int | None) -> State | None:
    """A backend-reported ``pb.JobState`` as a :class:`State`; ``None`` if unknown/unspecified."""
    return None if value is None else _FROM_PB.get(int(value))


#: A record's identity on a node: ``(job_id, group)`` ("" = a job that named no group).
Key = tuple[str, str]

#: The ``backend_state`` key of an IDLE record whose workload left the node (the
#: workload-channel hub says so, or a snapshot reported it): why it left. Dropped when
#: the job is resident again.
WORKLOAD_LEFT = channel_rules.WORKLOAD_LEFT


@dataclasses.dataclass(frozen=True)
class Job:
    """What the node knows about one job's state for one group; persisted on every change."""

    job_id: str
    group: str = ""
    state: State = State.IDLE
    #: Backend that holds (or last moved) the job's state; "" until the first operation.
    backend: str = ""
    #: Backend chosen for the job explicitly (by a request config, or because the job
    #: registered on the workload channel); "" = none, the node default applies.
    choice: str = ""
    #: Serialized ``pb.BackendConfig`` recorded with ``choice`` (b"" = none).
    config: bytes = b""
    #: Device bytes the job declared (per device); 0 = the backend's default.
    footprint_bytes: int = 0
    #: Opaque JSON-able state the backend asked to keep (``OpResult.state``).
    backend_state: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: Why the job is FAULTED ("" otherwise).
    error: str = ""
    #: Operation in flight (TRANSITIONING) or the last one.
    operation_id: str = ""
    device_bytes: int = 0
    host_bytes: int = 0
    #: While TRANSITIONING: the state a failure that changed nothing returns to.
    previous_state: State | None = None

    @property
    def key(self) -> Key:
        return (self.job_id, self.group)

    def backend_config(self) -> pb.BackendConfig | None:
        if not self.config:
            return None
        config = pb.BackendConfig()
        config.ParseFromString(self.config)
        return config


@dataclasses.dataclass(frozen=True)
class Operation:
    """One asynchronous snapshot/restore/activate; ``*_at`` are wall-clock seconds."""

    op_id: str
    job_id: str
    kind: Kind
    backend: str
    status: OpStatus
    started_at: float
    finished_at: float | None = None
    #: The group whose state of the job the operation moves.
    group: str = ""
    #: Host bytes holding the job's state after the operation (COMPLETE only).
    storage_bytes: int | None = None
    #: Device bytes freed (snapshot) or brought back (restore/activate) (COMPLETE only).
    device_bytes: int | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status is not OpStatus.PENDING


@dataclasses.dataclass(frozen=True)
class GrantMark:
    """The newest grant a group's orchestrator announced on this node (fencing token)."""

    group: str
    epoch: int
    job_id: str


@dataclasses.dataclass(frozen=True)
class Route:
    """Which backend serves a request, with the config it gets."""

    backend: str
    config: pb.BackendConfig | None
    #: The request named the backend itself (config arm or deprecated enum).
    explicit: bool = False
    #: The choice becomes the job's recorded choice (explicit, or the workload channel).
    record: bool = False


@dataclasses.dataclass(frozen=True)
class _Stores:
    """A plan that stores ``job`` with ``operation``."""

    job: Job
    operation: Operation


@dataclasses.dataclass(frozen=True)
class Start(_Stores):
    """Store ``job`` (now TRANSITIONING) and ``operation`` (PENDING), then run the backend."""


@dataclasses.dataclass(frozen=True)
class Done(_Stores):
    """Nothing to run: store ``job`` and the already-finished ``operation``."""


@dataclasses.dataclass(frozen=True)
class Unchanged:
    job: Job


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How a backend call ended: a result, or an error and whether anything changed."""

    result: base.OpResult | None = None
    error: str | None = None
    #: False for a TransientBackendError that outlived its retries: nothing moved.
    state_changed: bool = True


@dataclasses.dataclass(frozen=True)
class Request:
    """What the rules are asked to do to one record, with the facts the driver gathered."""

    job_id: str
    group: str
    #: The backend that serves the request (``tslice.agent.jobs.routing``).
    route: Route
    node: str
    #: The id a new operation gets.
    op_id: str
    #: Wall-clock seconds.
    now: float
