"""What a timeline draws: runs, each with lock windows per pool, the moves of device state
(snapshots and restores, per node), whole switches, and duty curves per GPU; plus the
pools, the jobs and a summary. Times are seconds from the run's start on the run's own
clock (trace seconds for a recorded or time-compressed run: see ``Timeline.clock``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

SNAPSHOT = "snapshot"
RESTORE = "restore"


@dataclasses.dataclass(frozen=True)
class Window:
    """``job`` held ``pool`` over [t0, t1]."""

    pool: str
    job: str
    t0: float
    t1: float
    #: What the hover text adds (wait, restore, step...).
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Move:
    """A snapshot or restore of ``job``'s state for ``pool`` (on ``node``), over [t0, t1]."""

    pool: str
    job: str
    kind: str
    t0: float
    t1: float
    node: str = ""


@dataclasses.dataclass(frozen=True)
class Switch:
    """A whole switch of ``pool`` from ``from_job`` to ``to_job`` (every node), [t0, t1]."""

    pool: str
    from_job: str
    to_job: str
    t0: float
    t1: float


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    duration_s: float
    windows: Sequence[Window]
    moves: Sequence[Move] = ()
    switches: Sequence[Switch] = ()
    #: GPU label -> [(t, duty percent)], a step curve.
    duty: Sequence[tuple[str, Sequence[tuple[float, float]]]] = ()


@dataclasses.dataclass(frozen=True)
class Pool:
    name: str
    #: Where it is (nodes, GPUs), as shown beside its name.
    where: str = ""


@dataclasses.dataclass(frozen=True)
class Timeline:
    title: str
    pools: Sequence[Pool]
    jobs: Sequence[str]
    runs: Sequence[Run]
    summary: Sequence[tuple[str, str]] = ()
    #: What the time axis counts (e.g. "trace seconds; the demo ran 750x faster").
    clock: str = "seconds"

    @property
    def longest_s(self) -> float:
        return max((r.duration_s for r in self.runs), default=1.0) or 1.0


PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f")
SNAPSHOT_COLOUR = "#c0392b"
RESTORE_COLOUR = "#27ae60"
SWITCH_COLOUR = "#333333"
DUTY_COLOUR = "#6b6ecf"


def colours(jobs: Sequence[str]) -> dict[str, str]:
    """Each job's colour, in the order the jobs are listed."""
    return {job: PALETTE[i % len(PALETTE)] for i, job in enumerate(jobs)}


def duration_text(seconds: float) -> str:
    """A duration as a person reads it: 850 ms, 12.3 s, 4.5 min, 2.0 h."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
