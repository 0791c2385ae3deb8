"""A group whose record was lost: its holder is looked for on the agents.

In Kubernetes HA mode a group's record lives in a ConfigMap, which an operator may delete
or leave unreadable; a new leader then cannot tell a group that never had a record from
one that lost it. A missing or unreadable record must not mean "nobody holds": the
holder's client still believes it holds, and granting the next waiter would move the
holder's state off the devices under it. Such a group starts from an empty record
marked ``holder_from_agents`` (``tslice.orchestrator.persistence.records``); recovery reads its
agents (as after any restart), and the job resident on every node is taken to hold the
group, because it may (a holder and a yielded resident look the same on the devices),
unless meanwhile it yielded or was evicted, or asked for the group again (then it holds
nothing now, and waits its turn as any waiter). Nothing is granted past it until it
yields, its lease or its pods go, or an administrator releases it (``tslice yield GROUP
JOB``): a job that had in fact yielded before is granted at its next Acquire at once
(it is resident) and lets the others go at its next yield.

The grant epoch of a holder found so is unknown (its client got it from the lost
record): its Hold stream is accepted under any epoch until its next grant.
"""

from __future__ import annotations

from tslice.orchestrator.persistence import records


class HolderSearch:
    """Whether a group's holder is (being) looked for on the agents."""

    def __init__(self, *, pending: bool = False, found: tuple[str, int] | None = None) -> None:
        #: Recovery has not read the agents yet: the holder is not known.
        self.pending = pending
        #: (holder, grant epoch) taken from the agents, until the holder's next grant.
        self.found = found
        #: Jobs that yielded or were evicted while the holder was looked for.
        self._departed: set[str] = set()

    @classmethod
    def of(cls, record: records.LockRecord) -> HolderSearch:
        if not record.holder_from_agents:
            return cls()
        if record.holder is not None and record.intent is None:
            return cls(found=(record.holder, record.grant_epoch))
        return cls(pending=record.holder is None and record.intent is None)

    def departed(self, job: str) -> None:
        """``job`` yielded, or was evicted, while nobody was known to hold."""
        if self.pending:
            self._departed.add(job)

    def decide(self, resident: str | None, *, waiting: bool, epoch: int) -> str | None:
        """Recovery read the agents; ``resident`` runs on every node (None: no single
        job does), ``waiting``: it asks for the group again. The job taken to hold."""
        self.pending = False
        if resident is None or waiting or resident in self._departed:
            return None
        self.found = (resident, epoch)
        return resident

    def epoch_unknown(self, holder: str | None, epoch: int) -> bool:
        """Whether ``holder``'s grant (``epoch`` on the lock) was found on the agents."""
        return holder is not None and self.found == (holder, epoch)

    def recorded(self, holder: str | None, epoch: int) -> bool:
        """What the record says (``holder_from_agents``)."""
        return self.pending or self.epoch_unknown(holder, epoch)


def holder_detail(job: str) -> str:
    """What the group says of a holder found on the agents."""
    return (
        f"holder {job} found resident on every node: the group's record was lost (its "
        f"state ConfigMap deleted or unreadable), so {job} is taken to hold it; if it does "
        f"not, release it with: tslice yield <group> {job}"
    )
