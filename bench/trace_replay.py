"""Trace replay: a recorded RL run through the real orchestrator, reference-like and ours.

Issue 9 §1.

The phase model of the trace (:mod:`tslice.phases.derive`) drives simulated jobs
(:mod:`tslice.phases.rljob`) against a real orchestrator and one real sim agent per shared
pool, all processes on 127.0.0.1, time-compressed (``--time-scale`` trace seconds per
second). Every job first runs alone on GPUs of its own, as in the recorded baseline (its
*solo* makespan; back-to-back of N jobs is the sum of the first N), then N jobs run at
once under each configuration:

* ``reference``: what the recorded run did - FIFO, the recorded switch costs (each shared
  pool's node snapshots and restores in the recorded medians), and the reference's 1 s
  polling of operations (half a poll interval, the mean wait, added to every copy).
  Nodes one after the other: every pool is one node here, so there is nothing to order.
  Run with the trace's own job count it must reproduce the recorded speedup (1.45x for
  the veRL trace, within +/-10 %): this validates the simulator against reality.
* ours, one configuration per switch mechanism (issue 9 §2), FIFO, WaitOperation
  long-polls (no polling), switch costs at the physical floor: the pool's state
  (default the demo's footprints: sampler 60 GiB, trainer 70 GiB, other pools 60 GiB)
  over ``--bandwidth`` per direction (default 50 GB/s: a PCIe Gen5 x16 host link with
  pinned memory, ~50 of its 64 GB/s), each direction its own link:
  ``sequential`` (snapshot, then restore; 80 GiB devices), ``overlap`` (the restore
  beside the snapshot, :data:`CHUNKS` chunks, landing only in freed memory),
  ``+prefetch`` (and the first waiter brought in beside the holder where it fits, on
  141 GB devices) and ``+discard`` (and the sampler's state discarded: the next weight
  sync re-sends it). ``--only NAME`` runs some of them.

Policies and multi-group acquire (issue 9 §3-§4) become more entries of
:data:`CONFIGURATIONS` when they land.

Printed per configuration and job count: duty cycle per pool, makespan, speedup over
back-to-back and GPU-hours saved, next to the bound the phase model allows
(:func:`tslice.phases.replay.bound`: the busiest pool's total work plus the fill no
schedule avoids), and the median hand-over per pool as the jobs felt it. Time
compression inflates the orchestrator's own fixed cost per hand-over (a few ms of real
time) by the time scale: at 750x (the default), 20 ms are 15 trace seconds.

    python bench/trace_replay.py [--trace FILE] [--jobs N] [--json] [--quick]
                                 [--steps N] [--time-scale X] [--bandwidth 50GB/s]
                                 [--only CONFIGURATION]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tslice.agent.backends import simdevice as device
from tslice.cli import sizes
from tslice.phases import derive, measure, replay, trace
from tslice.sim import checker

#: The reference polls GetOperation every second: an operation is seen done, on average,
#: half a poll interval after it is.
REFERENCE_POLL_S = 1.0
DEFAULT_TIME_SCALE = 750.0
QUICK = {"steps": 2, "jobs": [2], "time_scale": 8000.0}
#: Fixed cost of every simulated copy, wall seconds (what the sim cannot go below).
SIM_LATENCY_S = 0.0002


@dataclasses.dataclass(frozen=True)
class Setup:
    """What every configuration replays: the model, the plans, the sizes and the clock."""

    model: trace.PhaseModel
    plans: replay.Plans
    footprints: Mapping[str, int]
    time_scale: float
    bandwidth_bytes_per_s: float


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One row of the benchmark: how the cluster moves state and schedules."""

    name: str
    description: str
    speeds: Callable[[Setup], dict[str, device.CopySpeed]]
    #: Added to every copy, trace seconds.
    extra_latency_trace_s: float = 0.0
    #: Switch mechanisms (issue 9 §2): snapshot and restore at once, chunk by chunk.
    overlap: bool = False
    #: The next waiter's state comes in beside the holder where it fits.
    prefetch: bool = False
    #: Pools whose state is discarded at a switch (the next weight sync re-sends it).
    discard: tuple[str, ...] = ()
    #: Memory per device (None: the default, 80 GiB).
    capacity_bytes: int | None = None

    def sim_settings(self, model: trace.PhaseModel) -> dict[str, dict[str, object]]:
        """Per shared pool, the sim-backend settings of its node."""
        if not (self.overlap or self.prefetch or self.discard):
            return {}
        common: dict[str, object] = {"chunks": CHUNKS, "overlap": self.overlap}
        common["prefetch"] = self.prefetch
        return {
            pool: {**common, "suspend_mode": "discard" if pool in self.discard else "offload"}
            for pool in model.shared
        }

    def copy_s(self, setup: Setup, pool: str) -> float:
        """The copies one switch on ``pool`` costs under this mechanism, trace seconds."""
        speed = self.speeds(setup)[pool]
        size = 0 if pool in self.discard else setup.footprints[pool]
        out, back = (
            setup.time_scale * speed.seconds(bytes_per_device=size, direction=d)
            + self.extra_latency_trace_s
            for d in ("snapshot", "restore")
        )
        capacity = self.capacity_bytes or replay.DEFAULT_CAPACITY
        if self.prefetch and 2 * setup.footprints[pool] <= capacity:
            back = 0.0  # brought in while the holder ran
        if self.overlap:
            # The restore lands in what the snapshot frees: one chunk behind it.
            return max(out, back) + min(out, back) / CHUNKS
        return out + back


def _recorded_speeds(setup: Setup) -> dict[str, device.CopySpeed]:
    return replay.recorded_speeds(
        setup.model, setup.footprints, time_scale=setup.time_scale, latency_s=SIM_LATENCY_S
    )


def _floor_speeds(setup: Setup) -> dict[str, device.CopySpeed]:
    return replay.link_speeds(
        setup.model,
        bandwidth_bytes_per_s=setup.bandwidth_bytes_per_s,
        time_scale=setup.time_scale,
        latency_s=0.0,
    )


#: Pieces of every copy when moves overlap (chunked offload).
CHUNKS = 8
#: Memory of an H200-class device: two 60 GiB sampler states fit beside each other
#: (two 70 GiB trainer states do not).
H200_BYTES = 141 * 10**9

CONFIGURATIONS = (
    Configuration(
        "reference",
        "FIFO, recorded switch costs, 1 s polling, nodes one after the other",
        _recorded_speeds,
        extra_latency_trace_s=REFERENCE_POLL_S / 2,
    ),
    Configuration(
        "sequential",
        "FIFO, snapshot then restore, long-poll, switch costs at the physical floor, 80 GiB",
        _floor_speeds,
    ),
    Configuration(
        "overlap",
        f"as sequential, the restore overlapping the snapshot ({CHUNKS} chunks)",
        _floor_speeds,
        overlap=True,
    ),
    Configuration(
        "+prefetch",
        "overlap, and the next waiter prefetched where it fits (141 GB devices)",
        _floor_speeds,
        overlap=True,
        prefetch=True,
        capacity_bytes=H200_BYTES,
    ),
    Configuration(
        "+discard",
        "overlap and prefetch (141 GB), the sampler's state discarded (weight sync re-sends it)",
        _floor_speeds,
        overlap=True,
        prefetch=True,
        discard=(trace.SAMPLER,),
        capacity_bytes=H200_BYTES,
    ),
)


async def _solo(setup: Setup) -> dict[str, float]:
    """Each job alone on GPUs of its own (the recorded baseline: no tslice in the loop),
    all at once since nothing is shared: its makespan, trace seconds."""
    runner = _runner(setup, "", ())
    out: dict[str, float] = {}

    async def one(job: str) -> None:
        run = await runner.run(f"solo {job}", [job], together=False, contention=1.0, dedicated=True)
        if run.errors:
            raise RuntimeError(f"solo run of job {job} failed: {run.errors}")
        out[job] = run.makespan_s * setup.time_scale

    await asyncio.gather(*(one(job) for job in setup.plans))
    return dict(sorted(out.items()))


def _runner(
    setup: Setup,
    address: str,
    events: Sequence[Any],
    groups: Mapping[str, str] | None = None,
) -> replay.Runner:
    return replay.Runner(
        model=setup.model,
        plans=setup.plans,
        address=address,
        time_scale=setup.time_scale,
        footprints=setup.footprints,
        events=events,
        groups=groups,
    )


def _site(setup: Setup, index: int, config: Configuration) -> replay.Site:
    return replay.Site(
        speeds=config.speeds(setup),
        prefix=f"c{index}-",
        extra_latency_s=config.extra_latency_trace_s / setup.time_scale,
        sim_settings=config.sim_settings(setup.model),
        capacity_bytes=config.capacity_bytes,
    )


async def _configurations(
    setup: Setup,
    counts: Sequence[int],
    solo: Mapping[str, float],
    *,
    base: Path,
    log_level: str,
    configs: Sequence[Configuration] = CONFIGURATIONS,
) -> list[dict[str, Any]]:
    """N jobs at once, for each N and configuration, one after the other. One orchestrator
    serves every configuration, each on nodes of its own (a :class:`replay.Site`)."""
    model = setup.model
    sites = [_site(setup, i, config) for i, config in enumerate(configs)]
    local = replay.make_cluster(model, sites, base_dir=base / "cluster", log_level=log_level)
    await asyncio.to_thread(local.start)
    rows: list[dict[str, Any]] = []
    runs: list[measure.RunSummary] = []
    try:
        async with replay.watching(local.orchestrator_address) as events:
            for config, site in zip(configs, sites, strict=True):
                runner = _runner(setup, local.orchestrator_address, events, site.groups(model))
                for n in counts:
                    ids = replay.job_ids(n)
                    run = await runner.run(
                        f"{config.name} x{n}", ids, together=True, contention=model.contention
                    )
                    runs.append(run)
                    rows.append(_row(setup, config, ids, run, solo))
        journal = await asyncio.to_thread(local.read_journals)
    finally:
        await asyncio.to_thread(local.stop)
    group_nodes = {g: n for site in sites for g, n in site.group_nodes(model).items()}
    violations = checker.check(
        journal=journal,
        windows=[w for run in runs for w in run.windows if w.group],
        group_nodes=group_nodes,
    )
    for row in rows:
        row["violations"] = len(violations)
    return rows


def _row(
    setup: Setup,
    config: Configuration,
    ids: Sequence[str],
    run: measure.RunSummary,
    solo: Mapping[str, float],
) -> dict[str, Any]:
    model, scale = setup.model, setup.time_scale
    modelled = {pool: config.copy_s(setup, pool) for pool in model.shared}
    makespan = run.makespan_s * scale
    back_to_back = sum(solo[j] for j in ids)
    plans = {j: setup.plans[j] for j in ids}
    best = replay.bound(plans, shared=model.shared, contention=model.contention, switch_s={})
    gpus_sliced = len(model.shared) + len(model.private) * len(ids)
    gpus_back_to_back = len(model.pools)
    handovers = {
        pool: statistics.median(h) * scale
        if (h := measure.handovers_s(run.windows, pool))
        else None
        for pool in model.shared
    }
    return {
        "configuration": config.name,
        "description": config.description,
        "jobs": len(ids),
        "makespan_s": round(makespan, 1),
        "back_to_back_s": round(back_to_back, 1),
        "speedup": round(back_to_back / makespan, 4),
        "gpu_hours_saved": round(
            1 - gpus_sliced * makespan / (gpus_back_to_back * back_to_back), 4
        ),
        "duty": {pool: round(v, 4) for pool, v in run.duty.items()},
        "bound": {
            "makespan_s": round(best.makespan_s, 1),
            "speedup": round(back_to_back / best.makespan_s, 4),
            "limit": best.limit,
            "work_s": {p: round(v, 1) for p, v in best.work_s.items()},
            "fill_s": {p: round(v, 1) for p, v in best.fill_s.items()},
        },
        "share_of_bound": round(best.makespan_s / makespan, 4),
        "switches": run.switches,
        "switch_modelled_s": {p: round(v, 2) for p, v in modelled.items()},
        "handover_median_s": {
            p: round(v, 2) if v is not None else None for p, v in handovers.items()
        },
        "errors": list(run.errors),
    }


async def replay_all(args: argparse.Namespace) -> dict[str, Any]:
    began = time.time()
    model = derive.load(args.trace)
    steps = args.steps or model.recorded_steps
    counts = sorted(set(args.jobs))
    setup = Setup(
        model=model,
        plans=replay.plans(model, jobs=max(counts), steps=steps, seed=args.seed),
        footprints=replay.footprints(model),
        time_scale=args.time_scale,
        bandwidth_bytes_per_s=args.bandwidth,
    )
    with tempfile.TemporaryDirectory(prefix="tslice-replay-") as tmp:
        base = Path(args.keep) if args.keep else Path(tmp)
        solo = await _solo(setup)
        configs = [c for c in CONFIGURATIONS if not args.only or c.name in args.only]
        rows = await _configurations(
            setup, counts, solo, base=base, log_level=args.log_level, configs=configs
        )
    recorded = model.recorded
    reference = next(
        (r for r in rows if r["configuration"] == "reference" and r["jobs"] == len(model.jobs)),
        None,
    )
    validation: dict[str, Any] | None = None
    if reference is not None and recorded.speedup > 0:
        deviation = reference["speedup"] / recorded.speedup - 1
        validation = {
            "jobs": len(model.jobs),
            "simulated_speedup": reference["speedup"],
            "recorded_speedup": recorded.speedup,
            "deviation": round(deviation, 4),
            "within_10pct": abs(deviation) <= 0.10,
        }
    return {
        "trace": model.source,
        "mode": model.mode,
        "pools": list(model.pools),
        "private_pools": list(model.private),
        "trace_jobs": [s.job for s in model.jobs],
        "steps": steps,
        "time_scale": args.time_scale,
        "contention": round(model.contention, 4),
        "state_bytes": dict(setup.footprints),
        "bandwidth_bytes_per_s": args.bandwidth,
        "recorded_switch_s": {
            p: {"snapshot": round(c.snapshot.median, 2), "restore": round(c.restore.median, 2)}
            for p, c in model.switch.items()
        },
        "solo_makespan_s": {j: round(v, 1) for j, v in solo.items()},
        "recorded": dataclasses.asdict(recorded),
        "validation": validation,
        "rows": rows,
        "wall_s": round(time.time() - began, 1),
    }


def _text(report: Mapping[str, Any]) -> str:
    pools = report["pools"]
    lines = [
        f"trace {report['trace']} ({report['mode']}; pools {', '.join(pools)}"
        + (f"; private: {', '.join(report['private_pools'])}" if report["private_pools"] else "")
        + f"); {report['steps']} steps per job, time scale {report['time_scale']:g}, "
        f"contention {report['contention']:.3f}",
        "ours: state "
        + ", ".join(f"{p} {b / 2**30:.0f} GiB" for p, b in report["state_bytes"].items())
        + f" over {report['bandwidth_bytes_per_s'] / 1e9:g} GB/s per direction",
        "solo makespans: "
        + ", ".join(f"{j} {v / 60:.1f} min" for j, v in report["solo_makespan_s"].items()),
        "",
    ]
    header = (
        f"{'configuration':<14}{'jobs':>5}{'makespan':>11}{'b2b':>10}{'speedup':>9}"
        f"{'GPU-h saved':>12}{'bound':>8}{'of bound':>9}  "
        + "  ".join(f"{p + ' duty':>14}" for p in pools)
        + "  hand-over median"
    )
    lines += [header, "-" * len(header)]
    for r in report["rows"]:
        handover = ", ".join(
            f"{p} {v:.1f} s" if v is not None else f"{p} -"
            for p, v in r["handover_median_s"].items()
        )
        lines.append(
            f"{r['configuration']:<14}{r['jobs']:>5}{r['makespan_s'] / 60:>7.1f} min"
            f"{r['back_to_back_s'] / 60:>6.1f} min{r['speedup']:>8.2f}x"
            f"{r['gpu_hours_saved']:>11.0%} {r['bound']['speedup']:>6.2f}x"
            f"{r['share_of_bound']:>9.0%}  "
            + "  ".join(f"{r['duty'][p]:>14.0%}" for p in pools)
            + f"  {handover}"
            + (f"  ERRORS: {r['errors']}" if r["errors"] else "")
            + (f"  {r['violations']} VIOLATIONS" if r["violations"] else "")
        )
    lines.append("")
    seen: set[str] = set()
    for r in report["rows"]:
        if r["configuration"] not in seen:
            seen.add(r["configuration"])
            cost = ", ".join(f"{p} {v:.1f} s" for p, v in r["switch_modelled_s"].items())
            lines.append(f"{r['configuration']}: {r['description']}; copies per switch {cost}")
    lines.append(
        "hand-over: a yield to the waiting job's grant, as the jobs felt it: the copies plus "
        f"the orchestrator's own few ms, which the time scale stretches {report['time_scale']:g}x"
    )
    lines.append(
        "bound: back-to-back / the shortest makespan the phase model allows (the busiest "
        "pool's work plus the lead-in and tail no schedule avoids); limit per row in --json"
    )
    v = report["validation"]
    if v is not None:
        verdict = "within" if v["within_10pct"] else "OUTSIDE"
        lines.append(
            f"validation: reference-like, {v['jobs']} jobs: {v['simulated_speedup']:.2f}x "
            f"against the recorded {v['recorded_speedup']:.2f}x ({v['deviation']:+.1%}, "
            f"{verdict} +/-10 %)"
        )
    lines.append(f"wall {report['wall_s']:.0f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=None, help="recorded run (default: veRL 2xH100)")
    p.add_argument("--jobs", type=int, action="append", help="job count (repeatable; 2, 3, 4)")
    p.add_argument(
        "--steps", type=int, default=None, help="RL steps per job (default: the trace's)"
    )
    p.add_argument("--time-scale", type=float, default=None, help="trace seconds per second")
    p.add_argument("--bandwidth", default="50GB/s", help="ours: copy rate per direction")
    p.add_argument("--seed", type=int, default=0, help="seed of the phase jitter")
    p.add_argument("--quick", action="store_true", help="smoke form: 2 jobs, 2 steps, 8000x")
    p.add_argument("--keep", default=None, help="keep the servers' state and logs here")
    p.add_argument("--log-level", default="warning", help="of the servers")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    names = [c.name for c in CONFIGURATIONS]
    p.add_argument("--only", action="append", choices=names, help="run only these configurations")
    args = p.parse_args(argv)
    args.bandwidth = sizes.parse_rate_or_none(args.bandwidth, option="--bandwidth")
    if args.quick:
        args.steps = args.steps or QUICK["steps"]
        args.jobs = args.jobs or QUICK["jobs"]
        args.time_scale = args.time_scale or QUICK["time_scale"]
    args.jobs = args.jobs or [2, 3, 4]
    args.time_scale = args.time_scale or DEFAULT_TIME_SCALE
    if min(args.jobs) < 1 or max(args.jobs) > 26:
        p.error("--jobs must be between 1 and 26")
    try:
        report = asyncio.run(replay_all(args))
    except trace.TraceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else _text(report), flush=True)
    failed = any(r["errors"] or r["violations"] for r in report["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
