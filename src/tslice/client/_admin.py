"""What the administrator's calls (Evict, Drain) hand back, converted from the wire.

With authentication on, these calls need the admin role (``$TSLICE_TOKEN*`` or
``$TSLICE_TLS_*`` naming an admin credential, as for every client call).
"""

from __future__ import annotations

import dataclasses
import enum

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _wire


class EvictedRole(str, enum.Enum):
    """What an evicted job was to its group."""

    UNSPECIFIED = "UNSPECIFIED"
    #: It held the lock (or was the target of the switch in progress): the lock was
    #: taken from it and the group moves on to its next waiter.
    HOLDER = "HOLDER"
    #: It waited: its pending Acquire ended ABORTED with the reason.
    WAITER = "WAITER"


@dataclasses.dataclass(frozen=True)
class Eviction:
    """One group a job was taken out of."""

    group_id: str
    role: EvictedRole
    #: A holder's eviction: the job the group now switches to or grants ("" = none was
    #: waiting: the evicted job's state stays resident until the next turn needs it).
    next_job: str = ""


@dataclasses.dataclass(frozen=True)
class DrainState:
    """A group's drain mark after Drain (or resume), and what still runs in it."""

    #: The mark now, and before the call.
    draining: bool
    was_draining: bool
    #: The holder that keeps its turn ("" = none).
    locking_job: str
    #: A switch is in flight (it finishes; its target then holds the group).
    switching: bool
    waiter_queue_depth: int


def evictions(response: opb.EvictResponse) -> tuple[Eviction, ...]:
    return tuple(
        _wire.value(
            Eviction,
            e,
            role=_wire.enum_member(EvictedRole, opb.Eviction.Role, e.role, prefix="ROLE_"),
        )
        for e in response.evictions
    )


def drain_state(response: opb.DrainResponse) -> DrainState:
    return _wire.value(DrainState, response)
