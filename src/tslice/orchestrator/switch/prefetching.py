"""Prefetch (issue 9 §2): the next waiter's state starts coming in before the holder yields.

After a grant, and when a job queues behind a holder, the group asks
:func:`next_to_prefetch` (pure) whether someone is worth bringing in now: the group
has a holder, no switch runs, and the first waiter announced a footprint. Then
:func:`prefetch_everywhere` asks every node's agent, each of which reads its own
Status first (``AgentClient.prefetch``): only agents that declare the feature get the
directive, and only where the footprint fits in the free memory of every device. The
agent copies into free memory only and drops the copy whenever that memory is needed,
so a prefetch never costs the holder anything; the switch that follows finds the state
there (a short restore). It is a hint: a failure is logged and changes nothing.

The rule is deliberately simple (next waiter known, and it fits); a cost-aware policy
(``tslice.orchestrator.policy``) can replace :func:`next_to_prefetch`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Protocol

from tslice.orchestrator import config
from tslice.orchestrator.switch import pool as agents

log = logging.getLogger(__name__)


class LockView(Protocol):
    """What the rule reads of a group's lock."""

    @property
    def holder(self) -> str | None: ...

    @property
    def waiting_jobs(self) -> list[str]: ...

    @property
    def grant_epoch(self) -> int: ...

    def footprint(self, job: str) -> int: ...

    def next_waiter(self, *, now: float) -> str | None: ...


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Bring ``job``'s state (``footprint_bytes`` per device) in while ``epoch`` holds."""

    job: str
    footprint_bytes: int
    epoch: int


def next_to_prefetch(lock: LockView, *, switching: bool, now: float) -> Candidate | None:
    """The waiter to prefetch now, or ``None``: the group has a holder, no switch is
    running, and the next waiter (the policy's choice, which is not always the first in
    the queue) declared its footprint (without one, nobody can tell whether it fits)."""
    holder, job = lock.holder, lock.next_waiter(now=now)
    if holder is None or switching or job is None or job == holder:
        return None
    footprint = lock.footprint(job)
    if footprint <= 0:
        return None
    return Candidate(job=job, footprint_bytes=footprint, epoch=lock.grant_epoch)


async def prefetch_everywhere(
    pool: agents.AgentPool, nodes: tuple[config.NodeRef, ...], group: str, c: Candidate
) -> dict[str, str]:
    """Ask every node to prefetch ``c.job``'s state for ``group``; node -> what it did."""

    async def one(node: config.NodeRef) -> str:
        try:
            return await pool.get(node.address).prefetch(
                job_id=c.job, group=group, footprint_bytes=c.footprint_bytes
            )
        except agents.AgentError as err:
            return f"not started: {err.detail}"

    done = await asyncio.gather(*(one(n) for n in nodes))
    outcome = {n.name: what for n, what in zip(nodes, done, strict=True)}
    log.info(
        "group %s: prefetch of job %s: %s",
        group,
        c.job,
        ", ".join(f"{n}: {what}" for n, what in outcome.items()),
        extra={"group_id": group, "job_id": c.job},
    )
    return outcome
