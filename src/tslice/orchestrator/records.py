"""A group lock's persisted view: what must survive a crash (``tslice.orchestrator.store``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class QueueRecord:
    job: str
    seq: int
    footprint_bytes: int


@dataclasses.dataclass(frozen=True)
class IntentRecord:
    """A switch that has started and not finished: what recovery must finish or undo."""

    from_job: str | None
    to_job: str
    epoch: int
    seq: int


@dataclasses.dataclass(frozen=True)
class LockRecord:
    """Everything about a group's lock that must survive a crash."""

    holder: str | None
    resident: str | None
    grant_epoch: int
    switch_count: int
    next_seq: int
    queue: tuple[QueueRecord, ...]
    intent: IntentRecord | None
    footprints: tuple[tuple[str, int], ...]
    #: The holder's lease (0 = none): after a restart it has this long to re-open Hold.
    holder_lease_ms: int = 0
    #: An administrator drained the group (Drain): it grants no new turn until resumed.
    draining: bool = False

    @classmethod
    def empty(cls) -> LockRecord:
        return cls(None, None, 0, 0, 1, (), None, ())
