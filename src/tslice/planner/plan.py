"""``tslice plan``: from a recording, which jobs should share which pools.

The recording (a trace or an event log, :mod:`tslice.planner.recording`) gives the
phase model (:mod:`tslice.phases.derive`, the demo's and the benchmark's derivation) and the
per-job profiles (:mod:`tslice.planner.profile`). Planned job ``i`` replays job
``i mod K`` of the recording's K jobs (``jobs``: K unless asked otherwise), with the same
seeded phase draws as the demo and the benchmark. Every grouping is scored by its
predicted throughput gain (:mod:`tslice.planner.search`, with the model of
:mod:`tslice.planner.predict`); the best one is recommended, and
:mod:`tslice.planner.simulate` replays it through the real orchestrator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tslice.phases import derive, trace
from tslice.planner import predict, profile, recording, search

DEFAULT_STEPS = 4
#: RL steps per job at most: prediction and replay grow with them (100 steps of 26 jobs
#: are predicted in about 25 s here; 10**7 never finished).
MAX_STEPS = 100
DEFAULT_ALTERNATIVES = 5
ALONE = "each job alone"
ALL_IN_ONE = "all jobs on one set"


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    source: Path
    #: Jobs to plan for (None: the recording's own); job i replays recorded job i mod K.
    jobs: int | None = None
    steps: int = DEFAULT_STEPS
    seed: int = 0
    #: At most this many sets of pools (None: as many as there are jobs).
    max_sets: int | None = None
    #: At most this many jobs share one set of pools (None: no bound).
    max_share: int | None = None
    alternatives: int = DEFAULT_ALTERNATIVES

    def check(self) -> None:
        if not 1 <= self.steps <= MAX_STEPS:
            raise recording.PlanInputError(
                f"--steps must be between 1 and {MAX_STEPS} (got {self.steps}): a few steps "
                f"show how jobs interleave, the default is {DEFAULT_STEPS}"
            )
        if self.jobs is not None and not 2 <= self.jobs <= 26:
            raise recording.PlanInputError(f"--jobs must be between 2 and 26 (got {self.jobs})")
        if self.max_sets is not None and self.max_sets < 1:
            raise recording.PlanInputError(f"--max-sets must be at least 1 (got {self.max_sets})")
        if self.max_share is not None and self.max_share < 1:
            raise recording.PlanInputError(f"--max-share must be at least 1 (got {self.max_share})")


@dataclasses.dataclass(frozen=True)
class BlockForecast:
    """One block of a grouping as predicted, seconds of the source."""

    jobs: search.Block
    pools: tuple[str, ...]
    makespan_s: float
    gpu_s: float
    #: Pool -> share of the makespan some job of the block held it.
    load: Mapping[str, float]
    switches: Mapping[str, int]
    switching_s: Mapping[str, float]


@dataclasses.dataclass(frozen=True)
class Candidate:
    grouping: search.Grouping
    gain: float
    blocks: tuple[BlockForecast, ...]
    label: str = ""

    @property
    def gpus(self) -> int:
        return sum(len(b.pools) for b in self.blocks)


@dataclasses.dataclass(frozen=True)
class Plan:
    config: PlanConfig
    recording: recording.Recording
    model: trace.PhaseModel
    #: Planned job -> the recorded job it replays.
    replays: Mapping[str, str]
    #: Planned job -> its lanes, model seconds (what predict and simulate both play).
    plans: Mapping[str, predict.Lanes]
    #: Planned job -> alone on pools of its own, seconds of the source.
    solo_s: Mapping[str, float]
    profiles: tuple[profile.JobProfile, ...]
    switch_costs: tuple[profile.SwitchProfile, ...]
    method: str
    considered: int
    recommended: Candidate
    alternatives: tuple[Candidate, ...]

    @property
    def jobs(self) -> tuple[str, ...]:
        return tuple(self.plans)

    def pools_used(self, job: str) -> tuple[str, ...]:
        return shared_pools(self.model, [self.plans[job]])

    @property
    def dedicated_gpu_s(self) -> float:
        """GPU-seconds of the work with every job on pools of its own (the gain's numerator)."""
        return sum(self.solo_s[j] * len(self.pools_used(j)) for j in self.jobs)


def shared_pools(model: trace.PhaseModel, jobs: Sequence[predict.Lanes]) -> tuple[str, ...]:
    """The shared pools the jobs use, in the model's order (a block needs one of each)."""
    used = set().union(*(predict.pools_of(lanes) for lanes in jobs))
    return tuple(p for p in model.shared if p in used)


def load_model(rec: recording.Recording) -> trace.PhaseModel:
    try:
        return derive.model(rec.raw, source=str(rec.path))
    except trace.TraceError as err:
        if rec.kind == recording.TRACE:
            raise
        raise recording.PlanInputError(
            f"event log {rec.path}: the jobs' phases cannot be derived from it ({err}); "
            "record at least two RL steps of every job"
        ) from None


def _check_jobs(rec: recording.Recording, config: PlanConfig) -> None:
    """Grouping needs two jobs: say so before the derivation asks for switch costs."""
    windows = rec.raw["timeslice"].get("windows")
    names = sorted(
        {str(w.get("job")) for items in windows.values() for w in items if isinstance(w, dict)}
        if isinstance(windows, dict)
        else set()
    )
    if len(names) == 1 and config.jobs is None:
        raise recording.PlanInputError(
            f"{rec.kind} {rec.path} has one job ({names[0]}): the planner decides which jobs "
            "share pools, so it needs a recording of at least two jobs (or --jobs N to plan "
            f"for N copies of job {names[0]})"
        )


def _planned_jobs(model: trace.PhaseModel, count: int) -> dict[str, int]:
    """Planned job name -> model job index: the recorded names, then A2, B2, ..."""
    k = len(model.jobs)
    return {
        (model.jobs[i % k].job if i < k else f"{model.jobs[i % k].job}{i // k + 1}"): i
        for i in range(count)
    }


def make_plan(config: PlanConfig) -> Plan:
    """Read the recording, score the groupings and pick the best (see the module doc)."""
    config.check()
    rec = recording.load(config.source)
    _check_jobs(rec, config)
    model = load_model(rec)
    if not model.shared:
        raise recording.PlanInputError(
            f"{rec.kind} {rec.path}: no pool is shared (every job had its own): there is "
            "nothing to group"
        )
    index = _planned_jobs(model, config.jobs or len(model.jobs))
    plans = {
        job: model.job_lanes(steps=config.steps, seed=config.seed + i, index=i)
        for job, i in index.items()
    }
    unit = rec.unit_s
    costs = profile.switches(rec, model)
    overhead = {c.group: c.overhead_s / unit for c in costs}
    forecasts: dict[search.Block, BlockForecast] = {}

    def forecast(block: search.Block) -> BlockForecast:
        if block not in forecasts:
            forecasts[block] = _forecast(model, {j: plans[j] for j in block}, unit, overhead)
        return forecasts[block]

    solo = {job: predict.solo_s(lanes) * unit for job, lanes in plans.items()}
    try:
        searched = search.search(
            list(plans),
            lambda b: forecast(b).gpu_s,
            max_sets=config.max_sets,
            max_share=config.max_share,
        )
    except ValueError as err:
        raise recording.PlanInputError(f"{err}: raise --max-sets or --max-share") from None
    numerator = sum(solo[j] * len(shared_pools(model, [plans[j]])) for j in plans)

    def candidate(grouping: search.Grouping, label: str = "") -> Candidate:
        blocks = tuple(forecast(b) for b in grouping)
        cost = sum(b.gpu_s for b in blocks)
        return Candidate(grouping, numerator / cost if cost else 1.0, blocks, label)

    best = candidate(searched.scored[0][0], "recommended")
    others = [candidate(g) for g, _ in searched.scored[1 : 1 + config.alternatives]]
    references = {
        search.canonical([[j] for j in plans], list(plans)): ALONE,
        search.canonical([list(plans)], list(plans)): ALL_IN_ONE,
    }
    for grouping, label in references.items():
        too_many = config.max_sets is not None and len(grouping) > config.max_sets
        too_big = config.max_share is not None and len(grouping[0]) > config.max_share
        if too_many or too_big:
            continue
        if grouping == best.grouping:
            best = dataclasses.replace(best, label=f"recommended ({label})")
            continue
        others = [c for c in others if c.grouping != grouping]
        others.append(candidate(grouping, label))
    others.sort(key=lambda c: -c.gain)
    return Plan(
        config=config,
        recording=rec,
        model=model,
        plans=plans,
        solo_s=solo,
        replays={job: model.shape(i).job for job, i in index.items()},
        profiles=profile.jobs(rec),
        switch_costs=costs,
        method=searched.method,
        considered=len(searched.scored),
        recommended=best,
        alternatives=tuple(others),
    )


def _forecast(
    model: trace.PhaseModel,
    lanes: Mapping[str, predict.Lanes],
    unit: float,
    overhead: Mapping[str, float] | None = None,
) -> BlockForecast:
    pools = shared_pools(model, list(lanes.values()))
    if len(lanes) == 1:
        (only,) = lanes.values()
        held = {
            p: sum(ph.duration_s for ln in only for st in ln for ph in st if p in ph.pools)
            for p in pools
        }
        zero = dict.fromkeys(pools, 0)
        outcome = predict.Outcome(predict.solo_s(only), held, zero, dict.fromkeys(pools, 0.0))
    else:
        outcome = predict.together(
            lanes,
            switch=model.switch,
            shared=pools,
            slowdown=model.contention,
            overhead_s=overhead,
        )
    span = max(outcome.makespan_s, 1e-12)
    return BlockForecast(
        jobs=tuple(lanes),
        pools=pools,
        makespan_s=outcome.makespan_s * unit,
        gpu_s=outcome.makespan_s * unit * len(pools),
        load={p: outcome.held_s.get(p, 0.0) / span for p in pools},
        switches=dict(outcome.switches),
        switching_s={p: s * unit for p, s in outcome.switching_s.items()},
    )


def to_json(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON document (``tslice plan --json``; simulate adds ``simulated``)."""

    def cand(c: Candidate) -> dict[str, Any]:
        return {
            "label": c.label,
            "grouping": [list(b) for b in c.grouping],
            "predicted_gain": round(c.gain, 4),
            "gpus": c.gpus,
            "blocks": [
                {
                    "jobs": list(b.jobs),
                    "pools": list(b.pools),
                    "makespan_s": round(b.makespan_s, 3),
                    "load": {p: round(v, 4) for p, v in b.load.items()},
                    "switches": dict(b.switches),
                    "switching_s": {p: round(v, 3) for p, v in b.switching_s.items()},
                }
                for b in c.blocks
            ],
        }

    return {
        "source": str(plan.recording.path),
        "format": plan.recording.kind,
        "mode": plan.model.mode,
        "shared_pools": list(plan.model.shared),
        "private_pools": list(plan.model.private),
        "contention": round(plan.model.contention, 4),
        "steps": plan.config.steps,
        "jobs": {
            j: {
                "replays": plan.replays[j],
                "solo_s": round(plan.solo_s[j], 3),
                "pools": list(plan.pools_used(j)),
            }
            for j in plan.jobs
        },
        "profiles": [dataclasses.asdict(p) for p in plan.profiles],
        "switch_costs": [
            dataclasses.asdict(s) | {"overhead_s": round(s.overhead_s, 6)}
            for s in plan.switch_costs
        ],
        "search": {"method": plan.method, "groupings_scored": plan.considered},
        "recommended": cand(plan.recommended),
        "alternatives": [cand(c) for c in plan.alternatives],
    }
