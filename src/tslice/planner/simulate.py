"""The recommendation replayed through the real orchestrator: the *simulated* gain.

The replay of the demo and the benchmark (:mod:`tslice.phases.replay`): an orchestrator
and one sim agent per pool of each block with several jobs (a :class:`replay.Site` per
block, its groups prefixed ``p1-``, ``p2-``, ...), each agent copying at the speed that
makes a snapshot and a restore take the recording's medians. The jobs play the very
phases the prediction played (:attr:`Plan.plans`); a block's jobs run at once, and every
job also runs alone on pools of its own (no orchestrator: its solo time). All of it at
once, time-compressed: ``time_scale`` model seconds per wall second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tslice.client as tsclient
from tslice.phases import measure, replay
from tslice.planner import plan as planning

#: Wall seconds the longest predicted run should last when no time scale is given.
TARGET_WALL_S = 8.0
#: Fixed cost of every simulated copy, wall seconds.
SIM_LATENCY_S = 0.0002


@dataclasses.dataclass(frozen=True)
class Simulated:
    """What the replay measured, seconds of the source."""

    gain: float
    #: Block (its jobs joined by "+") -> makespan.
    makespan_s: Mapping[str, float]
    solo_s: Mapping[str, float]
    switches: Mapping[str, int]
    errors: tuple[str, ...]
    #: Seconds of the recording per wall second the replay ran at, and its wall time.
    time_scale: float
    wall_s: float


def default_time_scale(plan: planning.Plan) -> float:
    """So that the longest predicted run (a block or a job alone) takes ~TARGET_WALL_S, but
    never slower than the recording ran (an already compressed demo log replays at 1x)."""
    unit = plan.recording.unit_s
    longest = max([b.makespan_s for b in plan.recommended.blocks] + list(plan.solo_s.values()))
    return max(longest / TARGET_WALL_S, 1.0) / unit


def block_name(block: tuple[str, ...]) -> str:
    return "+".join(block)


def run(plan: planning.Plan, *, time_scale: float | None = None) -> Simulated:
    """Replay the recommendation; ``time_scale``: seconds of the recording per wall second
    (None: :func:`default_time_scale`)."""
    scale = time_scale / plan.recording.unit_s if time_scale else default_time_scale(plan)
    return asyncio.run(_run(plan, scale))


async def _run(plan: planning.Plan, time_scale: float) -> Simulated:
    began = time.time()
    model = plan.model
    sizes = replay.footprints(model)
    blocks = [b for b in plan.recommended.grouping if len(b) > 1]
    speeds = replay.recorded_speeds(model, sizes, time_scale=time_scale, latency_s=SIM_LATENCY_S)
    sites = [replay.Site(speeds, prefix=f"p{i}-") for i in range(1, len(blocks) + 1)]

    def runner(address: str, events: Sequence[Any], site: replay.Site | None) -> replay.Runner:
        return replay.Runner(
            model=model,
            plans=plan.plans,
            address=address,
            time_scale=time_scale,
            footprints=sizes,
            events=events,
            groups=site.groups(model) if site is not None else None,
        )

    async def everything(address: str, events: Sequence[Any]) -> list[measure.RunSummary]:
        alone = [
            runner(address, events, None).run(
                f"solo {job}", [job], together=False, contention=1.0, dedicated=True
            )
            for job in plan.jobs
        ]
        together = [
            runner(address, events, site).run(
                block_name(block), list(block), together=True, contention=model.contention
            )
            for block, site in zip(blocks, sites, strict=True)
        ]
        return list(await asyncio.gather(*alone, *together))

    seen: Sequence[tsclient.OrchestratorEvent] = ()
    if blocks:
        with tempfile.TemporaryDirectory(prefix="tslice-plan-") as tmp:
            local = replay.make_cluster(model, sites, base_dir=Path(tmp))
            await asyncio.to_thread(local.start)
            try:
                async with replay.watching(local.orchestrator_address) as events:
                    results = await everything(local.orchestrator_address, events)
                    seen = list(events)
            finally:
                await asyncio.to_thread(local.stop)
    else:
        results = await everything("", ())
    switches = {
        block_name(block): _switches(seen, site.prefix)
        for block, site in zip(blocks, sites, strict=True)
    }
    return _measured(plan, results, switches, time_scale, time.time() - began)


def _switches(events: Sequence[tsclient.OrchestratorEvent], prefix: str) -> int:
    """Hand-overs from one job to another on the groups of one site."""
    return sum(
        1
        for e in events
        if e.kind == tsclient.EventKind.SWITCH_DONE
        and e.group_id.startswith(prefix)
        and e.from_job
        and e.from_job != e.job_id
    )


def _measured(
    plan: planning.Plan,
    results: Sequence[measure.RunSummary],
    switches: Mapping[str, int],
    time_scale: float,
    wall_s: float,
) -> Simulated:
    to_source = time_scale * plan.recording.unit_s
    solo = {job: run.makespan_s * to_source for job, run in zip(plan.jobs, results, strict=False)}
    shared = {run.name: run for run in results[len(plan.jobs) :]}
    makespan: dict[str, float] = {}
    gpu_s = 0.0
    for block in plan.recommended.grouping:
        name = block_name(block)
        seconds = shared[name].makespan_s * to_source if name in shared else solo[block[0]]
        makespan[name] = seconds
        gpu_s += seconds * len(planning.shared_pools(plan.model, [plan.plans[j] for j in block]))
    dedicated = sum(solo[j] * len(plan.pools_used(j)) for j in plan.jobs)
    return Simulated(
        gain=dedicated / gpu_s if gpu_s else 1.0,
        makespan_s=makespan,
        solo_s=solo,
        switches=switches,
        errors=tuple(e for run in results for e in run.errors),
        time_scale=time_scale * plan.recording.unit_s,
        wall_s=wall_s,
    )
