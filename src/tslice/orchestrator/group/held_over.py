"""What comes for a stopped group, kept until it is back (Kubernetes mode).

A group whose nodes are all gone (cordoned, NotReady, unlabelled) stops; its record
stays persisted, and it resumes from it when a node is back. What comes for it meanwhile
is not lost:

- its holder's Yield is kept and answered success (nothing can be granted while the
  group is stopped, so the yield applied when it is back is the same turn);
- the eviction of a job whose pods all went (the job held or waited in the group's
  record) is kept too, unless the job comes back (a pod of it live again) first.

When the group is back, before it grants anything (it is still reading its agents),
what was kept is applied in the order it came. A restarted orchestrator evicts a job
whose pods are listed finished once its groups are back, so a live orchestrator and a
restarted one agree. Kept in memory: a restart or a failover of the orchestrator loses
what was kept (then the holder's lease, if it has one, is what releases it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from tslice.orchestrator.persistence import records


@dataclasses.dataclass(frozen=True)
class Yield:
    job: str


@dataclasses.dataclass(frozen=True)
class Eviction:
    job: str
    reason: str
    by: str


Kept = Yield | Eviction


def holds(record: records.LockRecord, job: str) -> bool:
    """Whether ``job`` holds the group in ``record`` (or is its switch's target)."""
    target = record.intent.to_job if record.intent is not None else None
    return job in (record.holder, target)


def names(record: records.LockRecord, job: str) -> bool:
    """Whether ``job`` holds or waits in ``record``."""
    return holds(record, job) or any(q.job == job for q in record.queue)


class HeldOver:
    """Per stopped group, what to apply when it is back."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Kept]] = {}

    def keep(self, group_id: str, kept: Kept) -> None:
        self._kept.setdefault(group_id, []).append(kept)

    def take(self, group_id: str) -> list[Kept]:
        """What was kept for ``group_id`` (now back), in order; forgotten here."""
        return self._kept.pop(group_id, [])

    def revoke(self, live: Collection[str]) -> None:
        """Evictions of jobs that are ``live`` again are not applied."""
        for group_id, kept in list(self._kept.items()):
            left = [k for k in kept if not (isinstance(k, Eviction) and k.job in live)]
            if left:
                self._kept[group_id] = left
            else:
                del self._kept[group_id]
