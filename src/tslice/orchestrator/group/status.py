"""What a group reports: its state on the wire (and in the metrics), and GetGroupStatus.

The state comes from the lock and from what the group knows of its nodes beyond it
(:class:`Health`: unreachable and degraded nodes, why a switch is retrying), with
UNKNOWN whenever the truth cannot be established (never guessed). GetGroupStatus
adds a live Status read of every node; where the reads contradict or confirm the
lock's resident, the lock is told (``on_observed``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from google.protobuf import timestamp_pb2

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.orchestrator import config, limits
from tslice.orchestrator.group import effects as decisions
from tslice.orchestrator.group import lock
from tslice.orchestrator.switch import plan as steps

_STATE_PB = {
    "UNKNOWN": opb.GroupStatus.STATE_UNKNOWN,
    "IDLE": opb.GroupStatus.STATE_IDLE,
    "IDLE_YIELDED": opb.GroupStatus.STATE_IDLE_YIELDED,
    "LOCKED": opb.GroupStatus.STATE_LOCKED,
    "SWITCHING": opb.GroupStatus.STATE_SWITCHING,
}

#: A drained group's detail (GroupStatus.draining says it too).
DRAINING = (
    "draining: an administrator stopped new turns (the holder keeps its own, waiters "
    "stay queued); resume with `tslice admin resume`"
)

_JOB_STATE_PB = {
    pb.JOB_STATE_UNSPECIFIED: opb.SnapshotAgentJobState.STATE_UNSPECIFIED,
    pb.JOB_STATE_IDLE: opb.SnapshotAgentJobState.STATE_IDLE,
    pb.JOB_STATE_RUNNING: opb.SnapshotAgentJobState.STATE_RUNNING,
    pb.JOB_STATE_TRANSITIONING: opb.SnapshotAgentJobState.STATE_TRANSITIONING,
    pb.JOB_STATE_SAVED: opb.SnapshotAgentJobState.STATE_SAVED,
    pb.JOB_STATE_FAULTED: opb.SnapshotAgentJobState.STATE_FAULTED,
}


@dataclasses.dataclass
class Health:
    """What a group knows of its nodes beyond the lock (changed by its worker only)."""

    #: Nodes whose agent did not answer (node -> error): the group is UNKNOWN meanwhile.
    unreachable: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Nodes that kept refusing a switch (node -> reason), until an operator clears them.
    degraded: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Why the switch in progress is retrying ("" = it is not).
    switch_detail: str = ""

    def note(self, reads: steps.Reads) -> None:
        """Nodes that answered are reachable, the others are not."""
        for node in reads.views:
            self.unreachable.pop(node, None)
        self.unreachable.update(reads.failed)


def reported_state(
    lk: lock.GroupLock,
    health: Health,
    conflicts: Callable[[], frozenset[str]],
    kept_for: Callable[[str, int], str] = lambda job, seq: "",
    *,
    unsaved: str = "",
) -> tuple[str, str]:
    """The group's state on the wire and its detail; ``conflicts`` names the overlapping
    groups (asked only while the group waits for their devices: this runs every batch);
    ``kept_for(job, set)`` says what the set member the group is kept free for waits for;
    ``unsaved``: why the orchestrator cannot write its state ("" = it can)."""
    if unsaved:
        # What is in memory may not be on disk, and nothing is acted on until it is.
        return "UNKNOWN", f"state not persisted: {unsaved}"
    if health.unreachable:
        return "UNKNOWN", "agents unreachable: " + "; ".join(
            f"{n}: {d}" for n, d in sorted(health.unreachable.items())
        )
    if lk.recovering:
        return "UNKNOWN", "recovering after restart: reading the agents"
    phase = lk.phase()
    if lk.blocked:
        return phase.value, lk.blocked
    if lk.draining and not (phase is lock.Phase.SWITCHING and health.switch_detail):
        return phase.value, DRAINING
    if phase is lock.Phase.SWITCHING:
        return phase.value, health.switch_detail
    if lk.unparkable:
        return phase.value, lk.unparkable
    reserved = lk.reserved_for
    if reserved is not None:
        return phase.value, kept_for(*reserved)
    if not lk.claimed and lk.attached_waiters:
        others = ", ".join(sorted(conflicts()))
        return phase.value, f"waiting for the devices it shares with group(s) {others}"
    return phase.value, lk.detail


class Since:
    """When the reported state last changed (GroupStatus.state_timestamp)."""

    def __init__(self) -> None:
        self.state = ""
        self.ns = time.time_ns()

    def timestamp(self) -> timestamp_pb2.Timestamp:
        stamp = timestamp_pb2.Timestamp()
        stamp.FromNanoseconds(self.ns)
        return stamp


def group_status(
    *,
    group_id: str,
    nodes: tuple[config.NodeRef, ...],
    lk: lock.GroupLock,
    health: Health,
    state: tuple[str, str],
    timestamp: timestamp_pb2.Timestamp,
    loaded_job: str | None,
) -> opb.GroupStatus:
    # A queue of any length answers under the gRPC message limit: the first waiters
    # are listed, the others counted (``waiting_jobs_omitted``).
    waiting = lk.waiting_jobs
    listed = limits.MAX_LISTED_WAITERS
    return opb.GroupStatus(
        group_id=group_id,
        group_state=_STATE_PB[state[0]],
        state_timestamp=timestamp,
        locking_job=lk.holder or "",
        active_job=lk.active_job or "",
        waiter_queue_depth=len(waiting),
        loaded_job=loaded_job or "",
        waiting_jobs=waiting[:listed],
        waiting_jobs_omitted=max(len(waiting) - listed, 0),
        nodes=[n.name for n in nodes],
        grant_epoch=lk.grant_epoch,
        switch_count=lk.switch_count,
        detail=state[1],
        degraded=[opb.DegradedNode(node=n, reason=r) for n, r in sorted(health.degraded.items())],
        draining=lk.draining,
        policy=lk.policy.describe(),
        waiting_since=[_timestamp(t) for t in lk.waiting_since()[:listed]],
    )


def _timestamp(wall_s: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(wall_s * 1e9))
    return stamp


def known_jobs(lk: lock.GroupLock) -> set[str]:
    """Every job the lock knows: holder, resident, the switch's, the waiters."""
    sw = lk.switching
    moving = (sw.from_job, sw.to_job) if sw is not None else ()
    return {j for j in (lk.holder, lk.resident, *moving) if j} | set(lk.waiting_jobs)


def marker(lk: lock.GroupLock) -> tuple[int, int, decisions.StartSwitch | None]:
    """What live reads are compared with: if a switch or a grant happens meanwhile, the
    reads say nothing about the new resident."""
    return (lk.grant_epoch, lk.switch_count, lk.switching)


def observed_resident(
    lk: lock.GroupLock, reads: steps.Reads, *, nodes: int, before: tuple[object, ...]
) -> str | None:
    """The job verified resident by ``reads`` (taken since ``before``); tells the lock."""
    if len(reads.views) != nodes:
        return None
    if lk.switching is not None or marker(lk) != before:
        return lk.loaded_job
    resident = lk.resident
    everywhere = resident is not None and all(
        v.get(resident) is not None and v[resident].state == pb.JOB_STATE_RUNNING
        for v in reads.views.values()
    )
    if everywhere != lk.verified:
        lk.on_observed(epoch=lk.grant_epoch, resident=resident, running_everywhere=everywhere)
    return resident if everywhere else None


def agent_job_states(
    reads: steps.Reads, *, group_id: str, known: set[str]
) -> list[opb.SnapshotAgentJobState]:
    """The group's jobs (and the jobs it knows) as each node that answered reports them."""
    return [
        opb.SnapshotAgentJobState(
            agent=node,
            job_state=_JOB_STATE_PB.get(jv.state, opb.SnapshotAgentJobState.STATE_UNSPECIFIED),
            job_id=job,
        )
        for node, view in reads.views.items()
        for job, jv in sorted(view.items())
        if jv.group == group_id or job in known
    ]
