"""What the lock decides, for its driver to execute (``tslice.orchestrator.group.lock``).

Each ``on_*`` method of :class:`~tslice.orchestrator.group.lock.GroupLock` returns a list
of these, which the group driver executes in order after it has persisted the new
state:

- :class:`Granted`  resolve every pending Acquire of ``job``;
- :class:`StartSwitch`  move ``from_job`` out and ``to_job`` in on every node;
- :class:`Abort`  fail the pending Acquires of ``job`` (with a refusal code);
- :class:`Emit`  publish an event (queued, yielded, cancelled...);
- :class:`NeedClaim` / :class:`ReleaseClaim`  ask for / give back the device claim
  that groups sharing devices take turns on (``tslice.orchestrator.group.overlap``);
- :class:`NeedSet` / :class:`NotReady`  this group is ready for a set member, or is
  no longer (``tslice.orchestrator.sets.coordinator``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TypeAlias

from tslice.rpc import refusals


@dataclasses.dataclass(frozen=True)
class Granted:
    """The pending Acquires of ``job`` return now (the job holds the group)."""

    job: str
    epoch: int
    restored: bool
    #: Seconds since the job started waiting (for events and metrics).
    waited_s: float
    #: No agent was touched: holder re-acquire or zero-cost re-acquire of the resident.
    zero_cost: bool = False
    #: The job already held the group (a repeated Acquire); not a new grant.
    held: bool = False


@dataclasses.dataclass(frozen=True)
class StartSwitch:
    """Snapshot ``from_job`` (and any other resident job) and bring ``to_job`` in everywhere."""

    from_job: str | None
    to_job: str
    epoch: int
    footprint_bytes: int
    #: True when this switch was found in progress at startup (crash recovery).
    recovered: bool = False


@dataclasses.dataclass(frozen=True)
class Abort:
    """Fail the pending Acquires of ``job``: refused with ``code`` and ``message``."""

    job: str
    message: str
    code: refusals.Code = refusals.Code.ABORTED


@dataclasses.dataclass(frozen=True)
class NeedClaim:
    """Ask for the device claim for ``job``, the waiter to promote next.

    ``others`` are the other waiters, in queue order: one that already holds a group
    (a nested or multi-group acquire) may be granted past a blocked ``job``, which may
    wait for what that holder will release (see ``tslice.orchestrator.group.overlap``).
    """

    job: str
    others: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NeedSet:
    """``job`` waits here as a member of set ``set_seq`` (AcquireSet) and this group is
    reserved for it: tell the set's coordinator that this group is ready (see
    ``tslice.orchestrator.sets.gate``)."""

    job: str
    set_seq: int
    #: The single waiters behind it, in the policy's order: one that holds another group
    #: of the set may go first (it would otherwise wait for the set that waits for it).
    others: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NotReady:
    """This group, reserved for a set member and reported ready, may not grant it now
    (drained): the set's coordinator counts it ready no longer (``sets``)."""


@dataclasses.dataclass(frozen=True)
class ReleaseClaim:
    """Give the device claim back: nobody holds the group and another group wants it."""


class EventKind(enum.Enum):
    QUEUED = "queued"
    YIELDED = "yielded"
    CANCELLED = "cancelled"
    #: A switch found in progress after a restart was undone (nothing had moved).
    ROLLED_BACK = "rolled_back"


@dataclasses.dataclass(frozen=True)
class Emit:
    kind: EventKind
    job: str
    detail: str = ""


Action: TypeAlias = (
    "Granted | StartSwitch | Abort | Emit | NeedClaim | NeedSet | NotReady | ReleaseClaim"
)


@dataclasses.dataclass(frozen=True)
class YieldOutcome:
    ok: bool
    #: When not ok: the job that holds the lock.
    holder: str | None
    pending_waiters: int
    snapshot_deferred: bool
    actions: list[Action]
    #: When not ok: why the job lost the lock, if an administrator evicted it ("" = not).
    evicted: str = ""


class Role(enum.Enum):
    """What an evicted job was to the group."""

    HOLDER = "holder"
    WAITER = "waiter"


@dataclasses.dataclass(frozen=True)
class EvictOutcome:
    """An eviction: ``role`` None = the job neither held nor waited (nothing changed)."""

    role: Role | None
    #: After a holder's eviction: the job the group switches to or grants ("" = none).
    next_job: str
    actions: list[Action]
