"""A group lock's persisted view: what must survive a crash (``persistence.store`` keeps it)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class QueueRecord:
    job: str
    seq: int
    footprint_bytes: int
    #: When the job started waiting, wall clock (``time.time()``); written only where
    #: the group's policy needs it to survive a restart (priority's aging). None:
    #: unknown, the wait counts from the restart.
    queued_at: float | None = None


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
    #: The holder's grant was never delivered (a switch rolled forward after a restart
    #: granted a job whose Acquire died with the old process): the wall-clock time
    #: (``time.time()``) by which an Acquire of it must claim the grant, else it loses
    #: the lock. None: the holder's client got its grant (or there is no holder).
    holder_unclaimed_until: float | None = None
    #: The record was lost (HA: its ConfigMap deleted or unreadable): recovery takes the
    #: job resident on every node as the holder; then, until the holder's next grant, its
    #: grant epoch is unknown (``tslice.orchestrator.group.found_holder``).
    holder_from_agents: bool = False

    @classmethod
    def empty(cls) -> LockRecord:
        return cls(None, None, 0, 0, 1, (), None, ())

    @classmethod
    def lost(cls) -> LockRecord:
        """A group whose record may have been lost: its holder is looked for on the agents."""
        return dataclasses.replace(cls.empty(), holder_from_agents=True)
