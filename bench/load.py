"""Load: many jobs looping acquire -> hold -> yield over many groups, for a fixed time.

A real orchestrator and ``--nodes`` agents with the ``noop`` backend run as separate
processes on 127.0.0.1 (``tslice.sim.cluster.LocalCluster``), in topology mode: the
``--groups`` groups are spread round-robin over the nodes and each names its own device
index there, so no two groups share a device (as in a cluster where each group is its own
set of GPUs; local mode would make every group share every device, one lock in all). The
number of nodes changes no orchestrator work per grant: each grant is one Grant message to
the group's one agent.

The load comes from ``--procs`` generator processes (asyncio, one ``AsyncClient`` per job,
its Acquire and Yield on the client's Session stream). Every job loops: Acquire its group,
hold it for a random time (uniform in [0, 2 x ``--hold-ms``]), Yield. ``--jobs`` jobs
share the groups evenly, so a group always has waiters and the run measures the
orchestrator's capacity. Each generator reports its own CPU time: if the generators
together are far from their cores' share, they are not the bottleneck.

Figures, over the ``--seconds`` window after a short warm-up:

- grants/s: GRANTED events of the orchestrator's WatchEvents stream inside the window;
- hand-over, server-side: from a group's YIELDED event to its next GRANTED event, when the
  job granted was queued (QUEUED event) before the yield; timestamps are the orchestrator's
  own (each event's ``time``). Twice: live, on ``--watch-groups`` groups (16), and after the
  run on every group, replayed from the orchestrator's event history (``WatchEvents``
  with ``since``/``until``). The p99 of the second holds still from run to run; that of
  ~500 watched hand-overs is their 5th slowest, and moved between 28 and 82 ms over ten
  runs of the same code within an hour;
- Acquire latency, client-side: call to return, which includes waiting for the turn;
- orchestrator CPU per grant (utime + stime of ``/proc/<pid>/stat`` over the window) and its
  RSS (VmRSS, VmHWM) at the end;
- errors (any failed call of a generator) and mutual-exclusion violations (a GRANTED event
  of a group while another job holds it, from both event streams), both must be 0, and
  events lost (grants the generators saw that the event stream did not carry).

    python bench/load.py [--jobs 1000] [--groups 250] [--seconds 60] [--procs N] [--json]
    python bench/load.py --seconds 5 --jobs 100 --groups 25      # the short form (tested)
    python bench/load.py --half-saturation                        # p99 at half the capacity

``--half-saturation`` runs twice in one invocation: first at ``--hold-ms`` (short: the
orchestrator saturates) to find the saturating grant rate S, then with the hold that
offers about S/2 (:func:`half_saturation_hold_ms`), and reports the hand-over of every
group there. A
fixed hold (e.g. ``--hold-ms 1000``) offers a rate that depends on the machine: on 2
cores it can be most of the capacity, where the p99 measures the queue again.

Target (issue 10): >= 500 grants/s on 2 cores with a server-side hand-over p99 <= 50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.sim.cluster import ORCHESTRATOR, LocalCluster, SimAgent

Kind = opb.OrchestratorEvent
_WATCHED = [Kind.KIND_GRANTED, Kind.KIND_YIELDED]
#: With --breakdown: also each switch's own duration (first agent call to every node done).
_SWITCHES = [Kind.KIND_SWITCH_DONE]
#: Time from "go" to the window's start, seconds.
_WARMUP_S = 0.5
#: How long the orchestrator's CPU is read with every job connected and idle, seconds.
_IDLE_S = 1.0
#: First connection of a generator's client: many connect at once.
_CONNECT_S = 120.0
#: Connections a generator opens at once.
_CONNECTING = 20
#: How long the events of the last grants may take to arrive after the generators end.
_EVENTS_SETTLE_S = 5.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``samples`` by nearest rank; 0 for none."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def group_ids(groups: int) -> list[str]:
    return [f"g{i:04d}" for i in range(groups)]


def job_plan(jobs: int, groups: int, procs: int) -> list[list[tuple[str, str]]]:
    """``(job, group)`` pairs of each generator process: job i uses group i mod groups."""
    gids = group_ids(groups)
    plan: list[list[tuple[str, str]]] = [[] for _ in range(procs)]
    for i in range(jobs):
        plan[i % procs].append((f"job-{i:05d}", gids[i % groups]))
    return plan


# ---- the cluster -------------------------------------------------------------------------


class _DisjointCluster(LocalCluster):
    """A LocalCluster whose groups each name their own device index on their node."""

    def _topology_args(self) -> list[str]:
        assert self.groups is not None
        addresses = self.agent_addresses
        slots: dict[str, int] = {}
        topology: dict[str, Any] = {"groups": {}}
        for gid, (node,) in self.groups.items():
            index = slots[node] = slots.get(node, -1) + 1
            topology["groups"][gid] = {
                "nodes": [{"name": node, "agent": addresses[node], "devices": [index]}]
            }
        path = self.base_dir / "topology.yaml"
        path.write_text(yaml.safe_dump(topology, sort_keys=False))
        return ["--topology", str(path)]


def _cluster(
    groups: int,
    nodes: int,
    orchestrator_env: dict[str, str],
    base_dir: Path | None,
    orchestrator_args: Sequence[str] = (),
) -> LocalCluster:
    names = [f"node-{i + 1}" for i in range(nodes)]
    layout = {gid: (names[i % nodes],) for i, gid in enumerate(group_ids(groups))}
    return _DisjointCluster(
        agents=[SimAgent(name=n, backend="noop") for n in names],
        groups=layout,
        startup_timeout_s=120.0,
        env=orchestrator_env,
        base_dir=base_dir,
        orchestrator_args=orchestrator_args,
    )


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def _memory_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


# ---- generator process -------------------------------------------------------------------


async def _job_loop(
    client: Any, job: str, group: str, *, hold_s: float, start: float, end: float, out: dict
) -> None:
    rng = random.Random(job)
    await asyncio.sleep(max(0.0, start - time.time()))
    while time.time() < end:
        began = time.perf_counter()
        try:
            result = await client.acquire(group)
        except Exception as err:  # every failure is a finding: count it, say what
            out["errors"].append(f"{job} acquire: {type(err).__name__}: {err}"[:300])
            return
        if not result.success:
            out["errors"].append(f"{job} acquire returned no success: {result}")
            return
        held_from = time.time()
        if start <= held_from <= end:
            out["acquire_s"].append(time.perf_counter() - began)
            out["by_job"][job] = out["by_job"].get(job, 0) + 1
        out["grants"] += 1
        out["by_group"][group] = out["by_group"].get(group, 0) + 1
        await asyncio.sleep(rng.uniform(0.0, 2 * hold_s))
        out["holds"].append((group, job, held_from, time.time()))
        try:
            await client.yield_(group)
        except Exception as err:
            out["errors"].append(f"{job} yield: {type(err).__name__}: {err}"[:300])
            return


async def _generate(spec: dict[str, Any]) -> dict[str, Any]:
    from tslice.client import AsyncClient

    out: dict[str, Any] = {
        "errors": [],
        "acquire_s": [],
        "grants": 0,
        "by_group": {},
        "by_job": {},
        "holds": [],
    }
    clients = [
        AsyncClient(spec["address"], job_id=job, connect_timeout=_CONNECT_S)
        for job, _ in spec["jobs"]
    ]
    try:
        # Every client connected, and its Session stream open, before the window: the run
        # measures grants, not handshakes (while streams still open, the jobs that have
        # one re-acquire their own groups for free and the others wait).
        connecting = asyncio.Semaphore(_CONNECTING)

        async def connect(client: Any, group: str) -> None:
            async with connecting:
                await client.list_groups()
            await client.acquire(group)
            await client.yield_(group)

        await asyncio.gather(
            *(connect(c, g) for c, (_, g) in zip(clients, spec["jobs"], strict=True))
        )
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        window = json.loads(await asyncio.to_thread(sys.stdin.readline))
        start, end = window["start"], window["end"]
        cpu_before = resource.getrusage(resource.RUSAGE_SELF)
        await asyncio.gather(
            *(
                _job_loop(c, job, group, hold_s=spec["hold_s"], start=start, end=end, out=out)
                for c, (job, group) in zip(clients, spec["jobs"], strict=True)
            )
        )
        cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    out["cpu_s"] = cpu
    out["cpu_share"] = cpu / (end - start)  # of one core, over the window (and the drain)
    return out


def _worker_main(spec_json: str) -> int:
    result = asyncio.run(_generate(json.loads(spec_json)))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


# ---- the watcher -------------------------------------------------------------------------


class _Watch:
    """Reads GRANTED and YIELDED of every group; checks and measures as they come.

    A GRANTED event's ``duration_ms`` is how long the job waited: the job was queued
    before the group's last yield exactly when grant time - wait < yield time.
    """

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.holder: dict[str, str] = {}
        self.yielded_at: dict[str, float] = {}
        self.handover_s: list[float] = []
        self.switch_s: list[float] = []
        #: GRANTED events of the window by detail ("restored", "zero-cost", "already held";
        #: none: a switch with nothing to restore, as the first grant of a job).
        self.grant_kinds: dict[str, int] = {}
        self.grants_in_window = 0
        self.grants_total = 0
        self.violations: list[str] = []
        #: Set once ``expected`` grants (the generators' count) have come.
        self.expected: int | None = None
        self.complete = asyncio.Event()

    def expect(self, grants: int) -> None:
        self.expected = grants
        if self.grants_total >= grants:
            self.complete.set()

    def take(self, e: opb.OrchestratorEvent) -> None:
        t = e.time.seconds + e.time.nanos / 1e9
        g, job = e.group_id, e.job_id
        if e.kind == Kind.KIND_SWITCH_DONE:
            if self.start <= t <= self.end:
                self.switch_s.append(e.duration_ms / 1000)
        elif e.kind == Kind.KIND_YIELDED:
            if self.holder.get(g) == job:
                del self.holder[g]
            self.yielded_at[g] = t
        elif e.kind == Kind.KIND_GRANTED:
            self.grants_total += 1
            if self.expected is not None and self.grants_total >= self.expected:
                self.complete.set()
            current = self.holder.get(g)
            if current is not None and current != job:
                self.violations.append(f"{g}: {job} granted at {t:.6f} while {current} holds")
            self.holder[g] = job
            if self.start <= t <= self.end:
                self.grants_in_window += 1
                kind = e.detail or "nothing to restore"
                self.grant_kinds[kind] = self.grant_kinds.get(kind, 0) + 1
                yielded = self.yielded_at.get(g)
                # 1 ms: duration_ms is rounded down.
                if yielded is not None and t - e.duration_ms / 1000 < yielded - 0.001:
                    self.handover_s.append(t - yielded)


def overlapping_holds(holds: list[tuple[str, str, float, float]]) -> list[str]:
    """Mutual-exclusion violations seen by the jobs themselves: two jobs' hold intervals
    (Acquire returned .. Yield called, each inside the orchestrator's grant) on one group
    that overlap. ``holds``: ``(group, job, begin, end)``."""
    found: list[str] = []
    last: dict[str, tuple[str, float]] = {}
    for group, job, begin, end in sorted(holds, key=lambda h: h[2]):
        previous = last.get(group)
        if previous is not None and previous[0] != job and begin < previous[1]:
            found.append(
                f"{group}: {job} held from {begin:.6f} while {previous[0]} until {previous[1]:.6f}"
            )
        if previous is None or end > previous[1]:
            last[group] = (job, end)
    return found


async def _subscribe(channel: grpc.aio.Channel, group: str, kinds: list[Kind.Kind]) -> Any:
    """One group's stream, subscribed. (A stream of every group's events falls behind under
    load: one write per event, and the orchestrator drops what its buffer cannot hold.)"""
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)  # type: ignore[no-untyped-call]
    stream = stub.WatchEvents(opb.WatchEventsRequest(group_id=group, kinds=kinds))
    await stream.initial_metadata()  # subscribed: nothing after this can be missed
    return stream


async def _idle_watchers(address: str, count: int) -> grpc.aio.Channel | None:
    """``count`` WatchEvents streams of every group's events that are never read (a
    dashboard that hung, a scraper that stopped): subscribed, then left alone. Their own
    channel; closing it ends them."""
    if not count:
        return None
    channel = grpc.aio.insecure_channel(address)
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)  # type: ignore[no-untyped-call]
    for _ in range(count):
        stream = stub.WatchEvents(opb.WatchEventsRequest())
        await stream.initial_metadata()  # subscribed (its events are never read)
    return channel


async def _read(stream: Any, watch: _Watch) -> None:
    async for event in stream:
        watch.take(event)


async def replayed(channel: grpc.aio.Channel, start: float, end: float) -> _Watch:
    """Every group's grants and yields of the window, replayed from the orchestrator's
    event history once the load has stopped (a live stream of every group falls behind
    under load). From there the hand-over is measured on every group: about 15 times the
    samples of the watched groups, which is what a p99 needs to hold still from run to
    run. Its holders are checked too."""
    watch = _Watch(start, end)
    request = opb.WatchEventsRequest(kinds=_WATCHED, history_only=True)
    # From before the generators start (no group is held then), to the window's end.
    request.since.FromNanoseconds(int((start - _WARMUP_S) * 1e9))
    request.until.FromNanoseconds(int(end * 1e9))
    stub = opb_grpc.TimeSliceOrchestratorServiceStub(channel)  # type: ignore[no-untyped-call]
    async for event in stub.WatchEvents(request):
        watch.take(event)
    return watch


def watched_groups(groups: int, count: int) -> list[str]:
    """``count`` groups spread evenly over all of them."""
    gids = group_ids(groups)
    step = max(1, len(gids) // max(1, count))
    return gids[::step][:count]


async def _start_profile(pid: int, seconds: float, path: Path) -> asyncio.subprocess.Process:
    """py-spy (installed by hand: it is no dependency) on a server for the window."""
    spy = Path(sys.executable).with_name("py-spy")
    command = [str(spy), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200"]
    command += ["--gil", "-f", "raw", "-o", str(path)]
    return await asyncio.create_subprocess_exec(*command, stdout=subprocess.DEVNULL)


# ---- the run ------------------------------------------------------------------------------


class _Generators:
    """The generator processes: started, connected (each says "ready"), then told the window."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []

    async def start(self, specs: list[dict[str, Any]]) -> None:
        for spec in specs:
            self.procs.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--worker",
                    json.dumps(spec),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    limit=1 << 26,
                )
            )
        for proc in self.procs:
            assert proc.stdout is not None
            line = await proc.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(
                    f"a load generator did not connect (exit code {await proc.wait()})"
                )

    def go(self, start: float, end: float) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"start": start, "end": end}).encode() + b"\n")

    async def results(self) -> list[dict[str, Any]]:
        results = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = await proc.stdout.readline()
            if await proc.wait() != 0 or not line:
                raise RuntimeError(f"a load generator exited with code {proc.returncode}")
            results.append(json.loads(line))
        return results


async def measure(
    *,
    jobs: int,
    groups: int,
    seconds: float,
    procs: int,
    nodes: int,
    hold_ms: float,
    orchestrator_env: dict[str, str] | None = None,
    profile: Path | None = None,
    breakdown: bool = False,
    watch_groups: int = 16,
    keep: Path | None = None,
    idle_watchers: int = 0,
) -> dict[str, Any]:
    if jobs < groups:
        raise ValueError(f"--jobs ({jobs}) must be at least --groups ({groups})")
    procs = max(1, min(procs, jobs))
    config_args: list[str] = []
    if idle_watchers:
        # One caller opens them all: its cap (limits.max_watchers_per_caller) is raised.
        config = Path(tempfile.mkdtemp(prefix="tslice-load-")) / "orchestrator.yaml"
        cap = idle_watchers + watch_groups + 16
        config.write_text(
            yaml.safe_dump({"limits": {"max_watchers": cap, "max_watchers_per_caller": cap}})
        )
        config_args = ["--config", str(config)]
    with _cluster(groups, nodes, orchestrator_env or {}, keep, config_args) as cluster:
        address = cluster.orchestrator_address
        pid = cluster.pid(ORCHESTRATOR)
        assert pid is not None
        generators = _Generators()
        await generators.start(
            [
                {"address": address, "jobs": part, "hold_s": hold_ms / 1000}
                for part in job_plan(jobs, groups, procs)
            ]
        )
        # What the orchestrator spends with every job connected and none calling.
        idle_from = _cpu_s(pid)
        await asyncio.sleep(_IDLE_S)
        idle_share = (_cpu_s(pid) - idle_from) / _IDLE_S
        start = time.time() + _WARMUP_S
        end = start + seconds
        watch = _Watch(start, end)
        kinds = _WATCHED + (_SWITCHES if breakdown else [])
        sampled = watched_groups(groups, watch_groups)
        channel = grpc.aio.insecure_channel(address)
        streams = await asyncio.gather(*(_subscribe(channel, g, kinds) for g in sampled))
        watchers = [asyncio.create_task(_read(stream, watch)) for stream in streams]
        idle = await _idle_watchers(address, idle_watchers)
        generators.go(start, end)
        await asyncio.sleep(max(0.0, start - time.time()))
        agent_pids = [p for n in cluster.names if n != ORCHESTRATOR and (p := cluster.pid(n))]
        cpu_start = _cpu_s(pid)
        agents_start = sum(_cpu_s(p) for p in agent_pids)
        spies = []
        if profile is not None:
            await asyncio.to_thread(profile.mkdir, parents=True, exist_ok=True)
            for name in (ORCHESTRATOR, "node-1"):
                target = cluster.pid(name)
                assert target is not None
                spies.append(await _start_profile(target, seconds, profile / f"{name}.txt"))
        await asyncio.sleep(max(0.0, end - time.time()))
        cpu_end = _cpu_s(pid)
        agents_cpu = sum(_cpu_s(p) for p in agent_pids) - agents_start
        for spy in spies:
            await spy.wait()
        memory = _memory_kib(pid)
        results = await generators.results()
        client_grants = sum(r["grants"] for r in results)
        sampled_grants = sum(r["by_group"].get(g, 0) for r in results for g in sampled)
        watch.expect(sampled_grants)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(watch.complete.wait(), _EVENTS_SETTLE_S)
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        every_group = await replayed(channel, start, end)
        await channel.close()
        if idle is not None:
            await idle.close()
    acquire = [s for r in results for s in r["acquire_s"]]
    overlaps = overlapping_holds([tuple(h) for r in results for h in r["holds"]])
    errors = [e for r in results for e in r["errors"]]
    grants = sum(len(r["acquire_s"]) for r in results)  # Acquires returned in the window
    return {
        "jobs": jobs,
        "groups": groups,
        "nodes": nodes,
        "seconds": seconds,
        "procs": procs,
        "hold_ms_mean": hold_ms,
        "grants": grants,
        "grants_per_s": grants / seconds,
        "handover_ms": {
            "p50": percentile(watch.handover_s, 0.5) * 1000,
            "p99": percentile(watch.handover_s, 0.99) * 1000,
            "n": len(watch.handover_s),
        },
        "handover_all_ms": {
            "p50": percentile(every_group.handover_s, 0.5) * 1000,
            "p99": percentile(every_group.handover_s, 0.99) * 1000,
            "n": len(every_group.handover_s),
        },
        "switch_ms": {
            "p50": percentile(watch.switch_s, 0.5) * 1000,
            "p99": percentile(watch.switch_s, 0.99) * 1000,
            "n": len(watch.switch_s),
        },
        "acquire_ms": {
            "p50": percentile(acquire, 0.5) * 1000,
            "p99": percentile(acquire, 0.99) * 1000,
            "n": len(acquire),
        },
        "orchestrator": {
            "cpu_share": (cpu_end - cpu_start) / seconds,
            "idle_cpu_share": idle_share,
            "cpu_ms_per_grant": (cpu_end - cpu_start) * 1000 / grants if grants else 0.0,
            "rss_mib": memory.get("VmRSS", 0) / 1024,
            "peak_rss_mib": memory.get("VmHWM", 0) / 1024,
        },
        "agents_cpu_share": agents_cpu / seconds,
        "agents_cpu_ms_per_grant": agents_cpu * 1000 / grants if grants else 0.0,
        "generators_cpu_share": [r["cpu_share"] for r in results],
        "generators_cpu_ms_per_grant": (
            sum(r["cpu_s"] for r in results) * 1000 / client_grants if client_grants else 0.0
        ),
        "errors": len(errors),
        "error_samples": errors[:5],
        "violations": len(watch.violations) + len(every_group.violations) + len(overlaps),
        "violations_events": len(watch.violations) + len(every_group.violations),
        "violations_clients": len(overlaps),
        "violation_samples": (watch.violations + every_group.violations + overlaps)[:5],
        "grants_per_group": _spread(
            [sum(r["by_group"].get(g, 0) for r in results) for g in group_ids(groups)]
        ),
        "jobs_without_grant": jobs - sum(len(r["by_job"]) for r in results),
        "grants_per_job": _spread([n for r in results for n in r["by_job"].values()]),
        "watched_groups": len(sampled),
        "watched_grants_by_kind": watch.grant_kinds,
        "events_lost": max(0, sampled_grants - watch.grants_total),
        "idle_watchers": idle_watchers,
    }


def half_saturation_hold_ms(saturating_grants_per_s: float, groups: int) -> float:
    """The mean hold that offers about half of ``saturating_grants_per_s``: each group
    grants once per hold (its waiters are always queued), so ``groups`` groups offer
    ``groups / hold`` grants per second; the hand-over itself adds a little more."""
    if saturating_grants_per_s <= 0:
        raise ValueError("the saturating run granted nothing: no rate to halve")
    return 1000.0 * groups / (saturating_grants_per_s / 2)


def _spread(counts: list[int]) -> dict[str, float]:
    """Min, median and max of the grants each group got (fairness across groups)."""
    return {
        "min": min(counts, default=0),
        "p50": percentile(counts, 0.5),
        "max": max(counts, default=0),
    }


def report(r: dict[str, Any]) -> str:
    o, h, a = r["orchestrator"], r["handover_ms"], r["acquire_ms"]
    every = r["handover_all_ms"]
    gens = r["generators_cpu_share"]
    lines = [
        f"load: {r['jobs']} jobs on {r['groups']} groups ({r['nodes']} noop agents), "
        f"{r['seconds']:g} s, hold {r['hold_ms_mean']:g} ms mean, {r['procs']} generator procs",
        f"  grants/s                     {r['grants_per_s']:10.1f}   ({r['grants']} grants)",
        f"  hand-over (server) p50 / p99 {h['p50']:10.2f} / {h['p99']:.2f} ms   (n={h['n']},"
        f" {r['watched_groups']} groups watched live)",
        f"  hand-over, every group       {every['p50']:10.2f} / {every['p99']:.2f} ms   "
        f"(n={every['n']}, replayed from the event history)",
        f"  switch (agents)    p50 / p99 {r['switch_ms']['p50']:10.2f} / "
        f"{r['switch_ms']['p99']:.2f} ms   (n={r['switch_ms']['n']}, --breakdown)",
        f"  Acquire (client)   p50 / p99 {a['p50']:10.2f} / {a['p99']:.2f} ms   (n={a['n']},"
        " includes waiting for the turn)",
        f"  grants per group min / p50 / max {r['grants_per_group']['min']:6.0f} / "
        f"{r['grants_per_group']['p50']:.0f} / {r['grants_per_group']['max']:.0f}   (whole run)",
        f"  orchestrator CPU             {o['cpu_share'] * 100:10.1f} % of a core, "
        f"{o['cpu_ms_per_grant']:.3f} ms per grant (idle, every job connected: "
        f"{o['idle_cpu_share'] * 100:.1f} %)",
        f"  orchestrator RSS             {o['rss_mib']:10.1f} MiB (peak {o['peak_rss_mib']:.1f})",
        f"  agents CPU                   {r['agents_cpu_share'] * 100:10.1f} % of a core in all, "
        f"{r['agents_cpu_ms_per_grant']:.3f} ms per grant",
        f"  generators CPU               {sum(gens) * 100:10.1f} % of a core in all "
        f"(max {max(gens) * 100:.1f} % per process), "
        f"{r['generators_cpu_ms_per_grant']:.3f} ms per grant",
        f"  jobs with no grant in the window {r['jobs_without_grant']}, grants per job "
        f"min / p50 / max {r['grants_per_job']['min']:.0f} / {r['grants_per_job']['p50']:.0f}"
        f" / {r['grants_per_job']['max']:.0f}",
        f"  grants of the {r['watched_groups']} watched groups by kind: "
        + ", ".join(f"{k} {n}" for k, n in sorted(r["watched_grants_by_kind"].items())),
        f"  errors {r['errors']}, violations {r['violations']} (event stream "
        f"{r['violations_events']}, jobs' own hold intervals {r['violations_clients']}), "
        f"events lost {r['events_lost']}",
    ]
    lines += [f"    error: {e}" for e in r["error_samples"]]
    lines += [f"    violation: {v}" for v in r["violation_samples"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--groups", type=int, default=250)
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window")
    parser.add_argument("--procs", type=int, default=4, help="load generator processes")
    parser.add_argument("--nodes", type=int, default=4, help="noop agents")
    parser.add_argument("--hold-ms", type=float, default=10.0, help="mean hold per grant")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--profile",
        type=Path,
        help="directory: py-spy raw profiles (GIL) of the orchestrator and node-1",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also watch SWITCH_DONE: each switch's own duration (the agents' part)",
    )
    parser.add_argument(
        "--watch-groups",
        type=int,
        default=16,
        help="groups whose WatchEvents streams give the hand-over and the event check",
    )
    parser.add_argument(
        "--keep", type=Path, help="directory for the servers' state and logs, kept after the run"
    )
    parser.add_argument(
        "--idle-watchers",
        type=int,
        default=0,
        help="run twice, without and with this many idle WatchEvents subscribers, and "
        "print the hand-over p50 ratio",
    )
    parser.add_argument(
        "--half-saturation",
        action="store_true",
        help="run at --hold-ms to find the saturating rate, then at the hold that offers "
        "half of it, and report the hand-over p99 there",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker_main(args.worker)
    options = {
        k: v for k, v in vars(args).items() if k not in ("json", "worker", "half_saturation")
    }
    if args.half_saturation:
        return _at_half_saturation(options, as_json=args.json)
    if args.idle_watchers:
        return _with_and_without_watchers(options, as_json=args.json)
    result = asyncio.run(measure(**options))
    print(json.dumps(result) if args.json else report(result))
    return 0 if result["errors"] == 0 and result["violations"] == 0 else 1


def _with_and_without_watchers(options: dict[str, Any], *, as_json: bool) -> int:
    """The same load with no idle watcher, then with ``--idle-watchers``, in one run: the
    hand-over's p50 with them over its p50 without (issue 21 §4: within 1.5x)."""
    runs = [
        asyncio.run(measure(**{**options, "idle_watchers": n}))
        for n in (0, options["idle_watchers"])
    ]
    ratio = runs[1]["handover_ms"]["p50"] / max(runs[0]["handover_ms"]["p50"], 1e-9)
    if as_json:
        print(json.dumps({"without": runs[0], "with": runs[1], "handover_p50_ratio": ratio}))
    else:
        for run in runs:
            print(f"-- {run['idle_watchers']} idle WatchEvents subscribers")
            print(report(run))
        print(
            f"hand-over p50 with {options['idle_watchers']} idle subscribers / without: "
            f"{ratio:.2f}x"
        )
    ok = all(r["errors"] == 0 and r["violations"] == 0 for r in runs)
    return 0 if ok else 1


def _at_half_saturation(options: dict[str, Any], *, as_json: bool) -> int:
    """The saturating rate, then the hand-over at about half of it, in one run."""
    saturated = asyncio.run(measure(**options))
    hold_ms = half_saturation_hold_ms(saturated["grants_per_s"], options["groups"])
    half = asyncio.run(measure(**{**options, "hold_ms": hold_ms}))
    offered = half["grants_per_s"] / saturated["grants_per_s"]
    if as_json:
        print(json.dumps({"saturated": saturated, "half": half, "rate_fraction": offered}))
    else:
        print(f"-- saturating: hold {options['hold_ms']:g} ms")
        print(report(saturated))
        print(f"-- about half the saturating rate: hold {hold_ms:.0f} ms")
        print(report(half))
        h = half["handover_all_ms"]
        print(
            f"at {offered:.2f} of the saturating {saturated['grants_per_s']:.1f} grants/s: "
            f"hand-over p50 {h['p50']:.1f} ms, p99 {h['p99']:.1f} ms (n={h['n']}, every group)"
        )
    ok = all(r["errors"] == 0 and r["violations"] == 0 for r in (saturated, half))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
