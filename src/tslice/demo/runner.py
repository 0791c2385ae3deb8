"""The demo: simulated RL jobs on the pools of a recorded run, exclusive vs time-sliced.

A real orchestrator and real agents (sim backend) run as processes: one node per
shared pool of the trace (for the veRL trace node-a carries the ``sampler`` group,
node-b the ``trainer`` group; see :mod:`tslice.phases.replay`). Jobs follow the phase
model derived from the trace (:mod:`tslice.phases.trace`), compressed by
``time_scale``. First every job runs alone, one after the other (the baseline: what
a job gets with the GPUs to itself), then all jobs run at once and share both pools
through the orchestrator. The speedup is measured from the two makespans; the
mutual-exclusion checker replays the agents' device journals against the windows
the jobs saw; the HTML timeline shows both runs on one scale.

Simulated copy speed: each pool's node gets a snapshot bandwidth and a restore
bandwidth that make a snapshot and a restore of the pool's footprint take the recorded
medians of that pool (scaled, latency included), so that both directions, and thus a
full hand-over, cost what they cost in the trace.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tslice.client as tsclient
from tslice.agent.backends import simdevice as device
from tslice.common import errors
from tslice.phases import derive, measure, replay, rljob, trace
from tslice.sim import checker
from tslice.timeline import export, model, recorded
from tslice.timeline import html as timeline_html
from tslice.timeline import png as timeline_png

GiB = device.GiB
#: The veRL trace's nodes (any trace's: :func:`tslice.phases.replay.nodes`).
NODES = {trace.SAMPLER: "node-a", trace.TRAINER: "node-b"}
EXCLUSIVE = "exclusive"
TIME_SLICED = "time-sliced"
DEFAULT_TIME_SCALE = 240.0
DEFAULT_STEPS = 4


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run needs; the defaults are what ``make demo`` runs."""

    #: Trace to derive the phase model from (None = the recorded veRL run).
    trace_path: Path | None = None
    #: Number of simulated jobs (1 shows the baseline only: nothing to share).
    jobs: int = 2
    #: RL steps per job.
    steps: int = DEFAULT_STEPS
    #: Trace seconds per demo second.
    time_scale: float = DEFAULT_TIME_SCALE
    #: Sim copy bandwidth of both nodes and both directions, bytes/s (None = derived per
    #: pool and direction from the trace).
    sim_bandwidth_bytes_per_s: int | None = None
    #: Sim restore bandwidth of both nodes, bytes/s; overrides the above for restores
    #: (None = --sim-bandwidth if given, else derived per pool from the trace).
    sim_restore_bandwidth_bytes_per_s: int | None = None
    #: Fixed cost of every sim snapshot/restore, demo seconds.
    sim_latency_s: float = 0.002
    #: Memory of each simulated device, bytes (an H100 has 80 GiB).
    capacity_bytes: int = replay.DEFAULT_CAPACITY
    #: Device bytes a job holds on a pool's node while resident, by pool (a pool not
    #: named: tslice.phases.replay.FOOTPRINTS, else 60 GiB).
    footprint_bytes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    #: Phase stretch while jobs share the host (None = measured from the trace).
    contention: float | None = None
    #: Where the timeline, the summary and the cluster's state and logs go.
    out_dir: Path = Path("demo-out")
    #: Seed of the phase jitter (both runs replay the same draws).
    seed: int = 0
    #: Log level of the orchestrator and agent processes (their logs go to out_dir).
    log_level: str = "warning"
    #: Where to save the orchestrator's events of both runs as an event log (JSON lines,
    #: what ``tslice plan`` reads); None: not saved.
    events_path: Path | None = None

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the option and the fix."""
        if self.jobs < 1 or self.jobs > 26:
            raise errors.ConfigError(f"--jobs must be between 1 and 26 (got {self.jobs})")
        if self.steps < 1:
            raise errors.ConfigError(f"--steps must be at least 1 (got {self.steps})")
        if self.time_scale <= 0:
            raise errors.ConfigError(f"--time-scale must be positive (got {self.time_scale:g})")
        if self.sim_latency_s < 0:
            raise errors.ConfigError(f"--sim-latency must be >= 0 (got {self.sim_latency_s:g})")
        for option, rate in (
            ("--sim-bandwidth", self.sim_bandwidth_bytes_per_s),
            ("--sim-restore-bandwidth", self.sim_restore_bandwidth_bytes_per_s),
        ):
            if rate is not None and rate <= 0:
                raise errors.ConfigError(f"{option} must be positive (got {rate})")
        if self.contention is not None and self.contention < 1.0:
            raise errors.ConfigError(f"--contention must be >= 1 (got {self.contention:g})")
        self.check_footprints(self.footprint_bytes)

    def check_footprints(self, sizes: Mapping[str, int]) -> None:
        for label, size in sizes.items():
            if not 0 < size <= self.capacity_bytes:
                raise errors.ConfigError(
                    f"the {label} footprint ({size} bytes) must fit the device capacity "
                    f"({self.capacity_bytes} bytes): raise --capacity"
                )

    def footprints(self, model: trace.PhaseModel) -> dict[str, int]:
        """Device bytes per pool of ``model``; ConfigError if one does not fit a device."""
        sizes = replay.footprints(model, self.footprint_bytes)
        self.check_footprints(sizes)
        return sizes


# ---- live progress -------------------------------------------------------------------


@dataclasses.dataclass
class JobView:
    job: str
    step: int = 0
    steps: int = 0
    activity: str = "starting"
    holding: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SwitchView:
    t: float
    group: str
    from_job: str
    to_job: str
    duration_s: float


class DemoProgress:
    """Mutable view of a running demo, fed by job updates and orchestrator events.

    Live renderers read it; nothing in it blocks.
    """

    def __init__(self, *, jobs: int, steps: int, time_scale: float) -> None:
        self.stage = "starting the cluster"
        self.run = ""
        self.run_started = 0.0
        self.time_scale = time_scale
        self.total_steps = jobs * steps * 2
        self.done_steps = 0
        self.jobs: dict[str, JobView] = {}
        self.holders: dict[str, tuple[str, float]] = {}
        self.switches: collections.deque[SwitchView] = collections.deque(maxlen=4)
        self.switch_count = 0
        self.makespans: dict[str, float] = {}
        #: The trace's pools and the nodes of the shared ones, once the model is read.
        self.pools: tuple[str, ...] = trace.POOLS
        self.nodes: dict[str, str] = dict(NODES)
        self._completed: dict[tuple[str, str], int] = {}

    def start_run(self, name: str, job_ids: Sequence[str], steps: int) -> None:
        self.stage = name
        self.run = name
        self.run_started = time.time()
        self.jobs = {j: JobView(job=j, steps=steps) for j in job_ids}
        self.holders = {}

    def on_job(self, update: rljob.JobUpdate) -> None:
        view = self.jobs.setdefault(update.job, JobView(job=update.job, steps=update.steps))
        done = update.activity == "done"
        view.step = update.steps if done else update.step
        view.activity = update.activity
        view.holding = update.holding
        self._completed[(update.run, update.job)] = view.step
        self.done_steps = sum(self._completed.values())
        mine = {pool for pool, (job, _) in self.holders.items() if job == update.job}
        for pool in sorted(mine | set(update.holding)):
            holder = self.holders.get(pool)
            if pool in update.holding and (holder is None or holder[0] != update.job):
                self.holders[pool] = (update.job, update.t)
            elif pool not in update.holding and holder is not None and holder[0] == update.job:
                del self.holders[pool]

    def on_event(self, event: tsclient.OrchestratorEvent) -> None:
        if event.kind == tsclient.EventKind.SWITCH_DONE and event.from_job:
            self.switch_count += 1
            self.switches.appendleft(
                SwitchView(
                    t=measure.event_time(event),
                    group=event.group_id,
                    from_job=event.from_job,
                    to_job=event.job_id,
                    duration_s=event.duration_ms / 1000.0,
                )
            )


# ---- results -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DemoResult:
    config: DemoConfig
    model: trace.PhaseModel
    contention: float
    #: Shared pool -> its node.
    nodes: Mapping[str, str]
    #: Copy speed of each shared pool's node.
    speeds: Mapping[str, device.CopySpeed]
    runs: Mapping[str, measure.RunSummary]
    snapshot: Mapping[str, measure.OpStats]
    restore: Mapping[str, measure.OpStats]
    violations: tuple[checker.Violation, ...]
    timeline_path: Path
    wall_s: float

    @property
    def speedup(self) -> float | None:
        """Exclusive makespan / time-sliced makespan, as measured (None with one job)."""
        if TIME_SLICED not in self.runs:
            return None
        return self.runs[EXCLUSIVE].makespan_s / self.runs[TIME_SLICED].makespan_s

    @property
    def errors(self) -> tuple[str, ...]:
        return tuple(e for run in self.runs.values() for e in run.errors)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.errors

    def to_json(self) -> dict[str, Any]:
        scale = self.config.time_scale
        speedup = self.speedup
        return {
            "ok": self.ok,
            "speedup": round(speedup, 4) if speedup is not None else None,
            "recorded_speedup": self.model.recorded.speedup,
            "mode": self.model.mode,
            "pools": list(self.model.pools),
            "private_pools": list(self.model.private),
            "jobs": self.config.jobs,
            "steps": self.config.steps,
            "time_scale": scale,
            "contention": round(self.contention, 4),
            "runs": {
                name: {
                    "makespan_s": round(run.makespan_s, 3),
                    "makespan_trace_s": round(run.makespan_s * scale, 1),
                    "duty": {pool: round(v, 4) for pool, v in run.duty.items()},
                    "switches": run.switches,
                    "steps_done": run.steps_done,
                    "errors": list(run.errors),
                }
                for name, run in self.runs.items()
            },
            "snapshot_median": {p: dataclasses.asdict(s) for p, s in self.snapshot.items()},
            "restore_median": {p: dataclasses.asdict(s) for p, s in self.restore.items()},
            "sim_bandwidth_bytes_per_s": {
                pool: speed.rate("snapshot") for pool, speed in self.speeds.items()
            },
            "sim_restore_bandwidth_bytes_per_s": {
                pool: speed.rate("restore") for pool, speed in self.speeds.items()
            },
            "violation_count": len(self.violations),
            "violations": [str(v) for v in self.violations],
            "timeline": str(self.timeline_path),
            "trace": self.model.source,
            "wall_s": round(self.wall_s, 2),
        }


# ---- running -------------------------------------------------------------------------


job_ids = replay.job_ids


def derived_speeds(config: DemoConfig, model: trace.PhaseModel) -> dict[str, device.CopySpeed]:
    """Per shared pool, the sim copy speed reproducing the recorded snapshot and restore
    medians, scaled (:func:`tslice.phases.replay.recorded_speeds`).

    ``--sim-bandwidth`` replaces both derived rates, ``--sim-restore-bandwidth`` the
    restore rate.
    """
    out: dict[str, device.CopySpeed] = {}
    recorded = replay.recorded_speeds(
        model,
        config.footprints(model),
        time_scale=config.time_scale,
        latency_s=config.sim_latency_s,
    )
    for pool, derived in recorded.items():
        speed = derived
        if config.sim_bandwidth_bytes_per_s is not None:
            speed = dataclasses.replace(
                speed,
                bandwidth_bytes_per_s=config.sim_bandwidth_bytes_per_s,
                restore_bandwidth_bytes_per_s=config.sim_bandwidth_bytes_per_s,
            )
        if config.sim_restore_bandwidth_bytes_per_s is not None:
            speed = dataclasses.replace(
                speed, restore_bandwidth_bytes_per_s=config.sim_restore_bandwidth_bytes_per_s
            )
        out[pool] = speed
    return out


async def run_demo(config: DemoConfig, *, progress: DemoProgress | None = None) -> DemoResult:
    """Run both phases end to end and return the measured result (see the module doc)."""
    config.check()
    began = time.time()
    model = derive.load(config.trace_path)
    contention = config.contention if config.contention is not None else model.contention
    speeds = derived_speeds(config, model)
    node_of = replay.nodes(model)
    progress = progress or DemoProgress(
        jobs=config.jobs, steps=config.steps, time_scale=config.time_scale
    )
    progress.pools, progress.nodes = model.pools, node_of
    ids = job_ids(config.jobs)
    plans = replay.plans(model, jobs=config.jobs, steps=config.steps, seed=config.seed)
    out_dir = config.out_dir
    cluster_dir = out_dir / "cluster"
    shutil.rmtree(cluster_dir, ignore_errors=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    local = replay.make_cluster(
        model,
        [replay.Site(speeds)],
        base_dir=cluster_dir,
        capacity_bytes=config.capacity_bytes,
        log_level=config.log_level,
    )
    await asyncio.to_thread(local.start)
    try:
        async with replay.watching(
            local.orchestrator_address, on_event=progress.on_event
        ) as events:
            runner = replay.Runner(
                model=model,
                plans=plans,
                address=local.orchestrator_address,
                time_scale=config.time_scale,
                footprints=config.footprints(model),
                events=events,
                on_update=progress.on_job,
            )
            runs = await _run_phases(runner, ids, config.steps, contention, progress)
        progress.stage = "checking mutual exclusion"
        journal = await asyncio.to_thread(local.read_journals)
    finally:
        await asyncio.to_thread(local.stop)

    # Private pools were never asked for: nothing of them is journaled or exclusive.
    windows = [w for run in runs.values() for w in run.windows if w.group]
    violations = checker.check(
        journal=journal, windows=windows, group_nodes={p: [n] for p, n in node_of.items()}
    )
    snapshot, restore = measure.op_stats(events, model, config.time_scale)
    result = DemoResult(
        config=config,
        model=model,
        contention=contention,
        nodes=node_of,
        speeds=speeds,
        runs=runs,
        snapshot=snapshot,
        restore=restore,
        violations=tuple(violations),
        timeline_path=out_dir / "timeline.html",
        wall_s=time.time() - began,
    )
    drawn = _timeline(result, events, ids)
    timeline_html.write(result.timeline_path, timeline_html.render(drawn))
    timeline_png.write(result.timeline_path.with_suffix(".png"), drawn)
    (out_dir / "summary.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    if config.events_path is not None:
        export.write_events(config.events_path, events)
    progress.stage = "done"
    return result


async def _run_phases(
    runner: replay.Runner,
    ids: Sequence[str],
    steps: int,
    contention: float,
    progress: DemoProgress,
) -> dict[str, measure.RunSummary]:
    runs: dict[str, measure.RunSummary] = {}
    progress.start_run(EXCLUSIVE, ids, steps)
    runs[EXCLUSIVE] = await runner.run(EXCLUSIVE, ids, together=False, contention=contention)
    progress.makespans[EXCLUSIVE] = runs[EXCLUSIVE].makespan_s
    if len(ids) > 1:
        progress.start_run(TIME_SLICED, ids, steps)
        runs[TIME_SLICED] = await runner.run(TIME_SLICED, ids, together=True, contention=contention)
        progress.makespans[TIME_SLICED] = runs[TIME_SLICED].makespan_s
    return runs


def _timeline(
    result: DemoResult, events: Sequence[tsclient.OrchestratorEvent], ids: Sequence[str]
) -> model.Timeline:
    """Each run's events through the same export and drawing as `tslice timeline`'s, on
    the trace's clock."""
    scale = result.config.time_scale
    runs = []
    for name, run in result.runs.items():
        records = [
            export.record(e) for e in events if run.start <= measure.event_time(e) <= run.end
        ]
        doc = export.document(
            records, time_scale=scale, start=run.start, end=run.end, groups=result.model.pools
        )
        title = (
            f"{name}: makespan {_minutes(run.makespan_s * scale)} trace "
            f"({run.makespan_s:.1f} s demo), {run.switches} switches"
        )
        drawn = recorded.run_of(doc, name=title)
        # Pools each job has to itself never reach the orchestrator: the jobs' own windows.
        private = [
            model.Window(w.pool, w.job, (w.acquired - run.start) * scale, (end - run.start) * scale)
            for w in run.windows
            if not w.group and w.acquired is not None
            for end in [w.yielded if w.yielded is not None else run.end]
        ]
        runs.append(dataclasses.replace(drawn, windows=[*drawn.windows, *private]))
    return model.Timeline(
        title="tslice demo: simulated RL jobs, exclusive vs time-sliced",
        pools=[model.Pool(p, ", ".join(_nodes(result, p))) for p in result.model.pools],
        jobs=ids,
        runs=runs,
        summary=summary_rows(result),
        clock=f"trace seconds (the demo ran {scale:g}x faster)",
    )


def _nodes(result: DemoResult, pool: str) -> tuple[str, ...]:
    return (result.nodes[pool],) if pool in result.nodes else ("one per job",)


def summary_rows(result: DemoResult) -> list[tuple[str, str]]:
    """The headline numbers as (label, value) text, shared by the HTML and the terminal."""
    scale = result.config.time_scale
    rows: list[tuple[str, str]] = []
    speedup = result.speedup
    if speedup is not None:
        rows.append(
            (
                "speedup (measured)",
                f"{speedup:.2f}x (recorded run: {result.model.recorded.speedup}x)",
            )
        )
    for name, run in result.runs.items():
        duty = ", ".join(f"{p} {v:.0%}" for p, v in run.duty.items())
        rows.append(
            (
                f"{name} makespan",
                f"{_minutes(run.makespan_s * scale)} trace / {run.makespan_s:.1f} s demo; "
                f"duty {duty}; {run.switches} switches",
            )
        )
    for label, table in (("snapshot", result.snapshot), ("restore", result.restore)):
        for pool, op in table.items():
            rows.append(
                (
                    f"median {label} ({pool})",
                    f"{op.trace_s:.1f} s trace / {op.demo_ms:.0f} ms demo "
                    f"(recorded {op.recorded_trace_s:.1f} s; n={op.count})",
                )
            )
    verdict = "0 violations" if not result.violations else f"{len(result.violations)} VIOLATIONS"
    rows.append(("mutual exclusion", verdict))
    return rows


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"
