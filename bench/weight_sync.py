"""Weight sync: a job that needs the sampler and the trainer pools at once (issue 9 §3).

A real orchestrator and sim agents (``--nodes`` per pool) run as processes on 127.0.0.1.
Each node copies at ``--bandwidth`` per direction and each job's state is the pool's
(default sampler 60 GiB, trainer 70 GiB per device, the demo's footprints), so a switch
(snapshot, then restore) costs 2 x state / bandwidth; time is compressed ``--time-scale``
times and every figure is printed in model seconds (wall seconds x the scale).
``--switch overlap`` or ``prefetch`` makes the nodes switch as bench/trace_replay.py's
configurations of those names do (issue 9 §2); a prefetch lands only while the holder
still holds, so give the holders a ``--lead``. Single Acquires declare each pool's
footprint; an AcquireSet has one for all its groups, so it declares none, and each group
uses the footprint the job last declared there (in the warm-up round's single Acquires).

Four jobs, the same in every round: ``gen`` generates on the sampler alone, ``train``
trains on the trainer alone; ``sync`` wants both pools for its weight sync (it holds them
``--sync-hold`` s, then yields both); ``third`` wants the sampler alone, and asks once
``sync`` is queued (it holds it ``--third-work`` s). Then ``gen`` and ``train`` yield,
at once or ``--gap`` s apart (the scenario). How ``sync`` asks is the variant:

* ``set``: one ``AcquireSet`` of {sampler, trainer} (all-or-nothing);
* ``sorted``: ``Acquire`` of the sampler, then of the trainer (today's lock ordering);
* ``reverse``: the trainer, then the sampler.

Per round, from the client's clock and the orchestrator's ``WatchEvents`` (one host, one
wall clock): the wait from *both pools free* (the later holder's Yield) to the sync
job's grant; the hand-over (the first Yield to the grant); the sync job's two switches
(SWITCH_STARTED to SWITCH_DONE per group: their sum against the wall time from the first
start to the last end, and whether they overlapped); per pool, the *idle* time from its
holder's Yield to the sync job's grant (neither switching nor used by ``third``: a pool
reserved for the set, or held by the sync job while it waits for the other); and when
``third`` was granted. Rounds are interleaved (every scenario and variant once per
repetition, after a warm-up round), so drift hits all alike; per-repetition ratios to
the set are the figures to compare. ``modelled`` is the wait the copies alone explain.

    python bench/weight_sync.py [--reps 5] [--nodes 2] [--time-scale 5] [--quick] [--json]
                                [--bandwidth 50GB/s] [--switch sequential|overlap|prefetch]
                                [--lead 0] [--gap 2] [--sync-hold 1] [--third-work 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc

from tslice.agent.backends import simdevice as device
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.cli import sizes
from tslice.sim.cluster import LocalCluster, SimAgent

SAMPLER, TRAINER = "sampler", "trainer"
POOLS = (SAMPLER, TRAINER)
SYNC, GEN, TRAIN, THIRD = "sync", "gen", "train", "third"
#: Who holds each pool when the round starts.
HOLDERS = {SAMPLER: GEN, TRAINER: TRAIN}
GIB = 2**30
STATE_BYTES = {SAMPLER: 60 * GIB, TRAINER: 70 * GIB}
#: What --reps, --time-scale and --nodes default to, and in the smoke form (--quick).
DEFAULTS = {"reps": 5, "time_scale": 5.0, "nodes": 2}
QUICK = {"reps": 1, "time_scale": 100.0, "nodes": 1}
#: The round's durations (model seconds): flag, default, what it is.
DURATIONS = (
    ("--lead", 0.0, "how long the holders go on once both waiters queued (a prefetch needs it)"),
    ("--gap", 2.0, "between the two holders' Yields (but in together)"),
    ("--sync-hold", 1.0, "the weight sync: how long the sync job holds both pools"),
    ("--third-work", 2.0, "how long third holds the sampler"),
)
#: An RPC or a wait for an event that takes longer than this (wall seconds) is a hang.
STUCK_S = 60.0
Kind = opb.OrchestratorEvent


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    description: str
    #: One Acquire per pool in this order; None: one AcquireSet.
    order: tuple[str, ...] | None


VARIANTS = (
    Variant("set", "AcquireSet {sampler, trainer}", None),
    Variant("sorted", "Acquire sampler, then trainer (sorted lock order)", (SAMPLER, TRAINER)),
    Variant("reverse", "Acquire trainer, then sampler", (TRAINER, SAMPLER)),
)


#: The variant of the warm-up round.
WARM_UP = VARIANTS[1]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    #: The pool whose holder yields first, --gap before the other; None: both at once.
    first: str | None


SCENARIOS = (
    Scenario("together", "both holders yield at once", None),
    Scenario("sampler-first", "the sampler frees --gap before the trainer", SAMPLER),
    Scenario("trainer-first", "the trainer frees --gap before the sampler", TRAINER),
)


#: Pieces of every copy when moves overlap (chunked offload), as in bench/trace_replay.py.
CHUNKS = 8
#: Memory of an H200-class device: two 60 GiB sampler states fit beside each other, two
#: 70 GiB trainer states do not.
H200_BYTES = 141 * 10**9


@dataclasses.dataclass(frozen=True)
class Mechanism:
    """How a node switches (issue 9 §2): the sim backend's settings, the device memory."""

    name: str
    description: str
    overlap: bool = False
    prefetch: bool = False
    capacity_bytes: int = device.DEFAULT_CAPACITY_BYTES

    def sim_settings(self) -> dict[str, object] | None:
        if not (self.overlap or self.prefetch):
            return None
        return {"chunks": CHUNKS, "overlap": self.overlap, "prefetch": self.prefetch}

    def switch_s(self, pool: str, *, bandwidth: float, prefetched: bool) -> float:
        """The copies of one switch on ``pool``, model seconds; ``prefetched``: the holder
        went on long enough for a prefetch to land (``--lead``)."""
        one_way = STATE_BYTES[pool] / bandwidth
        if self.prefetch and prefetched and 2 * STATE_BYTES[pool] <= self.capacity_bytes:
            return one_way  # brought in beside the holder: only the snapshot is left
        return one_way * (1 + 1 / CHUNKS) if self.overlap else 2 * one_way


MECHANISMS = (
    Mechanism("sequential", "snapshot, then restore, 80 GiB devices"),
    Mechanism("overlap", f"the restore beside the snapshot ({CHUNKS} chunks)", overlap=True),
    Mechanism(
        "prefetch",
        "overlap, and the next waiter brought in beside the holder where it fits (141 GB)",
        overlap=True,
        prefetch=True,
        capacity_bytes=H200_BYTES,
    ),
)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Model seconds of the run and the time scale that turns them into wall seconds."""

    scale: float
    lead: float
    gap: float
    sync_hold: float
    third_work: float
    #: Per variant and pool, the copies of one switch to the sync job (and to third).
    switch: Mapping[str, Mapping[str, float]]

    def wall(self, model_s: float) -> float:
        return model_s / self.scale


def modelled_wait(timing: Timing, scenario: Scenario, variant: Variant) -> float:
    """From both pools free to the sync job's grant, copies only (no control overhead).

    One by one, the second Acquire is sent once the first pool is switched in; ``third``,
    queued on the sampler after the sync job's first Acquire, is ahead of it there when
    the sampler comes second.
    """
    switch, work = timing.switch[variant.name], timing.third_work
    freed = {pool: 0.0 for pool in POOLS}  # relative to both pools free
    if scenario.first is not None:
        freed[scenario.first] = -timing.gap
    if variant.order is None:
        return max(switch.values())
    first, second = variant.order
    asked = freed[first] + switch[first]
    if second == SAMPLER:
        ready = max(asked, freed[SAMPLER] + switch[SAMPLER] + work)
    else:
        ready = max(asked, freed[second])
    return ready + switch[second]


class Watch:
    """The orchestrator's events, as they arrive, and waits for one of them."""

    KINDS = (
        Kind.KIND_QUEUED,
        Kind.KIND_GRANTED,
        Kind.KIND_YIELDED,
        Kind.KIND_SWITCH_STARTED,
        Kind.KIND_SWITCH_DONE,
        Kind.KIND_SWITCH_FAILED,
    )

    def __init__(self) -> None:
        self.events: list[opb.OrchestratorEvent] = []
        self._changed = asyncio.Condition()

    async def pump(self, stream: AsyncIterable[opb.OrchestratorEvent]) -> None:
        async for event in stream:
            self.events.append(event)
            async with self._changed:
                self._changed.notify_all()

    def mark(self) -> int:
        return len(self.events)

    async def wait_seen(self, mark: int, kind: int, job: str, groups: Iterable[str]) -> None:
        """Until an event ``kind`` of ``job`` came from every one of ``groups`` (after ``mark``)."""
        wanted = set(groups)

        def seen() -> bool:
            found = {e.group_id for e in self.events[mark:] if e.kind == kind and e.job_id == job}
            return wanted <= found

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(seen), STUCK_S)


class Jobs:
    """The four jobs' calls, over raw unary stubs (no leases: nothing but the calls)."""

    def __init__(self, stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub) -> None:
        self._stub = stub

    async def acquire(self, job: str, pool: str) -> float:
        request = opb.AcquireRequest(job_id=job, group_id=pool, footprint_bytes=STATE_BYTES[pool])
        reply = await self._stub.Acquire(request, timeout=STUCK_S)
        if not reply.success:
            raise RuntimeError(f"Acquire of {pool} by {job} failed: {reply}")
        return time.time()

    async def acquire_set(self, job: str, pools: Sequence[str]) -> float:
        # A set has one footprint for all its groups, and the pools' differ: none is
        # declared; each group keeps the one the job last declared there.
        reply = await self._stub.AcquireSet(
            opb.AcquireSetRequest(job_id=job, group_ids=list(pools)), timeout=STUCK_S
        )
        if not reply.success or [g.group_id for g in reply.grants] != list(pools):
            raise RuntimeError(f"AcquireSet of {pools} by {job} failed: {reply}")
        return time.time()

    async def yield_(self, job: str, *pools: str) -> None:
        await asyncio.gather(
            *(
                self._stub.Yield(opb.YieldRequest(job_id=job, group_id=p), timeout=STUCK_S)
                for p in pools
            )
        )


async def _weight_sync(jobs: Jobs, variant: Variant, hold_s: float) -> float:
    """The sync job: both pools (as the variant asks), the sync, both yielded; its grant."""
    if variant.order is None:
        granted = await jobs.acquire_set(SYNC, POOLS)
    else:
        for pool in variant.order:
            granted = await jobs.acquire(SYNC, pool)
    await asyncio.sleep(hold_s)  # the weight sync itself
    await jobs.yield_(SYNC, *POOLS)
    return granted


async def _third(jobs: Jobs, work_s: float) -> float:
    granted = await jobs.acquire(THIRD, SAMPLER)
    await asyncio.sleep(work_s)
    await jobs.yield_(THIRD, SAMPLER)
    return granted


def _t(event: opb.OrchestratorEvent) -> float:
    return event.time.ToNanoseconds() / 1e9


def _covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` inside [lo, hi]."""
    total, reach = 0.0, lo
    for begin, finish in sorted(intervals):
        start, end = max(begin, reach), min(finish, hi)
        if end > start:
            total += end - start
            reach = end
    return total


def _spans(
    events: Sequence[opb.OrchestratorEvent], group: str, job: str | None, begin: int, end: int
) -> list[tuple[float, float]]:
    """[begin event, end event] pairs of ``group`` (of ``job``, or any), in order."""
    out: list[tuple[float, float]] = []
    opened: float | None = None
    for e in events:
        if e.group_id != group or (job is not None and e.job_id != job):
            continue
        if e.kind == begin:
            opened = _t(e)
        elif e.kind == end and opened is not None:
            out.append((opened, _t(e)))
            opened = None
    return out


def _figures(
    events: Sequence[opb.OrchestratorEvent],
    *,
    yielded: Mapping[str, float],
    granted: float,
    third_granted: float,
    scale: float,
) -> dict[str, Any]:
    """One round's figures, model seconds."""
    both_free, first_free = max(yielded.values()), min(yielded.values())
    switches = {
        g: _spans(events, g, SYNC, Kind.KIND_SWITCH_STARTED, Kind.KIND_SWITCH_DONE) for g in POOLS
    }
    missing = [g for g, s in switches.items() if len(s) != 1]
    if missing:
        raise RuntimeError(f"expected one switch to {SYNC} on each pool, got {switches}")
    (s_start, s_end), (t_start, t_end) = switches[SAMPLER][0], switches[TRAINER][0]
    idle: dict[str, float] = {}
    for g in POOLS:
        busy = _spans(events, g, None, Kind.KIND_SWITCH_STARTED, Kind.KIND_SWITCH_DONE)
        busy += _spans(events, g, THIRD, Kind.KIND_GRANTED, Kind.KIND_YIELDED)
        window = granted - yielded[g]
        idle[g] = scale * (window - _covered(busy, yielded[g], granted))
    switch_sum = (s_end - s_start) + (t_end - t_start)
    switch_wall = max(s_end, t_end) - min(s_start, t_start)
    return {
        "wait_s": scale * (granted - both_free),
        "handover_s": scale * (granted - first_free),
        "switch_s": {SAMPLER: scale * (s_end - s_start), TRAINER: scale * (t_end - t_start)},
        "switch_sum_s": scale * switch_sum,
        "switch_wall_s": scale * switch_wall,
        "overlapped": max(s_start, t_start) < min(s_end, t_end),
        # How far apart the two switches started (the set: both at its grant).
        "switch_start_skew_s": scale * abs(s_start - t_start),
        "idle_s": idle,
        "third_wait_s": scale * (third_granted - yielded[SAMPLER]),
        "third_before_sync": third_granted < granted,
    }


async def _round(
    jobs: Jobs, watch: Watch, timing: Timing, scenario: Scenario, variant: Variant
) -> dict[str, Any]:
    await asyncio.gather(*(jobs.acquire(job, pool) for pool, job in HOLDERS.items()))
    mark = watch.mark()
    sync = asyncio.create_task(_weight_sync(jobs, variant, timing.wall(timing.sync_hold)))
    first = POOLS if variant.order is None else variant.order[:1]
    await watch.wait_seen(mark, Kind.KIND_QUEUED, SYNC, first)
    third = asyncio.create_task(_third(jobs, timing.wall(timing.third_work)))
    await watch.wait_seen(mark, Kind.KIND_QUEUED, THIRD, [SAMPLER])
    await asyncio.sleep(timing.wall(timing.lead))  # the holders' work goes on
    yielded: dict[str, float] = {}

    async def free(pool: str) -> None:
        yielded[pool] = time.time()
        await jobs.yield_(HOLDERS[pool], pool)

    if scenario.first is None:
        await asyncio.gather(*(free(p) for p in POOLS))
    else:
        await free(scenario.first)
        await asyncio.sleep(timing.wall(timing.gap))  # the other holder's work goes on
        await free(next(p for p in POOLS if p != scenario.first))
    granted, third_granted = await asyncio.gather(sync, third)
    # A reply goes out before its switch's SWITCH_DONE event, a Yield's before YIELDED.
    await watch.wait_seen(mark, Kind.KIND_SWITCH_DONE, SYNC, POOLS)
    await watch.wait_seen(mark, Kind.KIND_YIELDED, THIRD, [SAMPLER])
    figures = _figures(
        watch.events[mark:],
        yielded=yielded,
        granted=granted,
        third_granted=third_granted,
        scale=timing.scale,
    )
    return {"scenario": scenario.name, "variant": variant.name, **figures}


@contextlib.asynccontextmanager
async def _watching(stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub) -> AsyncIterator[Watch]:
    watch = Watch()
    stream = stub.WatchEvents(opb.WatchEventsRequest(kinds=Watch.KINDS))
    await stream.initial_metadata()  # subscribed: no event of the run can be missed
    task = asyncio.create_task(watch.pump(stream))
    try:
        yield watch
    finally:
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _cluster(args: argparse.Namespace, mechanism: Mechanism) -> LocalCluster:
    rate = max(int(args.bandwidth * args.time_scale), 1)
    agents = [
        SimAgent(
            name=f"{pool}-{i + 1}",
            bandwidth_bytes_per_s=rate,
            latency_s=0.0,
            footprint_bytes=STATE_BYTES[pool],
            capacity_bytes=mechanism.capacity_bytes,
            sim_settings=mechanism.sim_settings(),
        )
        for pool in POOLS
        for i in range(args.nodes)
    ]
    groups = {pool: [f"{pool}-{i + 1}" for i in range(args.nodes)] for pool in POOLS}
    return LocalCluster(agents=agents, groups=groups, log_level=args.log_level)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    began = time.time()
    mechanism = next(m for m in MECHANISMS if m.name == args.switch)
    timing = Timing(
        scale=args.time_scale,
        lead=args.lead,
        gap=args.gap,
        sync_hold=args.sync_hold,
        third_work=args.third_work,
        switch={
            v.name: {
                p: mechanism.switch_s(p, bandwidth=args.bandwidth, prefetched=args.lead > 0)
                for p in POOLS
            }
            for v in VARIANTS
        },
    )
    rounds: list[dict[str, Any]] = []
    async with (
        _cluster(args, mechanism) as cluster,
        grpc.aio.insecure_channel(cluster.orchestrator_address) as channel,
    ):
        stub: opb_grpc.TimeSliceOrchestratorServiceAsyncStub = (
            opb_grpc.TimeSliceOrchestratorServiceStub(channel)
        )
        jobs = Jobs(stub)
        async with _watching(stub) as watch:
            # Warm-up: every job's state exists after it, so every later switch restores,
            # and the sync job has declared its footprint on each pool (single Acquires).
            await _round(jobs, watch, timing, SCENARIOS[0], WARM_UP)
            for rep in range(args.reps):
                for scenario in SCENARIOS:
                    for variant in VARIANTS:
                        row = await _round(jobs, watch, timing, scenario, variant)
                        rounds.append({"rep": rep, **row})
    return {
        "nodes_per_pool": args.nodes,
        "state_bytes": STATE_BYTES,
        "bandwidth_bytes_per_s": args.bandwidth,
        "time_scale": args.time_scale,
        "lead_s": args.lead,
        "gap_s": args.gap,
        "sync_hold_s": args.sync_hold,
        "third_work_s": args.third_work,
        "reps": args.reps,
        "scenarios": {c.name: c.description for c in SCENARIOS},
        "variants": {v.name: v.description for v in VARIANTS},
        "switch_mechanism": {"name": mechanism.name, "description": mechanism.description},
        "switch_modelled_s": {
            v: {p: round(s, 3) for p, s in by_pool.items()} for v, by_pool in timing.switch.items()
        },
        "summary": _summary(rounds, timing),
        "rounds": rounds,
        "wall_s": round(time.time() - began, 1),
    }


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def _column(rows: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows]


def _summary(rounds: Sequence[dict[str, Any]], timing: Timing) -> list[dict[str, Any]]:
    """Per scenario and variant: median and range over the repetitions; the wait's ratio
    to the set's, repetition by repetition (neighbouring rounds see the same machine)."""

    def pick(scenario: str, variant: str) -> list[dict[str, Any]]:
        return [r for r in rounds if r["scenario"] == scenario and r["variant"] == variant]

    out: list[dict[str, Any]] = []
    for scenario in SCENARIOS:
        base = {r["rep"]: r["wait_s"] for r in pick(scenario.name, "set")}
        for variant in VARIANTS:
            rows = pick(scenario.name, variant.name)
            ratios = [r["wait_s"] / base[r["rep"]] for r in rows if base.get(r["rep"])]
            out.append(
                {
                    "scenario": scenario.name,
                    "variant": variant.name,
                    "n": len(rows),
                    "wait_s": _spread(_column(rows, "wait_s")),
                    "wait_modelled_s": round(modelled_wait(timing, scenario, variant), 3),
                    "wait_ratio_to_set": _spread(ratios) if ratios else None,
                    "handover_s": _spread(_column(rows, "handover_s")),
                    "switch_sum_s": _spread(_column(rows, "switch_sum_s")),
                    "switch_wall_s": _spread(_column(rows, "switch_wall_s")),
                    "switch_start_skew_s": _spread(_column(rows, "switch_start_skew_s")),
                    "overlapped": sum(r["overlapped"] for r in rows),
                    "idle_s": {p: _spread([r["idle_s"][p] for r in rows]) for p in POOLS},
                    "third_wait_s": _spread(_column(rows, "third_wait_s")),
                    "third_before_sync": sum(r["third_before_sync"] for r in rows),
                }
            )
    return out


def _text(report: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def cell(s: Mapping[str, float]) -> str:
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    states = ", ".join(f"{p} {b / GIB:.0f} GiB" for p, b in report["state_bytes"].items())
    costs = {
        v: ", ".join(f"{p} {s:.2f} s" for p, s in by_pool.items())
        for v, by_pool in report["switch_modelled_s"].items()
    }
    switch = (
        next(iter(costs.values()))
        if len(set(costs.values())) == 1
        else "; ".join(f"{v}: {c}" for v, c in costs.items())
    )
    table = Table(
        title=(
            f"weight sync hand-over, {report['nodes_per_pool']} nodes per pool, state {states} "
            f"over {report['bandwidth_bytes_per_s'] / 1e9:g} GB/s per direction, switches "
            f"{report['switch_mechanism']['name']} (copies: {switch}); model seconds at time "
            f"scale {report['time_scale']:g}, median (min-max) of {report['reps']}"
        ),
        title_justify="left",
    )
    columns = (
        "scenario",
        "variant",
        "free -> grant",
        "modelled",
        "/ set",
        "hand-over",
        "switches sum / wall",
        "overlap",
        "sampler idle",
        "trainer idle",
        "third: free -> grant",
    )
    for name in columns:
        table.add_column(name, justify="left" if name in {"scenario", "variant"} else "right")
    for s in report["summary"]:
        ratio = s["wait_ratio_to_set"]
        table.add_row(
            s["scenario"],
            s["variant"],
            cell(s["wait_s"]),
            f"{s['wait_modelled_s']:.2f}",
            f"{ratio['median']:.2f}x" if ratio else "-",
            cell(s["handover_s"]),
            f"{s['switch_sum_s']['median']:.2f} / {s['switch_wall_s']['median']:.2f}",
            f"{s['overlapped']}/{s['n']}",
            cell(s["idle_s"][SAMPLER]),
            cell(s["idle_s"][TRAINER]),
            cell(s["third_wait_s"])
            + (f" (first {s['third_before_sync']}/{s['n']})" if s["third_before_sync"] else ""),
        )
    console = Console(width=200)
    console.print(table)
    console.print(
        "free -> grant: from both pools free (the later Yield) to the sync job's grant; "
        "hand-over: from the first Yield; overlap: rounds whose two switches ran at once; "
        "idle: from the pool's Yield to the grant, neither switching nor used by third; "
        "third: from the sampler's Yield to its grant (first: granted before the sync job)"
    )
    for kind in ("scenarios", "variants"):
        console.print("; ".join(f"{name}: {what}" for name, what in report[kind].items()))
    console.print(f"wall {report['wall_s']:.0f} s")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=None, help="repetitions of every round (5)")
    p.add_argument("--nodes", type=int, default=None, help="sim nodes per pool (2)")
    p.add_argument("--time-scale", type=float, default=None, help="model seconds per second (5)")
    p.add_argument("--bandwidth", default="50GB/s", help="copy rate per direction")
    p.add_argument(
        "--switch",
        choices=[m.name for m in MECHANISMS],
        default="sequential",
        help="how a node switches: " + "; ".join(f"{m.name}: {m.description}" for m in MECHANISMS),
    )
    for flag, default, what in DURATIONS:
        p.add_argument(flag, type=float, default=default, help=f"{what}, model seconds")
    p.add_argument(
        "--quick", action="store_true", help="smoke form: 1 repetition, 100x, 1 node per pool"
    )
    p.add_argument("--log-level", default="warning", help="of the servers")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    args = p.parse_args(argv)
    args.bandwidth = sizes.parse_rate(args.bandwidth, option="--bandwidth")
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.reps < 1 or args.nodes < 1:
        p.error("--reps and --nodes must be at least 1")
    report = asyncio.run(measure(args))
    if args.json:
        print(json.dumps(report, indent=2), flush=True)
    else:
        _text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
