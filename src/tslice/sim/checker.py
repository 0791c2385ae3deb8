"""Mutual-exclusion checker: replays simulated-device journals against client windows.

Evidence comes from two independent sides. The simulated devices journal every
allocation and release (``tslice.agent.backends.simdevice``, one file per agent), and
the jobs record every acquire window ``[acquired, yielded]`` they saw. The checker proves:

1. ``overlap``: on each node, device and group, no two jobs are ever allocated at once;
2. ``not_resident``: during every window of job J on group G, J's state *for G* is
   allocated on every device of every node of G (it was restored *before* acquire
   returned and snapshotted only *after* the yield; residency is per (job, group), so
   a switch on another group that moved J's state for G shows up here). A window that
   ends where it begins is empty (a process of J yielded before another one's answer
   came) and holds nothing to check;
3. ``acquire_not_returned``: every acquire returned;
4. ``double_holder``: no two jobs' windows on one group overlap (the client-side view
   of rule 1, with a clearer message);
5. ``shared_holders``: no two jobs hold groups that share devices at the same time
   (``conflicts``: which groups share devices; one job may hold several).

Times in messages are seconds since the earliest timestamp seen, so they line up
with the timeline.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Protocol

from tslice.agent.backends import simdevice

OVERLAP = "overlap"
NOT_RESIDENT = "not_resident"
ACQUIRE_NOT_RETURNED = "acquire_not_returned"
DOUBLE_HOLDER = "double_holder"
SHARED_HOLDERS = "shared_holders"


class AcquireWindow(Protocol):
    """What a job saw: it asked at ``requested``, held ``[acquired, yielded]``."""

    @property
    def job(self) -> str: ...
    @property
    def group(self) -> str: ...
    @property
    def requested(self) -> float: ...
    @property
    def acquired(self) -> float | None: ...
    @property
    def yielded(self) -> float | None: ...
    @property
    def error(self) -> str: ...


@dataclasses.dataclass
class Window:
    """An :class:`AcquireWindow` a test or a run fills in as the job goes."""

    job: str
    group: str
    requested: float
    acquired: float | None = None
    yielded: float | None = None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    message: str
    group: str
    node: str = ""
    jobs: tuple[str, ...] = ()
    t: float = 0.0

    @classmethod
    def of_window(
        cls, w: AcquireWindow, kind: str, message: str, *, t: float | None = None, node: str = ""
    ) -> Violation:
        """A violation of one job's window: it names that job and group, at ``t``
        (default: when the job asked)."""
        at = w.requested if t is None else t
        return cls(kind=kind, message=message, group=w.group, node=node, jobs=(w.job,), t=at)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


@dataclasses.dataclass
class _Interval:
    start: float
    end: float = math.inf


_Slot = tuple[str, str, str]  # (node, group, device)


def check(
    *,
    journal: Iterable[simdevice.Event],
    windows: Iterable[AcquireWindow],
    group_nodes: Mapping[str, Collection[str]] | None = None,
    conflicts: Mapping[str, Collection[str]] | None = None,
    tolerance_s: float = 0.0,
) -> list[Violation]:
    """Every violation found, in time order; an empty list means the run was exclusive.

    ``group_nodes`` names the nodes of each group; without it, the nodes that
    journaled anything for the group are taken. ``conflicts`` names, for each group,
    the groups that share its devices; without it, groups that share a node (a
    simulated node's jobs occupy all of its devices). ``tolerance_s`` forgives clock
    skew between processes (0 on one machine: everyone reads the same clock).
    """
    events = sorted(journal, key=lambda e: e.t)
    wins = list(windows)
    origin = min(
        [e.t for e in events] + [w.requested for w in wins],
        default=0.0,
    )

    def at(t: float) -> str:
        return f"t=+{t - origin:.3f}s"

    violations: list[Violation] = []
    intervals, overlaps = _replay(events, at)
    violations.extend(overlaps)

    nodes_of: dict[str, set[str]] = defaultdict(set)
    devices_of: dict[tuple[str, str], set[str]] = defaultdict(set)
    for node, group, dev in intervals:
        nodes_of[group].add(node)
        devices_of[(node, group)].add(dev)
    if group_nodes is not None:
        nodes_of = defaultdict(set, {g: set(ns) for g, ns in group_nodes.items()})

    for w in wins:
        if w.acquired is None:
            why = f": {w.error}" if w.error else ""
            violations.append(
                Violation.of_window(
                    w,
                    ACQUIRE_NOT_RETURNED,
                    f"acquire of group {w.group} by job {w.job} asked at "
                    f"{at(w.requested)} never returned{why}",
                )
            )
            continue
        if w.yielded is not None and w.yielded <= w.acquired:
            # Ended as it began: the job (another of its processes) had let go before
            # this answer reached it, so the window holds no instant to check.
            continue
        violations.extend(
            _check_covered(
                w,
                w.acquired,
                nodes_of=nodes_of,
                devices_of=devices_of,
                intervals=intervals,
                tolerance_s=tolerance_s,
                at=at,
            )
        )

    violations.extend(_double_holders(wins, tolerance_s, at))
    if conflicts is None:
        conflicts = {
            g: {o for o, ons in nodes_of.items() if o != g and ons & ns}
            for g, ns in nodes_of.items()
        }
    violations.extend(_shared_holders(wins, conflicts, tolerance_s, at))
    violations.sort(key=lambda v: v.t)
    return violations


def _shared_holders(
    wins: Sequence[AcquireWindow],
    conflicts: Mapping[str, Collection[str]],
    tolerance_s: float,
    at: _Fmt,
) -> list[Violation]:
    held = [
        (w.acquired, w.yielded if w.yielded is not None else math.inf, w.job, w.group)
        for w in wins
        if w.acquired is not None
    ]
    held.sort()
    found: list[Violation] = []
    for i, (start, end, job, group) in enumerate(held):
        for start2, end2, job2, group2 in held[i + 1 :]:
            if start2 >= end - tolerance_s:
                break
            if job2 == job or group2 not in conflicts.get(group, ()):
                continue
            if end2 > start + tolerance_s:
                found.append(
                    Violation(
                        kind=SHARED_HOLDERS,
                        message=f"job {job2} acquired group {group2} at {at(start2)} while "
                        f"job {job} held group {group} (until {_end(_Interval(start, end), at)})"
                        ", and the two groups share devices",
                        group=group2,
                        jobs=(job, job2),
                        t=start2,
                    )
                )
    return found


def _replay(
    events: Sequence[simdevice.Event], at: _Fmt
) -> tuple[dict[_Slot, dict[str, list[_Interval]]], list[Violation]]:
    intervals: dict[_Slot, dict[str, list[_Interval]]] = defaultdict(lambda: defaultdict(list))
    open_now: dict[_Slot, dict[str, _Interval]] = defaultdict(dict)
    found: list[Violation] = []
    for e in events:
        slot = (e.node, e.group, e.device)
        resident = open_now[slot]
        if e.event == "alloc":
            if e.job in resident:
                continue
            for other, since in sorted(resident.items()):
                found.append(
                    Violation(
                        kind=OVERLAP,
                        message=f"{e.node}/{e.device} group {e.group}: job {e.job} was "
                        f"allocated at {at(e.t)} while job {other} was still resident "
                        f"(since {at(since.start)})",
                        group=e.group,
                        node=e.node,
                        jobs=(other, e.job),
                        t=e.t,
                    )
                )
            interval = _Interval(start=e.t)
            resident[e.job] = interval
            intervals[slot][e.job].append(interval)
        elif e.event == "free" and e.job in resident:
            resident.pop(e.job).end = e.t
    return intervals, found


class _Fmt(Protocol):
    def __call__(self, t: float, /) -> str: ...


def _check_covered(
    w: AcquireWindow,
    acquired: float,
    *,
    nodes_of: Mapping[str, set[str]],
    devices_of: Mapping[tuple[str, str], set[str]],
    intervals: Mapping[_Slot, Mapping[str, list[_Interval]]],
    tolerance_s: float,
    at: _Fmt,
) -> list[Violation]:
    until = w.yielded if w.yielded is not None else acquired
    nodes = sorted(nodes_of.get(w.group, set()))
    if not nodes:
        return [
            Violation.of_window(
                w,
                NOT_RESIDENT,
                f"job {w.job} held group {w.group} from {at(acquired)} but no "
                "simulated node journaled anything for that group",
                t=acquired,
            )
        ]
    found: list[Violation] = []
    for node in nodes:
        devices = sorted(devices_of.get((node, w.group), set())) or ["(any device)"]
        for dev in devices:
            spans = intervals.get((node, w.group, dev), {}).get(w.job, [])
            covered = any(
                s.start <= acquired + tolerance_s and s.end >= until - tolerance_s for s in spans
            )
            if covered:
                continue
            seen = ", ".join(f"[{at(s.start)}, {_end(s, at)}]" for s in spans) or "never"
            found.append(
                Violation.of_window(
                    w,
                    NOT_RESIDENT,
                    f"job {w.job} held group {w.group} over [{at(acquired)}, "
                    f"{at(until)}] but was not resident on {node}/{dev} the whole time "
                    f"(resident: {seen})",
                    t=acquired,
                    node=node,
                )
            )
    return found


def _end(interval: _Interval, at: _Fmt) -> str:
    return "still resident" if math.isinf(interval.end) else at(interval.end)


def _double_holders(wins: Sequence[AcquireWindow], tolerance_s: float, at: _Fmt) -> list[Violation]:
    by_group: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    for w in wins:
        if w.acquired is not None:
            end = w.yielded if w.yielded is not None else math.inf
            by_group[w.group].append((w.acquired, end, w.job))
    found: list[Violation] = []
    for group, spans in by_group.items():
        spans.sort()
        holder_end, holder = -math.inf, ""
        for start, end, job in spans:
            if job != holder and start < holder_end - tolerance_s:
                found.append(
                    Violation(
                        kind=DOUBLE_HOLDER,
                        message=f"group {group}: job {job} acquired at {at(start)} while "
                        f"job {holder} still held it (until {at(holder_end)})",
                        group=group,
                        jobs=(holder, job),
                        t=start,
                    )
                )
            if end > holder_end:
                holder_end, holder = end, job
    return found
