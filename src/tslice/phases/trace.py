"""Phase model of RL jobs, derived from a recorded run (see :mod:`tslice.phases.derive`).

A recorded run (``shared/traces/*.json``) holds, for RL jobs time-sliced on GPU pools,
every lock window per pool (``timeslice.windows.<pool>``: ``t0``, ``t1``, ``job``),
every acquire (with its wait and restore time and the RL step), yield, checkpoint and
restore (``timeslice.events``), the per-GPU duty curves of a baseline run in which
one job had its GPUs to itself (``baseline.duty_gpus``), and the run's own summary.

The model has, per job of the trace, its *lanes*: sequences of phases that repeat
every RL step, each phase holding a set of pools (none: CPU only) for a measured
duration. A synchronous job has one lane (its phases follow each other); a fully
asynchronous job has one lane per pool it uses (generation and training run at the
same time). Pools used by several jobs one at a time are *shared*: they switch, and
their snapshot and restore times are measured. Pools that each job had to itself
(windows of different jobs overlap there, or only one job uses it) are *private*:
they never switch. Durations are stored uncontended (measured / contention, see
:mod:`tslice.phases.derive`); nothing is typed in from the trace's summary, whose
numbers are kept only to be shown next to what the simulation measures.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import random
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from tslice.common import errors

# The default trace's pools (kept for callers that only know that trace).
SAMPLER = "sampler"
TRAINER = "trainer"
POOLS = (SAMPLER, TRAINER)
TRACE_NAME = "verl-sync-2xH100.json"
SYNC = "sync"
ASYNC = "async"

# A jittered phase stays within this share of its median, so a rare draw from the
# tails cannot produce a negative or absurdly long phase.
_JITTER_CLAMP = 0.5


class TraceError(errors.ConfigError):
    """A trace lacks something the phase model needs; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Stat:
    """A measured duration: median, robust spread (1.4826 x MAD) and sample count."""

    median: float
    spread: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stat:
        if not values:
            raise ValueError("no samples")
        median = statistics.median(values)
        mad = statistics.median(abs(v - median) for v in values)
        return cls(median=median, spread=1.4826 * mad, count=len(values))

    def draw(self, rng: random.Random) -> float:
        """A normal draw around the median, clamped to +/- 50 % of it."""
        value = rng.gauss(self.median, self.spread)
        low, high = self.median * (1 - _JITTER_CLAMP), self.median * (1 + _JITTER_CLAMP)
        return min(max(value, low), high)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One stretch of a step: ``pools`` held for ``duration_s`` trace seconds (() = CPU only)."""

    name: str
    pools: tuple[str, ...]
    duration_s: float


@dataclasses.dataclass(frozen=True)
class PhaseStat:
    """A phase of a job's step as measured: the pools it holds and how long (contended)."""

    name: str
    pools: tuple[str, ...]
    stat: Stat


#: One lane of one job: steps, each a list of phases.
LanePlan = list[list[Phase]]


@dataclasses.dataclass(frozen=True)
class JobShape:
    """What one job of the trace does every step, lane by lane."""

    job: str
    lanes: tuple[tuple[PhaseStat, ...], ...]
    #: RL steps the job ran in the trace (its first, model-loading step included).
    recorded_steps: int

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(sorted({p for lane in self.lanes for ph in lane for p in ph.pools}))

    @property
    def cycle_s(self) -> float:
        """Contended seconds of one step: the longest lane (lanes run at the same time)."""
        return max(sum(ph.stat.median for ph in lane) for lane in self.lanes)

    def phase(self, name: str) -> PhaseStat:
        for lane in self.lanes:
            for ph in lane:
                if ph.name == name:
                    return ph
        raise KeyError(f"job {self.job} has no phase {name!r}")


@dataclasses.dataclass(frozen=True)
class SwitchCost:
    """Recorded device-state move times of one pool, in trace seconds."""

    snapshot: Stat
    restore: Stat

    @property
    def switch_s(self) -> float:
        """A full hand-over moves one job off (snapshot) and the next one on (restore)."""
        return self.snapshot.median + self.restore.median


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The trace's own summary, shown beside the simulated results (never used by them)."""

    speedup: float
    duty_baseline_pct: float
    duty_time_sliced_pct: float
    baseline_min: float
    time_sliced_min: float
    switches: int
    #: GPUs of the baseline and of the time-sliced run (equal: compare makespans).
    gpus_baseline: int = 0
    gpus_time_sliced: int = 0


@dataclasses.dataclass(frozen=True)
class PhaseModel:
    """Jobs' phases, shared and private pools, switch costs, and the calibration behind them."""

    source: str
    mode: str
    #: Every pool, shared ones first, in the trace's order (``pool_map``, else windows).
    pools: tuple[str, ...]
    private: tuple[str, ...]
    jobs: tuple[JobShape, ...]
    #: Recorded snapshot/restore of each shared pool.
    switch: Mapping[str, SwitchCost]
    #: Step period of one job alone (baseline duty curves), None without a baseline.
    baseline_step_s: float | None
    contention: float
    recorded: Recorded

    @property
    def shared(self) -> tuple[str, ...]:
        return tuple(p for p in self.pools if p not in self.private)

    @property
    def recorded_steps(self) -> int:
        return min(shape.recorded_steps for shape in self.jobs)

    @property
    def contended_step_s(self) -> float:
        return statistics.median(shape.cycle_s for shape in self.jobs)

    def shape(self, index: int) -> JobShape:
        """The trace job that simulated job ``index`` replays (round robin over the trace's)."""
        return self.jobs[index % len(self.jobs)]

    def job_lanes(
        self, *, steps: int, seed: int, index: int = 0, jitter: bool = True
    ) -> list[LanePlan]:
        """Phases of simulated job ``index`` running alone (uncontended), lane by lane.

        The same ``seed`` gives the same phases, so an exclusive and a time-sliced run
        of a job do exactly the same work.
        """
        if steps < 1:
            raise ValueError(f"steps must be at least 1 (got {steps})")
        rng = random.Random(seed)
        shape = self.shape(index)

        def duration(stat: Stat) -> float:
            value = stat.draw(rng) if jitter else stat.median
            return value / self.contention

        return [
            [[Phase(ph.name, ph.pools, duration(ph.stat)) for ph in lane] for _ in range(steps)]
            for lane in shape.lanes
        ]

    def job_steps(self, *, steps: int, seed: int, index: int = 0, jitter: bool = True) -> LanePlan:
        """The one lane of a synchronous job (see :meth:`job_lanes`)."""
        lanes = self.job_lanes(steps=steps, seed=seed, index=index, jitter=jitter)
        if len(lanes) != 1:
            raise ValueError(f"job {self.shape(index).job} runs {len(lanes)} lanes at once")
        return lanes[0]


def default_trace_path() -> Path:
    """The repository's ``shared/traces`` copy if present, else the one shipped in the package."""
    repo_root = Path(__file__).resolve().parents[3]
    shared = repo_root.parent / "shared" / "traces" / TRACE_NAME
    if shared.is_file():
        return shared
    return Path(str(importlib.resources.files("tslice.phases") / "traces" / TRACE_NAME))
