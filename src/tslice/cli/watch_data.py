"""What ``tslice watch`` shows, gathered from the orchestrator: no drawing here.

Two sources feed one :class:`WatchData` (from a background thread; the terminal reads a
:class:`View` of it at any time): every group's status, polled (all groups at once, so a
slow link costs one round trip a poll, not one per group), and the event stream, which
starts with the last minutes of the orchestrator's history and then follows live. The
events give what a status does not: when the holder got the group, each node's progress
in the switch under way, and the recent events themselves.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import threading
import time
from collections.abc import Sequence

import tslice.client as tsclient

Kind = tsclient.EventKind

#: Recent events kept for the view.
RECENT = 200


@dataclasses.dataclass(frozen=True)
class NodeProgress:
    node: str
    #: Seconds the node's snapshot / restore took; None: not done yet.
    snapshot_s: float | None = None
    restore_s: float | None = None


@dataclasses.dataclass(frozen=True)
class SwitchProgress:
    group: str
    from_job: str
    to_job: str
    running_s: float
    nodes: tuple[NodeProgress, ...]
    #: Why it is retrying ("" = it is not).
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class GroupRow:
    group: str
    state: str
    holder: str
    #: Seconds the holder has held the group (None: nobody holds, or unknown).
    held_s: float | None
    waiting: int
    policy: str
    switches: int
    detail: str
    draining: bool


@dataclasses.dataclass(frozen=True)
class Waiter:
    group: str
    position: int
    job: str
    #: Seconds waited so far (None: unknown, from an older orchestrator).
    waited_s: float | None


@dataclasses.dataclass(frozen=True)
class Degraded:
    group: str
    node: str
    reason: str


@dataclasses.dataclass(frozen=True)
class View:
    address: str
    transport: str
    groups: tuple[GroupRow, ...]
    waiters: tuple[Waiter, ...]
    switches: tuple[SwitchProgress, ...]
    degraded: tuple[Degraded, ...]
    events: tuple[tsclient.OrchestratorEvent, ...]
    #: Seconds since the last complete poll (None: none yet).
    age_s: float | None
    #: Why the last poll or the event stream failed ("" = they did not).
    problem: str


@dataclasses.dataclass
class _Switch:
    from_job: str
    to_job: str
    started: float
    nodes: dict[str, NodeProgress]


class WatchData:
    """Status polls and events in, a :class:`View` out; safe across threads."""

    def __init__(self, *, address: str, transport: str) -> None:
        self._address, self._transport = address, transport
        self._lock = threading.Lock()
        self._statuses: dict[str, tsclient.GroupStatus] = {}
        self._polled_at: float | None = None
        self._granted_at: dict[str, tuple[str, float]] = {}
        self._switches: dict[str, _Switch] = {}
        self._events: collections.deque[tsclient.OrchestratorEvent] = collections.deque(
            maxlen=RECENT
        )
        self.poll_problem = ""
        self.stream_problem = ""

    def polled(self, statuses: Sequence[tsclient.GroupStatus], *, at: float) -> None:
        with self._lock:
            self._statuses = {s.group_id: s for s in statuses}
            self._polled_at = at
            self.poll_problem = ""

    def event(self, event: tsclient.OrchestratorEvent) -> None:
        when = event.time.timestamp() if event.time is not None else time.time()
        with self._lock:
            self._events.append(event)
            gid = event.group_id
            if event.kind == Kind.GRANTED and event.detail != "already held":
                self._granted_at[gid] = (event.job_id, when)
                self._switches.pop(gid, None)
            elif event.kind in (Kind.YIELDED, Kind.CANCELLED):
                held = self._granted_at.get(gid)
                if held is not None and held[0] == event.job_id:
                    del self._granted_at[gid]
            elif event.kind == Kind.SWITCH_STARTED:
                self._switches[gid] = _Switch(event.from_job, event.job_id, when, {})
            elif event.kind in (Kind.SNAPSHOT_DONE, Kind.RESTORE_DONE):
                sw = self._switches.get(gid)
                if sw is not None and event.node:
                    node = sw.nodes.get(event.node, NodeProgress(event.node))
                    took = event.duration_ms / 1000
                    sw.nodes[event.node] = (
                        dataclasses.replace(node, snapshot_s=took)
                        if event.kind == Kind.SNAPSHOT_DONE
                        else dataclasses.replace(node, restore_s=took)
                    )
            elif event.kind == Kind.SWITCH_DONE or (
                event.kind == Kind.SWITCH_FAILED and not event.node
            ):
                self._switches.pop(gid, None)

    def view(self, *, now: float | None = None) -> View:
        now = time.time() if now is None else now
        with self._lock:
            statuses = sorted(self._statuses.values(), key=lambda s: s.group_id)
            groups = tuple(self._group_row(s, now) for s in statuses)
            waiters = tuple(
                Waiter(s.group_id, i + 1, job, _since(s, i, now))
                for s in statuses
                for i, job in enumerate(s.waiting_jobs)
            )
            # SWITCHING, or a switch the events say is under way (a group whose agent
            # does not answer is UNKNOWN meanwhile).
            switches = tuple(
                self._progress(s, now)
                for s in statuses
                if s.group_state == tsclient.GroupState.SWITCHING or s.group_id in self._switches
            )
            degraded = tuple(
                Degraded(s.group_id, d.node, d.reason) for s in statuses for d in s.degraded
            )
            problem = self.poll_problem or self.stream_problem
            return View(
                address=self._address,
                transport=self._transport,
                groups=groups,
                waiters=waiters,
                switches=switches,
                degraded=degraded,
                events=tuple(self._events),
                age_s=None if self._polled_at is None else max(now - self._polled_at, 0.0),
                problem=problem,
            )

    def _group_row(self, s: tsclient.GroupStatus, now: float) -> GroupRow:
        held_s: float | None = None
        if s.locking_job:
            granted = self._granted_at.get(s.group_id)
            if granted is not None and granted[0] == s.locking_job:
                held_s = now - granted[1]
            elif s.group_state == tsclient.GroupState.LOCKED and s.state_timestamp is not None:
                held_s = now - s.state_timestamp.timestamp()
        return GroupRow(
            group=s.group_id,
            state=s.group_state.value,
            holder=s.locking_job,
            held_s=None if held_s is None else max(held_s, 0.0),
            waiting=s.waiter_queue_depth,
            policy=s.policy,
            switches=s.switch_count,
            detail=s.detail,
            draining=s.draining,
        )

    def _progress(self, s: tsclient.GroupStatus, now: float) -> SwitchProgress:
        sw = self._switches.get(s.group_id)
        nodes = tuple(
            (sw.nodes.get(n) if sw is not None else None) or NodeProgress(n) for n in s.nodes
        )
        if sw is None:  # begun before the stream: the status says who comes in
            since = s.state_timestamp.timestamp() if s.state_timestamp is not None else now
            return SwitchProgress(s.group_id, "", s.active_job, now - since, nodes, s.detail)
        return SwitchProgress(s.group_id, sw.from_job, sw.to_job, now - sw.started, nodes, s.detail)


def _since(s: tsclient.GroupStatus, index: int, now: float) -> float | None:
    if index >= len(s.waiting_since):
        return None
    started: datetime.datetime = s.waiting_since[index]
    return max(now - started.timestamp(), 0.0)
