"""What a success answer promises, under fire: a grant is taken back only by the job's own
yield, a lapsed lease or an eviction (DESIGN.md, invariant 7).

Jobs of several processes each (one client per process, all with the job's id, each on a
channel of its own) take single groups and sets of groups, with deadlines, and now and
then cancel a call; an administrator evicts jobs (from one group or from all) and drains
groups for a while; the orchestrator is SIGKILLed at random moments and restarted on its
port and state. The jobs are leaseless, so a grant may end only by their own yields or
an eviction. Every answer is recorded, per job (whichever process got it), and checked:

- the device journals against the windows the jobs were told they held
  (:mod:`tslice.sim.checker`: no group's devices held by two jobs at once, the holder's
  state resident on every node of its group, no two jobs' windows on a group overlap).
  A window runs from the first answer of its grant until the job's own first yield of
  the group, or the first eviction of the job from it, that may have reached that grant
  (sent while, or returning after, the job asked for it): anything else that ended the
  grant while another job used the group shows up as a violation;
- a yield the orchestrator refuses while the job's window is open (nothing ended it) is
  a violation: the job was told it holds the group, and was not told otherwise; a yield
  refused after an eviction must name the eviction;
- every process finished its cycles (deadlines end every wait: no job may be stuck),
  and an auditor then acquires every group (none is wedged).

Everything random is drawn from the seed; the timing of processes still varies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import math
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import tslice.client as tsclient
from tslice.agent.backends import simdevice as device
from tslice.common import errors
from tslice.sim import checker, cluster

#: p3 spans both nodes, so it shares devices with p1 and with p2.
TOPOLOGY: Mapping[str, tuple[str, ...]] = {
    "p1": ("node-1",),
    "p2": ("node-2",),
    "p3": ("node-1", "node-2"),
}
CONFLICTS: Mapping[str, tuple[str, ...]] = {"p1": ("p3",), "p2": ("p3",), "p3": ("p1", "p2")}
GROUPS = tuple(TOPOLOGY)
NODES = ("node-1", "node-2")
#: What the administrator says when it evicts (the job's next call must name it).
EVICTION_REASON = "promise-run eviction"
#: Per-call deadlines of the jobs' acquires and sets, seconds (every wait ends; a set's
#: is shorter, so that sets fail while another process of the job holds a group).
_ACQUIRE_TIMEOUT_S = (0.5, 4.0)
_SET_TIMEOUT_S = (0.3, 2.0)


@dataclasses.dataclass(frozen=True)
class PromiseConfig:
    seed: int
    #: How long processes keep starting new cycles, seconds.
    duration_s: float = 20.0
    jobs: int = 3
    #: Processes per job (clients with the job's id, on channels of their own).
    processes: int = 2
    #: Between orchestrator SIGKILLs, seconds (None: no kills).
    kill_gap_s: tuple[float, float] | None = (4.0, 8.0)
    #: Between an administrator's evictions, and between its drains, seconds.
    evict_gap_s: tuple[float, float] = (1.0, 3.0)
    drain_gap_s: tuple[float, float] = (2.0, 5.0)
    #: After the duration, how long the processes have to finish their cycle.
    finish_s: float = 60.0
    log_level: str = "warning"
    base_dir: Path | None = None

    def check(self) -> None:
        if self.duration_s <= 0 or self.jobs < 2 or self.processes < 1:
            raise errors.ConfigError("duration_s must be > 0, jobs >= 2 and processes >= 1")


@dataclasses.dataclass
class _Window(checker.Window):
    """One grant of a job, from its first answer (``epoch``: the grant's number)."""

    epoch: int = 0
    #: What ended it in the job's records: "yield" or "eviction" ("" = still open).
    ended_by: str = ""


@dataclasses.dataclass
class _Act:
    """A yield of the job's, or an eviction of it (``group`` "" = from every group)."""

    kind: str
    job: str
    group: str
    sent: float
    #: When its answer came (infinity while it is in flight).
    returned: float = math.inf


class Book:
    """What every job was told and did (all its processes), and what looked wrong."""

    def __init__(self) -> None:
        #: (job, group, epoch) -> its window.
        self.grants: dict[tuple[str, str, int], _Window] = {}
        self.acts: list[_Act] = []
        self.problems: list[str] = []
        self.counts: collections.Counter[str] = collections.Counter()

    def told(self, job: str, epochs: Mapping[str, int], asked: float) -> None:
        now = time.time()
        for group, epoch in epochs.items():
            window = self.grants.get((job, group, epoch))
            if window is None:
                window = _Window(job=job, group=group, requested=asked, acquired=now, epoch=epoch)
                self.grants[(job, group, epoch)] = window
            window.requested = min(window.requested, asked)
            window.acquired = min(window.acquired or now, now)

    def did(self, kind: str, job: str, group: str, sent: float) -> None:
        self.acts.append(_Act(kind, job, group, sent, time.time()))

    def sending(self, kind: str, job: str, group: str) -> _Act:
        """A yield or an eviction is sent now: it counts from now, while in flight (one
        process's yield may end the grant another process of the job is refused under);
        set its ``returned`` when it comes back."""
        act = _Act(kind, job, group, time.time())
        self.acts.append(act)
        return act

    def yield_refused(
        self, job: str, group: str, sent: float, err: errors.RPCError, own: _Act | None = None
    ) -> None:
        """A Yield of ``job``, sent at ``sent``, was refused just now. Fine if the job's
        latest grant of the group had ended by then, by the job's own yield or an
        eviction in flight before the refusal (an eviction must be named); otherwise the
        job was told it holds the group, and not told otherwise: a violation."""
        refused = time.time()
        told = [w for w in self.grants.values() if (w.job, w.group) == (job, group)]
        latest = max(
            (w for w in told if w.acquired is not None and w.acquired <= sent),
            key=lambda w: w.epoch,
            default=None,
        )
        if latest is None:
            return
        kinds = {a.kind for a in self._ending(latest) if a.sent <= refused and a is not own}
        if not kinds:
            self.problems.append(
                f"job {job}'s yield of {group} was refused while it held grant "
                f"{latest.epoch} (answered at {latest.acquired:.3f}; neither its own yield "
                f"nor an eviction ended it): {err.message}"
            )
        elif kinds == {"eviction"} and "evict" not in err.message:
            self.problems.append(
                f"job {job}'s yield of {group} after an eviction was refused without "
                f"naming it: {err.message}"
            )

    def holding(self) -> set[tuple[str, str]]:
        """(job, group) of the grants the jobs' records still hold."""
        return {(w.job, w.group) for w in self.grants.values() if not self._ending(w)}

    def close_windows(self) -> list[_Window]:
        """Every window, ended where the job's own records end it (see the module)."""
        for window in self.grants.values():
            end = self._end(window)
            if end is not None:
                window.yielded, window.ended_by = end
        return list(self.grants.values())

    def _end(self, window: _Window) -> tuple[float, str] | None:
        """When and how the job's records end ``window``: its first own yield of the
        group, or eviction from it, that may have reached the grant."""
        assert window.acquired is not None
        ends = [(max(a.sent, window.acquired), a.kind) for a in self._ending(window)]
        return min(ends, default=None)

    def _ending(self, window: _Window) -> list[_Act]:
        """The job's yields of the group and its evictions from it that may have reached
        ``window``'s grant: still in flight when the job asked for it, or sent later."""
        return [
            act
            for act in self.acts
            if act.job == window.job
            and act.group in (window.group, "")
            and act.returned >= window.requested
        ]


class PromiseRun:
    """One run; :meth:`run` returns its :class:`PromiseResult`."""

    def __init__(self, config: PromiseConfig) -> None:
        config.check()
        self.config = config
        self.rng = random.Random(config.seed)
        self.book = Book()
        self.kills = 0
        self._stop_at = 0.0
        agents = [
            cluster.SimAgent(
                name=name,
                devices=2,
                capacity_bytes=80 * device.GiB,
                footprint_bytes=device.GiB,
                bandwidth_bytes_per_s=200 * device.GiB,
                latency_s=0.0,
            )
            for name in NODES
        ]
        self.local = cluster.LocalCluster(
            agents=agents,
            groups=TOPOLOGY,
            base_dir=config.base_dir,
            log_level=config.log_level,
            # Short: a grant whose answer a kill lost, and that no retry claims, ends soon.
            orchestrator_args=["--reattach-grace", "5"],
        )

    async def run(self) -> PromiseResult:
        started = time.monotonic()
        await asyncio.to_thread(self.local.start)
        try:
            address = self.local.orchestrator_address
            self._stop_at = time.monotonic() + self.config.duration_s
            processes = [
                asyncio.ensure_future(self._process(address, f"job-{j}", p))
                for j in range(self.config.jobs)
                for p in range(self.config.processes)
            ]
            chaos = [
                asyncio.ensure_future(self._evictions(address)),
                asyncio.ensure_future(self._drains(address)),
            ]
            if self.config.kill_gap_s is not None:
                chaos.append(asyncio.ensure_future(self._kills()))
            try:
                await asyncio.gather(*chaos)  # they end at the duration
                done, stuck = await asyncio.wait(processes, timeout=self.config.finish_s)
                for task in done:
                    task.result()
            finally:
                for task in [*processes, *chaos]:
                    task.cancel()
                await asyncio.gather(*processes, *chaos, return_exceptions=True)
            wedged = await self._audit(address)
            journal = self.local.read_journals()
        finally:
            await asyncio.to_thread(self.local.stop)
        windows = self.book.close_windows()
        violations = checker.check(
            journal=journal,
            windows=windows,
            group_nodes={g: list(n) for g, n in TOPOLOGY.items()},
            conflicts=CONFLICTS,
        )
        return PromiseResult(
            seed=self.config.seed,
            counts=dict(self.book.counts),
            kills=self.kills,
            windows=len(windows),
            ended_by=dict(collections.Counter(w.ended_by or "open" for w in windows)),
            violations=tuple(str(v) for v in violations),
            problems=tuple(self.book.problems),
            stuck=len(stuck),
            wedged=tuple(wedged),
            wall_s=time.monotonic() - started,
        )

    # ---- the jobs ---------------------------------------------------------------------------

    def _more(self) -> bool:
        return time.monotonic() < self._stop_at

    async def _process(self, address: str, job: str, index: int) -> None:
        rng = random.Random(f"{self.config.seed}:{job}:{index}")
        async with tsclient.AsyncClient(address, job_id=job, lease_s=None) as client:
            while self._more():
                names = rng.sample(GROUPS, rng.choice([1, 1, 2, 2, 3]))
                timeout = rng.uniform(*(_ACQUIRE_TIMEOUT_S if len(names) == 1 else _SET_TIMEOUT_S))
                call = asyncio.ensure_future(self._take(client, job, names, timeout))
                if rng.random() < 0.15:  # the process gives up early: a cancelled call
                    await asyncio.wait({call}, timeout=rng.uniform(0, 1.0))
                    call.cancel()
                got = await asyncio.gather(call, return_exceptions=True)
                held = got[0] if isinstance(got[0], list) else []
                # Its work: mostly short, now and then long enough to be evicted during it.
                await asyncio.sleep(rng.uniform(0.3, 1.0) if rng.random() < 0.3 else 0.02)
                for group in rng.sample(held, len(held)):
                    await self._give(client, job, group)
                await asyncio.sleep(rng.uniform(0, 0.05))

    async def _take(
        self, client: tsclient.AsyncClient, job: str, groups: Sequence[str], timeout: float
    ) -> list[str]:
        asked = time.time()
        kind = "acquire" if len(groups) == 1 else "acquire_set"
        try:
            if len(groups) == 1:
                result = await client.acquire(groups[0], timeout=timeout)
                epochs = {groups[0]: result.grant_epoch}
            else:
                results = await client.acquire_set(groups, timeout=timeout)
                epochs = {g: r.grant_epoch for g, r in results.items()}
        except asyncio.CancelledError:
            self.book.counts[f"{kind} cancelled"] += 1
            raise
        except errors.RPCError as err:
            self.book.counts[f"{kind} {type(err).__name__}"] += 1
            return []
        self.book.told(job, epochs, asked)
        self.book.counts[f"{kind} granted"] += 1
        return list(epochs)

    async def _give(self, client: tsclient.AsyncClient, job: str, group: str) -> None:
        act = self.book.sending("yield", job, group)
        try:
            await client.yield_(group, timeout=30)
        except errors.RPCError as err:
            self.book.counts[f"yield {type(err).__name__}"] += 1
            self.book.yield_refused(job, group, act.sent, err, own=act)
            return
        finally:
            act.returned = time.time()
        self.book.counts["yield"] += 1

    # ---- the administrator and the kills ----------------------------------------------------

    async def _evictions(self, address: str) -> None:
        async with tsclient.AsyncClient(address, job_id=None, lease_s=None) as admin:
            while await self._pause(self.config.evict_gap_s):
                holding = self.book.holding()
                if holding and self.rng.random() < 0.7:  # mostly a holder: its grant ends
                    job, group = self.rng.choice(sorted(holding))
                else:
                    job = f"job-{self.rng.randrange(self.config.jobs)}"
                    group = self.rng.choice(GROUPS)
                group = "" if self.rng.random() < 0.25 else group  # "": from every group
                # Recorded whatever the answer: a call cut by a kill may have been applied.
                act = self.book.sending("eviction", job, group)
                with contextlib.suppress(errors.RPCError):
                    evicted = await admin.evict(group, job, reason=EVICTION_REASON)
                    self.book.counts["evictions"] += len(evicted)
                act.returned = time.time()

    async def _drains(self, address: str) -> None:
        async with tsclient.AsyncClient(address, job_id=None, lease_s=None) as admin:
            while await self._pause(self.config.drain_gap_s):
                group = self.rng.choice(GROUPS)
                with contextlib.suppress(errors.RPCError):
                    await admin.drain(group)
                    self.book.counts["drains"] += 1
                    await asyncio.sleep(self.rng.uniform(0.2, 1.0))
                # Resumed whatever happened (retried across a restart).
                for attempt in itertools.count():
                    try:
                        await admin.resume(group)
                        break
                    except errors.RPCError:
                        if attempt >= 20:
                            raise
                        await asyncio.sleep(0.5)

    async def _kills(self) -> None:
        assert self.config.kill_gap_s is not None
        while await self._pause(self.config.kill_gap_s):
            self.local.kill(cluster.ORCHESTRATOR)
            self.kills += 1
            await asyncio.to_thread(self.local.restart, cluster.ORCHESTRATOR)

    async def _pause(self, gap: tuple[float, float]) -> bool:
        """Wait a random gap; False once the run's duration is over."""
        await asyncio.sleep(min(self.rng.uniform(*gap), max(0.0, self._stop_at - time.monotonic())))
        return self._more()

    async def _audit(self, address: str) -> list[str]:
        """Every group can be acquired once every job has finished (none is wedged)."""
        wedged = []
        async with tsclient.AsyncClient(address, job_id="auditor", lease_s=None) as auditor:
            for group in GROUPS:
                try:
                    await auditor.acquire(group, timeout=30)
                    await auditor.yield_(group)
                except errors.RPCError as err:
                    wedged.append(f"{group}: {err}")
        return wedged


@dataclasses.dataclass(frozen=True)
class PromiseResult:
    seed: int
    counts: Mapping[str, int]
    kills: int
    windows: int
    #: How the windows ended in the jobs' records: yield, eviction, open.
    ended_by: Mapping[str, int]
    violations: tuple[str, ...]
    problems: tuple[str, ...]
    #: Processes that did not finish within the bound after the duration.
    stuck: int
    wedged: tuple[str, ...]
    wall_s: float

    @property
    def ok(self) -> bool:
        return not (self.violations or self.problems or self.stuck or self.wedged)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "kills": self.kills,
            "windows": self.windows,
            "ended_by": dict(self.ended_by),
            "counts": dict(sorted(self.counts.items())),
            "violations": len(self.violations) + len(self.problems),
            "violation_details": [*self.violations, *self.problems],
            "stuck": self.stuck,
            "wedged": list(self.wedged),
            "wall_s": round(self.wall_s, 1),
        }

    def summary(self) -> str:
        return "\n".join(self._lines())

    def _lines(self) -> Iterator[str]:
        yield f"seed {self.seed}: {'ok' if self.ok else 'FAILED'} in {self.wall_s:.1f} s"
        yield f"orchestrator SIGKILLs: {self.kills}"
        ended = ", ".join(f"{k} {n}" for k, n in sorted(self.ended_by.items()))
        yield f"grants answered: {self.windows} ({ended})"
        yield "calls: " + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        yield f"violations: {len(self.violations) + len(self.problems)}"
        yield from (f"  {v}" for v in (*self.violations, *self.problems))
        yield f"stuck processes: {self.stuck}; wedged groups: {len(self.wedged)}"
        yield from (f"  wedged: {w}" for w in self.wedged)


async def run_promises(config: PromiseConfig) -> PromiseResult:
    return await PromiseRun(config).run()
