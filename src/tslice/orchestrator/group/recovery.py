"""Crash recovery of one group: read every agent, then decide what the lock believes.

After a restart the lock comes from disk with every queue entry detached and a
switch possibly half done. Nothing is granted until every node of the group has
answered a Status read (the group is UNKNOWN meanwhile); then
:func:`decide_recovery`, a pure function of the persisted lock and the agents'
reports, says whether the switch in progress is rolled back or forward and which
job is resident.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.orchestrator import config
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.switch import plan as steps
from tslice.orchestrator.switch import pool as agents
from tslice.orchestrator.switch import step as switch

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecoveryDecision:
    resident: str | None
    verified: bool
    rollback: bool
    reason: str


def decide_recovery(
    *,
    group: str,
    resident: str | None,
    intent: decisions.StartSwitch | None,
    known_jobs: set[str],
    views: list[steps.NodeView],
) -> RecoveryDecision:
    """What the agents say after a restart (pure; see DESIGN "crash safety").

    With a switch in progress: roll back when nothing moved (the outgoing job still
    runs on every node, the incoming one nowhere, no operation in flight), else roll
    forward. Without: keep the resident if it runs everywhere; adopt the one job of
    the group that runs everywhere; otherwise leave it unverified so the next
    switch snapshots the extras first (naming the one job that runs everywhere, if
    none was resident).
    """

    def ours(job: str, jv: steps.JobView) -> bool:
        return jv.group == group or job in known_jobs

    running = [
        {j for j, v in view.items() if ours(j, v) and v.state == pb.JOB_STATE_RUNNING}
        for view in views
    ]
    busy = any(
        ours(j, v) and v.state in (pb.JOB_STATE_TRANSITIONING, pb.JOB_STATE_FAULTED)
        for view in views
        for j, v in view.items()
    )
    if intent is not None:
        expected = {intent.from_job} if intent.from_job else set()
        if not busy and all(r == expected for r in running):
            return RecoveryDecision(intent.from_job, True, True, "nothing moved: rolled back")
        return RecoveryDecision(resident, False, False, "switch rolled forward")
    if resident is not None and not busy and all(r == {resident} for r in running):
        return RecoveryDecision(resident, True, False, "resident verified")
    everywhere = set.intersection(*running) if running else set()
    anywhere = set.union(*running) if running else set()
    if not busy and len(everywhere) == 1 and anywhere == everywhere:
        (job,) = everywhere
        return RecoveryDecision(job, True, False, f"adopted {job}, running on every node")
    if not busy and not anywhere:
        return RecoveryDecision(None, True, False, "nothing resident")
    if resident is None and len(everywhere) == 1:
        # The one job on every node is named (a lost record's holder may be it).
        (job,) = everywhere
        return RecoveryDecision(
            job,
            False,
            False,
            f"agents disagree ({job} runs on every node): extras evicted at next switch",
        )
    return RecoveryDecision(
        resident, False, False, "agents disagree: extras evicted at next switch"
    )


async def read_until_all_answer(
    *,
    group: str,
    nodes: tuple[config.NodeRef, ...],
    pool: agents.AgentPool,
    backoff: switch.Backoff,
    note: Callable[[steps.Reads], None],
) -> dict[str, steps.NodeView]:
    """Every node's view, read again with backoff until all answered; ``note`` gets
    each round's reads (the group reports unreachable nodes meanwhile)."""
    attempt = 0
    while True:
        reads = await steps.read_all(pool, nodes, group)
        note(reads)
        if not reads.failed:
            return reads.views
        delay = backoff.delay(attempt)
        attempt += 1
        log.warning(
            "group %s: recovery waits for unreachable agents (%s); retrying in %.2f s",
            group,
            "; ".join(reads.failed.values()),
            delay,
        )
        await asyncio.sleep(delay)
