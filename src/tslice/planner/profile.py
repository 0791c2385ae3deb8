"""Per-job phase profiles of a recording: busy and idle time per group, gaps, switch costs.

Read from the recording's lock windows and grants (trace format, see
:mod:`tslice.planner.recording`), in seconds of the source. *Busy* is the time a job
held a group; a *gap* is the time from a yield of a group to the job's next request of
it (it did not need the group: what another job can use); *waiting* (request to grant)
is neither. The duty of a job on a group is its busy share of the time from its first
request to its last yield.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from tslice.phases import trace
from tslice.planner import recording


@dataclasses.dataclass(frozen=True)
class Spread:
    """A distribution of durations, seconds: count, median, 10th and 90th percentile."""

    count: int
    median: float
    p10: float
    p90: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            return cls(0, 0.0, 0.0, 0.0)
        ordered = sorted(values)

        def at(q: float) -> float:
            return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

        return cls(len(ordered), statistics.median(ordered), at(0.1), at(0.9))


@dataclasses.dataclass(frozen=True)
class GroupUse:
    """One job on one group."""

    group: str
    windows: int
    busy_s: float
    duty: float
    hold: Spread
    gap: Spread
    wait: Spread


@dataclasses.dataclass(frozen=True)
class JobProfile:
    job: str
    span_s: float
    groups: tuple[GroupUse, ...]


@dataclasses.dataclass(frozen=True)
class SwitchProfile:
    """A shared group's switch costs, seconds: snapshot, restore, and whole switches."""

    group: str
    snapshot_s: float
    restore_s: float
    switch_done: Spread

    @property
    def overhead_s(self) -> float:
        """What a whole switch (SWITCH_DONE) took beyond a snapshot and a restore."""
        if not self.switch_done.count:
            return 0.0
        return max(self.switch_done.median - self.snapshot_s - self.restore_s, 0.0)


def jobs(rec: recording.Recording) -> tuple[JobProfile, ...]:
    ts: Mapping[str, Any] = rec.raw["timeslice"]
    unit = rec.unit_s
    asked: dict[tuple[str, str, float], float] = {}
    for e in ts.get("events", []):
        if isinstance(e, Mapping) and e.get("kind") == "acquired":
            waited = max(float(e.get("wait_ms", 0)), float(e.get("restore_ms", 0))) / 1000
            asked[(str(e["job"]), str(e["pool"]), float(e["t"]))] = waited
    by_job: dict[str, dict[str, list[tuple[float, float, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    for group, items in ts["windows"].items():
        for w in items:
            t0, t1 = float(w["t0"]), float(w["t1"])
            waited = asked.get((str(w["job"]), group, t0), 0.0)
            by_job[str(w["job"])][group].append((t0 - waited, t0, t1))
    out: list[JobProfile] = []
    for job in sorted(by_job):
        groups = by_job[job]
        first = min(r for spans in groups.values() for r, _, _ in spans)
        last = max(t1 for spans in groups.values() for _, _, t1 in spans)
        span = max(last - first, 1e-9)
        uses = []
        for group in sorted(groups):
            spans = sorted(groups[group], key=lambda s: s[1])
            busy = sum(t1 - t0 for _, t0, t1 in spans)
            gaps = [max(nxt[0] - cur[2], 0.0) for cur, nxt in itertools.pairwise(spans)]
            uses.append(
                GroupUse(
                    group=group,
                    windows=len(spans),
                    busy_s=busy * unit,
                    duty=busy / span,
                    hold=Spread.of([(t1 - t0) * unit for _, t0, t1 in spans]),
                    gap=Spread.of([g * unit for g in gaps]),
                    wait=Spread.of([(t0 - r) * unit for r, t0, _ in spans]),
                )
            )
        out.append(JobProfile(job=job, span_s=span * unit, groups=tuple(uses)))
    return tuple(out)


def switches(rec: recording.Recording, model: trace.PhaseModel) -> tuple[SwitchProfile, ...]:
    return tuple(
        SwitchProfile(
            group=pool,
            snapshot_s=cost.snapshot.median * rec.unit_s,
            restore_s=cost.restore.median * rec.unit_s,
            switch_done=Spread.of(list(rec.switch_done_s.get(pool, ()))),
        )
        for pool, cost in model.switch.items()
    )
