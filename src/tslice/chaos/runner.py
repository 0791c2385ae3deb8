"""Chaos runs: real processes killed at random moments, then the device journals checked.

A :class:`~tslice.sim.cluster.LocalCluster` (an orchestrator and simulated agents whose
backends inject seeded failures and hangs) serves jobs that are processes of their own
(:mod:`tslice.chaos.job_process`: acquire one or two random groups, work, yield, with a
holder lease). While they run, the runner SIGKILLs, at random moments drawn from the
seed, the orchestrator (restarted on its port and state), an agent (likewise) or a job
that holds a group (its lock must go when its lease runs out; a fresh job takes its
place). Job slots start new jobs until the run's duration is over; then the jobs left
finish their steps, and an auditor acquires every group once (no group may be wedged).

The verdict (:class:`ChaosResult`): the device-journal checker over every agent's
journal against the windows the jobs recorded (mutual exclusion per node, group and
device, and between groups that share devices; every window resident; every acquire
of a live job returned: no lost turn), plus every live job completed its steps (jobs
killed on purpose are excluded and counted), no live holder lost its lease, and every
group could be acquired at the end. Everything random comes from ``ChaosConfig.seed``;
a failing run prints it, and the same seed draws the same kills, jobs and faults (the
timing of processes still varies).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import random
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import tslice.client as tsclient
from tslice.agent.backends import simdevice as device
from tslice.chaos import job_process
from tslice.common import errors
from tslice.sim import checker, cluster

GiB = device.GiB
ORCHESTRATOR_KILL, AGENT_KILL, HOLDER_KILL = "orchestrator", "agent", "holder"
#: The orchestrator and an agent at the same moment.
BOTH_KILL = "orchestrator+agent"
#: Every run has at least one of each of these.
KILL_KINDS = (ORCHESTRATOR_KILL, AGENT_KILL, HOLDER_KILL)
ALL_KILL_KINDS = (*KILL_KINDS, BOTH_KILL)
#: g1 and g2 share node-2, g2 and g3 share node-3; g1 and g3 share nothing.
TOPOLOGY: Mapping[str, tuple[str, ...]] = {
    "g1": ("node-1", "node-2"),
    "g2": ("node-2", "node-3"),
    "g3": ("node-3",),
}
NODES = tuple(sorted({n for nodes in TOPOLOGY.values() for n in nodes}))
LEASE_LOST = "lease_lost"
GROUP_WEDGED = "group_wedged"
_HOLDER_SEARCH_S = 5.0
_HOLDER_POLL_S = 0.05


class Servers(Protocol):
    """What a run needs of the servers it disrupts (a
    :class:`~tslice.sim.cluster.LocalCluster`, or another deployment of them)."""

    base_dir: Path

    @property
    def orchestrator_address(self) -> str: ...

    def start(self) -> Any: ...

    def stop(self) -> None: ...

    def kill(self, name: str) -> None: ...

    def restart(self, name: str) -> None: ...

    def state_dir(self, name: str) -> Path: ...

    def read_journals(self) -> list[device.Event]: ...


@dataclasses.dataclass(frozen=True)
class ChaosConfig:
    seed: int = 0
    #: Seconds during which jobs are started and processes killed.
    duration_s: float = 15.0
    #: Jobs running at once (each slot starts a new job when its job ends).
    slots: int = 3
    #: Acquire/work/yield cycles of each job.
    steps: int = 8
    #: Seconds between two kills, drawn uniformly from this range.
    kill_gap_s: tuple[float, float] = (2.0, 4.0)
    #: Seconds a killed server stays down, drawn uniformly from this range.
    down_s: tuple[float, float] = (0.0, 0.5)
    #: Per copy (snapshot or restore) on every agent.
    fail_probability: float = 0.05
    hang_probability: float = 0.05
    #: The agents' operation deadline: what ends a hang.
    operation_timeout_s: float = 0.5
    #: Above the client's reconnect back-off (2 s, jittered) plus a Hold's re-open delay:
    #: a shorter lease can run out across an orchestrator restart while its holder lives.
    lease_s: float = 3.0
    #: Local mode (every group spans every node and shares its devices) instead of
    #: ``TOPOLOGY``.
    local_mode: bool = False
    #: Chance that a killed job comes back under its own id (a restarted trainer).
    same_id_restart: float = 0.5
    #: After the duration, how long the jobs left have to finish, seconds.
    drain_s: float = 90.0
    #: Log level of the orchestrator and the agents.
    log_level: str = "warning"
    #: Where the cluster's state, logs and the jobs' records go (None: a temporary dir).
    base_dir: Path | None = None

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the setting and the fix."""
        if self.base_dir is not None and self.base_dir.exists() and any(self.base_dir.iterdir()):
            raise errors.ConfigError(
                f"{self.base_dir} is not empty: a chaos run checks every journal in it; "
                "name a new directory"
            )
        if self.duration_s <= 0 or self.slots < 1 or self.steps < 1:
            raise errors.ConfigError("duration_s must be > 0, slots and steps at least 1")
        for label, (low, high) in (("kill_gap_s", self.kill_gap_s), ("down_s", self.down_s)):
            if not 0 <= low <= high:
                raise errors.ConfigError(f"{label} must be a range 0 <= low <= high")


@dataclasses.dataclass
class Window(checker.Window):
    """A job's window, and whether the job found its lease lost when it yielded."""

    lost_lease: str = ""


@dataclasses.dataclass
class _Job:
    job_id: str
    records: Path
    #: An asyncio process: waiting for it takes no thread (threads are for restarts).
    process: asyncio.subprocess.Process
    killed_at: float | None = None


@dataclasses.dataclass(frozen=True)
class ChaosResult:
    seed: int
    kills: Mapping[str, int]
    switches: int
    faults: Mapping[str, int]
    violations: tuple[checker.Violation, ...]
    jobs_lost: tuple[str, ...]
    jobs_completed: int
    jobs_killed: int
    windows: int
    wall_s: float

    @property
    def ok(self) -> bool:
        return not self.violations and not self.jobs_lost

    @property
    def kills_survived(self) -> int:
        return sum(self.kills.values()) if self.ok else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "kills_survived": self.kills_survived,
            "kills": dict(self.kills),
            "switches": self.switches,
            "faults_injected": sum(self.faults.values()),
            "faults": dict(self.faults),
            "violations": len(self.violations),
            "violation_details": [str(v) for v in self.violations],
            "jobs_lost": len(self.jobs_lost),
            "jobs_lost_ids": list(self.jobs_lost),
            "jobs_completed": self.jobs_completed,
            "jobs_killed": self.jobs_killed,
            "windows": self.windows,
            "wall_s": round(self.wall_s, 1),
        }

    def summary(self) -> str:
        kills = ", ".join(f"{k} {n}" for k, n in self.kills.items())
        faults = ", ".join(f"{k} {n}" for k, n in self.faults.items())
        lines = [
            f"seed {self.seed}: {'ok' if self.ok else 'FAILED'} in {self.wall_s:.1f} s",
            f"kills survived: {self.kills_survived} ({kills})",
            f"switches: {self.switches} (over {self.windows} acquire windows)",
            f"faults injected: {sum(self.faults.values())} ({faults})",
            f"jobs: {self.jobs_completed} completed, {self.jobs_killed} killed on purpose",
            f"violations: {len(self.violations)}",
            f"jobs lost: {len(self.jobs_lost)}",
        ]
        lines += [f"  {v}" for v in self.violations]
        lines += [f"  lost: {j}" for j in self.jobs_lost]
        return "\n".join(lines)


class ChaosRun:
    """One run; :meth:`run` returns its :class:`ChaosResult`. A variant (Kubernetes HA
    mode: tests/kube/ha_chaos.py) brings its own :class:`Servers` and disruptions
    (:attr:`kinds`, :meth:`_disrupt`) and hears of each job's end (:meth:`_ended`)."""

    #: The kinds of disruption a run counts (each happens at least once first).
    kinds: Sequence[str] = ALL_KILL_KINDS
    first_kinds: Sequence[str] = KILL_KINDS

    def __init__(self, config: ChaosConfig, servers: Servers | None = None) -> None:
        config.check()
        self.config = config
        self.rng = random.Random(config.seed)
        self.kills: collections.Counter[str] = collections.Counter()
        self.jobs: list[_Job] = []
        self._next_job = 0
        self.local: Servers = servers or cluster.LocalCluster(
            agents=[self.sim_agent(name, i) for i, name in enumerate(NODES)],
            groups=None if config.local_mode else TOPOLOGY,
            base_dir=config.base_dir,
            log_level=config.log_level,
            orchestrator_args=["--operation-timeout", "60", "--reattach-grace", "30"],
        )
        self.records_dir = self.local.base_dir / "jobs"

    def sim_agent(self, name: str, index: int) -> cluster.SimAgent:
        # 30 GiB of 80: two states fit on a device, a third makes a deferred one give way.
        return cluster.SimAgent(
            name=name,
            capacity_bytes=80 * GiB,
            footprint_bytes=30 * GiB,
            bandwidth_bytes_per_s=1000 * 10**9,
            latency_s=0.005,
            fail_probability=self.config.fail_probability,
            hang_probability=self.config.hang_probability,
            extra_args=(
                "--sim-seed",
                str(self.config.seed * 100 + index),
                "--operation-timeout",
                f"{self.config.operation_timeout_s:g}",
            ),
        )

    async def run(self) -> ChaosResult:
        began = time.time()
        await asyncio.to_thread(self.local.start)
        try:
            self.records_dir.mkdir(parents=True, exist_ok=True)
            deadline = time.monotonic() + self.config.duration_s
            slots = [asyncio.create_task(self._slot(deadline)) for _ in range(self.config.slots)]
            try:
                await self._chaos(deadline)
                await asyncio.wait_for(
                    asyncio.gather(*slots), timeout=self.config.duration_s + self.config.drain_s
                )
            except asyncio.TimeoutError:
                pass  # the jobs left are lost: counted below
            finally:
                for task in slots:
                    task.cancel()
                await asyncio.gather(*slots, return_exceptions=True)
                await self._end_jobs()
            audit = await self._audit()
            journal = await asyncio.to_thread(self.local.read_journals)
            faults = [
                f
                for name in NODES
                for f in device.read_faults(self.local.state_dir(name) / device.FAULTS_FILE)
            ]
            # Before stop(): a temporary base directory goes with it, the records too.
            return self._verdict(journal, audit, faults, wall_s=time.time() - began)
        finally:
            await asyncio.to_thread(self.local.stop)

    # ---- jobs ----------------------------------------------------------------------------

    async def _slot(self, deadline: float) -> None:
        job_id = ""
        while time.monotonic() < deadline:
            job = await self._spawn(job_id)
            await job.process.wait()
            await self._ended(job)
            again = job.killed_at is not None and self.rng.random() < self.config.same_id_restart
            job_id = job.job_id if again else ""

    async def _ended(self, job: _Job) -> None:
        """``job``'s process exited (killed or done)."""

    async def _spawn(self, job_id: str) -> _Job:
        if not job_id:
            job_id = f"job-{self._next_job}"
            self._next_job += 1
        incarnation = sum(j.job_id == job_id for j in self.jobs)
        records = self.records_dir / f"{job_id}.{incarnation}.jsonl"
        args = [
            "-m", job_process.__name__,
            "--address", self.local.orchestrator_address,
            "--job", job_id,
            "--groups", ",".join(TOPOLOGY),
            "--steps", str(self.config.steps),
            "--seed", str(self.rng.randrange(2**31)),
            "--records", str(records),
            "--lease", f"{self.config.lease_s:g}",
        ]  # fmt: skip
        with records.with_suffix(".log").open("ab") as log:
            process = await asyncio.create_subprocess_exec(
                sys.executable, *args, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
        job = _Job(job_id=job_id, records=records, process=process)
        self.jobs.append(job)
        return job

    async def _end_jobs(self) -> None:
        """Kill what still runs after the drain (those jobs are lost, not killed on purpose)."""
        for job in self.jobs:
            if job.process.returncode is None:
                job.process.kill()
            await job.process.wait()

    # ---- chaos -----------------------------------------------------------------------------

    async def _chaos(self, deadline: float) -> None:
        # Every kind once first (in a random order), then random kinds.
        order = list(self.first_kinds)
        self.rng.shuffle(order)
        while True:
            gap = self.rng.uniform(*self.config.kill_gap_s)
            if order:  # the first kill of each kind fits in the duration, however short
                gap = min(gap, (deadline - time.monotonic()) / (len(order) + 1))
            elif time.monotonic() + gap >= deadline:
                return
            await asyncio.sleep(gap)
            kind = order.pop(0) if order else self.rng.choice(self.kinds)
            await self._disrupt(kind)
            self.kills[kind] += 1

    async def _disrupt(self, kind: str) -> None:
        if kind == HOLDER_KILL:
            await self._kill_holder()
            return
        names = {
            ORCHESTRATOR_KILL: [cluster.ORCHESTRATOR],
            AGENT_KILL: [self.rng.choice(NODES)],
            BOTH_KILL: [cluster.ORCHESTRATOR, self.rng.choice(NODES)],
        }[kind]
        await self._kill_servers(names)

    async def _kill_servers(self, names: Sequence[str]) -> None:
        for name in names:
            self.local.kill(name)
        await asyncio.sleep(self.rng.uniform(*self.config.down_s))
        # The agent first: the restarted orchestrator's recovery can read it at once.
        for name in reversed(names):
            await asyncio.to_thread(self.local.restart, name)

    async def _kill_holder(self) -> None:
        """SIGKILL a job while it holds a group (a random live job if none holds for a while)."""
        give_up = time.monotonic() + _HOLDER_SEARCH_S
        while True:
            live = [j for j in self.jobs if j.killed_at is None and j.process.returncode is None]
            holding = [j for j in live if _holds(j.records)]
            if holding or time.monotonic() > give_up:
                break
            await asyncio.sleep(_HOLDER_POLL_S)
        victims = holding or live
        if not victims:
            return
        job = self.rng.choice(victims)
        with contextlib.suppress(ProcessLookupError):  # it may have ended right now
            job.process.kill()
        job.killed_at = time.time()
        await job.process.wait()

    # ---- verdict ------------------------------------------------------------------------

    async def _audit(self) -> list[Window]:
        """Acquire every group once: a wedged group (a ghost holder) fails here."""
        windows: list[Window] = []
        async with tsclient.AsyncClient(
            self.local.orchestrator_address, job_id="chaos-audit", lease_s=None
        ) as client:
            for group in TOPOLOGY:
                window = Window(job="chaos-audit", group=group, requested=time.time())
                windows.append(window)
                try:
                    await client.acquire(group, timeout=self.config.lease_s + 30)
                except errors.TsliceError as err:
                    window.error = str(err)
                    continue
                window.acquired = window.yielded = time.time()
                await client.yield_(group)
        return windows

    def _verdict(
        self,
        journal: Sequence[device.Event],
        audit: Sequence[Window],
        faults: Sequence[device.Fault],
        *,
        wall_s: float,
    ) -> ChaosResult:
        windows: list[Window] = []
        lost: list[str] = []
        completed = killed = 0
        for job in self.jobs:
            records = _read_records(job.records)
            job_windows = _windows(job.job_id, records)
            if job.killed_at is not None:
                killed += 1
                job_windows = _close_at_kill(job_windows, job.killed_at)
            elif any(r["e"] == job_process.DONE for r in records):
                completed += 1
            else:
                lost.append(job.job_id)
            windows += job_windows
        violations = checker.check(
            journal=journal,
            windows=[*windows, *audit],
            group_nodes=None if self.config.local_mode else TOPOLOGY,
            conflicts={g: set(TOPOLOGY) - {g} for g in TOPOLOGY}
            if self.config.local_mode
            else None,
        )
        violations += [
            checker.Violation.of_window(
                w,
                LEASE_LOST,
                f"live job {w.job} lost its lease on group {w.group} while holding it "
                f"({w.lost_lease})",
            )
            for w in windows
            if w.lost_lease
        ]
        violations += [
            checker.Violation(
                kind=GROUP_WEDGED,
                message=f"group {w.group} could not be acquired after the run: {w.error}",
                group=w.group,
                t=w.requested,
            )
            for w in audit
            if w.acquired is None
        ]
        return ChaosResult(
            seed=self.config.seed,
            kills={k: self.kills[k] for k in self.kinds},
            switches=_switches(windows),
            faults={kind: sum(f.kind == kind for f in faults) for kind in ("fail", "hang")},
            violations=tuple(violations),
            jobs_lost=tuple(lost),
            jobs_completed=completed,
            jobs_killed=killed,
            windows=len(windows),
            wall_s=wall_s,
        )


def _read_records(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def _holds(path: Path) -> bool:
    """The job's records end inside a window: it holds a group now."""
    held: set[str] = set()
    for r in _read_records(path):
        if r["e"] == job_process.ACQUIRED:
            held.add(r["group"])
        elif r["e"] == job_process.YIELD:
            held.discard(r["group"])
    return bool(held)


def _windows(job: str, records: Sequence[Mapping[str, Any]]) -> list[Window]:
    windows: list[Window] = []
    open_: dict[str, Window] = {}
    for r in records:
        kind, group = r["e"], r.get("group", "")
        if kind == job_process.REQUEST:
            open_[group] = Window(job=job, group=group, requested=float(r["t"]))
            windows.append(open_[group])
        elif kind == job_process.ACQUIRED and group in open_:
            open_[group].acquired = float(r["t"])
        elif kind == job_process.YIELD and group in open_:
            window = open_.pop(group)
            window.yielded = float(r["t"])
            window.lost_lease = str(r.get("lost", ""))
        elif kind == job_process.ERROR and group in open_:
            open_[group].error = str(r.get("msg", ""))
    return windows


def _close_at_kill(windows: Sequence[Window], killed_at: float) -> list[Window]:
    """A killed job's windows: what it held ends at its death; what it waited for is gone."""
    kept = [w for w in windows if w.acquired is not None]
    for w in kept:
        if w.yielded is None:
            w.yielded = killed_at
    return kept


def _switches(windows: Sequence[Window]) -> int:
    """Hand-overs: a group acquired by another job than the one that held it last."""
    by_group: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for w in windows:
        if w.acquired is not None:
            by_group[w.group].append((w.acquired, w.job))
    count = 0
    for spans in by_group.values():
        spans.sort()
        count += sum(a[1] != b[1] for a, b in itertools.pairwise(spans))
    return count


async def run_chaos(config: ChaosConfig) -> ChaosResult:
    return await ChaosRun(config).run()
