"""What a group's lock decides, and what the group does about it: frozen dataclasses.

The lock (``group.lock``, pure) answers every event with a list of *decisions*:

- :class:`Granted`  the job holds the group now;
- :class:`StartSwitch`  move ``from_job`` out and ``to_job`` in on every node;
- :class:`Abort`  the job's pending Acquires fail (with a refusal code);
- :class:`Emit`  an event (queued, yielded, cancelled, rolled back);
- :class:`NeedClaim` / :class:`ReleaseClaim`  ask for / give back the device claim that
  groups sharing devices take turns on (``group.overlap``);
- :class:`NeedSet` / :class:`NotReady`  the group is ready for a set member, or is no
  longer (``sets.coordinator``).

The group's executor (``group.executor``) books each decision in the command that made
it (the claims and sets are settled there and then, the Acquire RPCs a grant reaches
are bound to it) and turns it into *effects*, which it runs only once the new state is
persisted ("write before act"):

- :class:`Deliver` / :class:`Refuse`  answer those Acquire RPCs;
- :class:`Launch`  start the switch;
- :class:`Publish`  publish an event;
- :class:`Answer`  answer a Yield or an administrator's call;
- :class:`EndHolds`  end the Hold streams of a job that let go;
- :class:`CountDeferredSnapshot`  a yield deferred its snapshot (a metric);
- :class:`Prefetch`  ask the nodes to bring the next waiter's state in early.

A group's driver adds the effects of its own commands (Answer, EndHolds...) to what the
lock decided; nothing else carries a decision from one module to another.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from typing import TYPE_CHECKING, Any, TypeAlias

from tslice.orchestrator.events import bus
from tslice.rpc import refusals

if TYPE_CHECKING:
    from tslice.orchestrator.group import callers
    from tslice.orchestrator.policy import prefetch

# ---- decisions (the lock's) ----------------------------------------------------------------


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


# ---- effects (the executor's, after persisting) ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Deliver:
    """Answer these Acquire RPCs: their job holds the group under ``epoch``."""

    waiters: tuple[callers.Waiter, ...]
    epoch: int
    restored: bool


@dataclasses.dataclass(frozen=True)
class Refuse:
    """Fail these Acquire RPCs with ``code`` and ``message``."""

    waiters: tuple[callers.Waiter, ...]
    code: refusals.Code
    message: str


@dataclasses.dataclass(frozen=True)
class Launch:
    """Start the switch (its intent is on disk)."""

    switch: StartSwitch


@dataclasses.dataclass(frozen=True)
class Publish:
    """Publish an event of the group (stamped when it was decided)."""

    event: bus.Event


@dataclasses.dataclass(frozen=True)
class Answer:
    """Answer a call the group took (a Yield, an administrator's) with ``value``."""

    future: asyncio.Future[Any]
    value: Any


@dataclasses.dataclass(frozen=True)
class EndHolds:
    """End these Hold streams: "" = their job yielded, else why it lost the lock."""

    sessions: tuple[callers.HoldSession, ...]
    lost: str = ""


@dataclasses.dataclass(frozen=True)
class CountDeferredSnapshot:
    """A holder let go with nobody waiting: its snapshot is deferred (a metric)."""


@dataclasses.dataclass(frozen=True)
class Prefetch:
    """Ask every node to bring ``candidate``'s state in beside the holder."""

    candidate: prefetch.Candidate


Effect: TypeAlias = (
    "Deliver | Refuse | Launch | Publish | Answer | EndHolds | CountDeferredSnapshot | Prefetch"
)
