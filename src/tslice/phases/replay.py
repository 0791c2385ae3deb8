"""A phase model replayed on a real local cluster: nodes, copy speeds, runs and bounds.

Shared by the demo and ``bench/trace_replay.py``. Each shared pool of the model is one
orchestrator group on one simulated node (``node-a``, ``node-b``, ... in the model's
pool order); a private pool has no node: each job has its own, which nobody else can
hold, so its phases are played without asking the orchestrator. Simulated jobs
(:mod:`tslice.phases.rljob`) replay the trace's jobs round robin (job ``i`` plays trace job
``i mod K``), at ``time_scale`` trace seconds per wall-clock second.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import string
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

import tslice.client as tsclient
from tslice.agent.backends import simdevice as device
from tslice.common import errors
from tslice.phases import measure, rljob, trace
from tslice.sim import cluster

GiB = device.GiB
#: Device bytes a job holds on a pool's node while resident (the default trace's pools;
#: any other pool: DEFAULT_FOOTPRINT). Two jobs never fit one 80 GiB device together.
FOOTPRINTS = {trace.SAMPLER: 60 * GiB, trace.TRAINER: 70 * GiB}
DEFAULT_FOOTPRINT = 60 * GiB
DEFAULT_CAPACITY = 80 * GiB

#: Simulated job -> its lanes (each a list of steps of phases), trace seconds.
Plans = Mapping[str, Sequence[Sequence[Sequence[trace.Phase]]]]


def job_ids(count: int) -> list[str]:
    if not 1 <= count <= len(string.ascii_uppercase):
        raise ValueError(f"between 1 and 26 jobs (got {count})")
    return list(string.ascii_uppercase[:count])


def nodes(model: trace.PhaseModel, prefix: str = "") -> dict[str, str]:
    """Shared pool -> the simulated node that carries its group."""
    return {
        pool: f"{prefix}node-{string.ascii_lowercase[i]}" for i, pool in enumerate(model.shared)
    }


@dataclasses.dataclass(frozen=True)
class Site:
    """One sim node per shared pool, copying at ``speeds`` (+ ``extra_latency_s`` per copy,
    wall seconds); its groups are ``prefix + pool``, its nodes ``prefix + node-a``, ...
    Several sites in one cluster replay several configurations with one orchestrator."""

    speeds: Mapping[str, device.CopySpeed]
    prefix: str = ""
    extra_latency_s: float = 0.0
    #: Per shared pool, further sim-backend settings of its node (how switches move
    #: state: ``chunks``, ``overlap``, ``prefetch``, ``suspend_mode``; see the sim backend).
    sim_settings: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
    #: Memory per simulated device (None: the cluster's capacity).
    capacity_bytes: int | None = None

    def groups(self, model: trace.PhaseModel) -> dict[str, str]:
        return {pool: f"{self.prefix}{pool}" for pool in model.shared}

    def group_nodes(self, model: trace.PhaseModel) -> dict[str, list[str]]:
        """Group -> its nodes, as the mutual-exclusion checker wants them."""
        node_of = nodes(model, self.prefix)
        return {f"{self.prefix}{pool}": [node] for pool, node in node_of.items()}


def footprints(model: trace.PhaseModel, given: Mapping[str, int] | None = None) -> dict[str, int]:
    """Device bytes per pool: ``given``, else :data:`FOOTPRINTS`, else the default."""
    given = given or {}
    return {p: given.get(p, FOOTPRINTS.get(p, DEFAULT_FOOTPRINT)) for p in model.pools}


def recorded_speeds(
    model: trace.PhaseModel, sizes: Mapping[str, int], *, time_scale: float, latency_s: float
) -> dict[str, device.CopySpeed]:
    """Per shared pool, the sim copy speed that makes a snapshot and a restore of its
    footprint take the recorded medians (scaled, latency included)."""
    return {
        pool: device.CopySpeed.matching(
            bytes_per_device=sizes[pool],
            snapshot_s=model.switch[pool].snapshot.median / time_scale,
            restore_s=model.switch[pool].restore.median / time_scale,
            latency_s=latency_s,
        )
        for pool in model.shared
    }


def link_speeds(
    model: trace.PhaseModel, *, bandwidth_bytes_per_s: float, time_scale: float, latency_s: float
) -> dict[str, device.CopySpeed]:
    """Every shared pool copying at one physical rate, both directions, time-compressed."""
    rate = max(int(bandwidth_bytes_per_s * time_scale), 1)
    return {
        pool: device.CopySpeed(bandwidth_bytes_per_s=rate, latency_s=latency_s)
        for pool in model.shared
    }


def plans(
    model: trace.PhaseModel, *, jobs: int, steps: int, seed: int
) -> dict[str, list[list[list[trace.Phase]]]]:
    """Uncontended phases of each simulated job; job ``i`` draws with ``seed + i``."""
    return {
        job: model.job_lanes(steps=steps, seed=seed + i, index=i)
        for i, job in enumerate(job_ids(jobs))
    }


def make_cluster(
    model: trace.PhaseModel,
    sites: Sequence[Site],
    *,
    base_dir: Path | None,
    capacity_bytes: int = DEFAULT_CAPACITY,
    log_level: str = "warning",
) -> cluster.LocalCluster:
    """An orchestrator and, for each site, one sim agent per shared pool (not started)."""
    agents: list[cluster.SimAgent] = []
    groups: dict[str, list[str]] = {}
    for site in sites:
        for pool, node in nodes(model, site.prefix).items():
            speed = site.speeds[pool]
            agents.append(
                cluster.SimAgent(
                    name=node,
                    capacity_bytes=site.capacity_bytes or capacity_bytes,
                    bandwidth_bytes_per_s=speed.rate("snapshot"),
                    restore_bandwidth_bytes_per_s=speed.rate("restore"),
                    latency_s=speed.latency_s,
                    extra_latency_s=site.extra_latency_s or None,
                    sim_settings=site.sim_settings.get(pool),
                )
            )
        groups.update(site.group_nodes(model))
    return cluster.LocalCluster(
        agents=agents, groups=groups, base_dir=base_dir, log_level=log_level
    )


@contextlib.asynccontextmanager
async def watching(
    address: str, *, on_event: Callable[[tsclient.OrchestratorEvent], None] | None = None
) -> AsyncIterator[list[tsclient.OrchestratorEvent]]:
    """The orchestrator's events (``WatchEvents``) while the block runs, as a growing list."""
    sink: list[tsclient.OrchestratorEvent] = []
    client = tsclient.AsyncClient(address, job_id="replay-watch")

    async def pump() -> None:
        async for event in client.watch_events():
            sink.append(event)
            if on_event is not None:
                on_event(event)

    task = asyncio.create_task(pump(), name="replay-watch")
    try:
        yield sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, errors.TsliceError):
            await task
        await client.close()


@dataclasses.dataclass(frozen=True)
class Runner:
    """Runs simulated jobs against one orchestrator and summarises what they did."""

    model: trace.PhaseModel
    plans: Plans
    address: str
    time_scale: float
    footprints: Mapping[str, int]
    events: Sequence[tsclient.OrchestratorEvent]
    on_update: rljob.UpdateCallback | None = None
    #: Shared pool -> the group the jobs ask for (None: the pool's name).
    groups: Mapping[str, str] | None = None

    def spec(self, job: str, slowdown: float, *, dedicated: bool = False) -> rljob.SimJob:
        return rljob.SimJob(
            job_id=job,
            lanes=self.plans[job],
            groups={} if dedicated else self.groups or {p: p for p in self.model.shared},
            footprints=self.footprints,
            time_scale=self.time_scale,
            slowdown=slowdown,
        )

    def patience_s(self, jobs: int, contention: float) -> float:
        """How long an acquire may wait: far beyond the others' steps something is stuck."""
        longest = max(
            sum(p.duration_s for p in step)
            for lanes in self.plans.values()
            for lane in lanes
            for step in lane
        )
        return 60.0 + 2 * jobs * longest * contention / self.time_scale

    async def run(
        self,
        name: str,
        jobs: Sequence[str],
        *,
        together: bool,
        contention: float,
        dedicated: bool = False,
    ) -> measure.RunSummary:
        """``jobs`` one after the other (``together=False``, uncontended) or all at once.

        ``dedicated``: every job has every pool to itself (the GPUs of a recorded
        baseline, no tslice in the loop), so nobody is asked and nothing is contended.
        """
        slowdown = contention if together and not dedicated else 1.0
        patience = self.patience_s(len(jobs), contention)

        async def one(job: str) -> rljob.JobResult:
            return await rljob.run_job(
                self.spec(job, slowdown, dedicated=dedicated),
                address=self.address,
                run=name,
                on_update=self.on_update,
                acquire_timeout_s=patience,
            )

        start = time.time()
        if together:
            results = list(await asyncio.gather(*(one(job) for job in jobs)))
        else:
            results = [await one(job) for job in jobs]
        return measure.summarise(
            name,
            start,
            time.time(),
            results,
            self.events,
            pools=self.model.pools,
            private=self.model.private,
        )


@dataclasses.dataclass(frozen=True)
class Bound:
    """The shortest time-sliced makespan the phase model allows, and why."""

    makespan_s: float
    #: The pool (or "job X") whose work and unavoidable fill set the bound.
    limit: str
    #: Per shared pool: total work, unavoidable fill (head + tail + hand-overs).
    work_s: Mapping[str, float]
    fill_s: Mapping[str, float]


def bound(
    plans: Plans, *, shared: Sequence[str], contention: float, switch_s: Mapping[str, float]
) -> Bound:
    """Lower bound of the makespan of all ``plans`` run at once (trace seconds).

    A shared pool serves one job at a time: the run lasts at least the pool's total work
    (every job's phases holding it, stretched by ``contention``), plus the fill no
    schedule can avoid: before the first job can use the pool (the shortest lead-in of
    any job: its work before it first holds the pool), after the last use (the shortest
    tail), and one hand-over (``switch_s``: snapshot + restore) between consecutive
    jobs, at least ``jobs - 1`` of them. A job alone also bounds it: its longest lane.
    The bound ignores that the lead-in and the tail may belong to the same job, so it
    is optimistic: no run can beat it.
    """
    work: dict[str, float] = {}
    fill: dict[str, float] = {}
    candidates: list[tuple[float, str]] = []
    for pool in shared:
        users = [job for job, lanes in plans.items() if _uses(lanes, pool)]
        if not users:
            continue
        work[pool] = contention * sum(_held(plans[job], pool) for job in users)
        head = min(_lead(plans[job], pool, reverse=False) for job in users) * contention
        tail = min(_lead(plans[job], pool, reverse=True) for job in users) * contention
        fill[pool] = head + tail + (len(users) - 1) * switch_s.get(pool, 0.0)
        candidates.append((work[pool] + fill[pool], pool))
    for job, lanes in plans.items():
        longest = max(sum(p.duration_s for step in lane for p in step) for lane in lanes)
        candidates.append((longest * contention, f"job {job}"))
    makespan, limit = max(candidates)
    return Bound(makespan_s=makespan, limit=limit, work_s=work, fill_s=fill)


def _uses(lanes: Sequence[Sequence[Sequence[trace.Phase]]], pool: str) -> bool:
    return any(pool in p.pools for lane in lanes for step in lane for p in step)


def _held(lanes: Sequence[Sequence[Sequence[trace.Phase]]], pool: str) -> float:
    """Seconds the job holds ``pool``; phases of parallel lanes holding it count once each."""
    return sum(p.duration_s for lane in lanes for step in lane for p in step if pool in p.pools)


def _lead(lanes: Sequence[Sequence[Sequence[trace.Phase]]], pool: str, *, reverse: bool) -> float:
    """Work before the job first holds ``pool`` (``reverse``: after it last holds it)."""
    best: float | None = None
    for lane in lanes:
        phases = [p for step in lane for p in step]
        if reverse:
            phases.reverse()
        lead = 0.0
        for phase in phases:
            if pool in phase.pools:
                best = lead if best is None else min(best, lead)
                break
            lead += phase.duration_s
    return best or 0.0
