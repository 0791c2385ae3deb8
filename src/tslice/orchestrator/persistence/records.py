"""A group lock's persisted view: what must survive a crash (``persistence.store`` keeps it).

:class:`LockRecord` is the whole of it (what a group starts from after a restart).
What a batch of the group's commands changed is a :class:`Changes`: the group's own
row (:class:`GroupRow`) when it changed, the queue entries that came or went and the
footprints that changed, so that a save costs what changed, not the length of the queue.
"""

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
class GroupRow:
    """The group's own fields (everything but its queue and its jobs' footprints)."""

    holder: str | None
    resident: str | None
    grant_epoch: int
    switch_count: int
    next_seq: int
    intent: IntentRecord | None
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
    #: Jobs evicted from the group, with why, until each is granted it again (so that a
    #: restart does not cost the evicted job's next call its reason), oldest first.
    evictions: tuple[tuple[str, str], ...] = ()


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
    holder_lease_ms: int = 0
    draining: bool = False
    holder_unclaimed_until: float | None = None
    holder_from_agents: bool = False
    evictions: tuple[tuple[str, str], ...] = ()

    @classmethod
    def empty(cls) -> LockRecord:
        return cls(None, None, 0, 0, 1, (), None, ())

    @classmethod
    def lost(cls) -> LockRecord:
        """A group whose record may have been lost: its holder is looked for on the agents."""
        return dataclasses.replace(cls.empty(), holder_from_agents=True)

    @property
    def row(self) -> GroupRow:
        return GroupRow(
            self.holder,
            self.resident,
            self.grant_epoch,
            self.switch_count,
            self.next_seq,
            self.intent,
            self.holder_lease_ms,
            self.draining,
            self.holder_unclaimed_until,
            self.holder_from_agents,
            self.evictions,
        )


@dataclasses.dataclass(frozen=True)
class Changes:
    """What one batch of a group's commands changed (see the module docstring)."""

    #: The group's row, when it changed (None: unchanged).
    row: GroupRow | None
    #: Queue entries that came (or changed), and the jobs whose entries went.
    queued: tuple[QueueRecord, ...] = ()
    left: tuple[str, ...] = ()
    #: Footprints that are new or changed (job, bytes).
    footprints: tuple[tuple[str, int], ...] = ()


def applied(record: LockRecord, changes: Changes) -> LockRecord:
    """``record`` with ``changes`` made (for a store that writes whole records: O(queue))."""
    row = changes.row or record.row
    queue = {q.job: q for q in record.queue}
    for job in changes.left:
        queue.pop(job, None)
    for q in changes.queued:
        queue[q.job] = q
    footprints = dict(record.footprints)
    footprints.update(changes.footprints)
    return LockRecord(
        row.holder,
        row.resident,
        row.grant_epoch,
        row.switch_count,
        row.next_seq,
        tuple(sorted(queue.values(), key=lambda q: q.seq)),
        row.intent,
        tuple(sorted(footprints.items())),
        row.holder_lease_ms,
        row.draining,
        row.holder_unclaimed_until,
        row.holder_from_agents,
        row.evictions,
    )
