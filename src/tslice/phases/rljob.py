"""A simulated RL job: the phases of :mod:`tslice.phases.trace` played against a real orchestrator.

The job does what a training loop wrapped with tslice does: before a phase it
acquires the pools the phase needs, sleeps for the phase's duration (trace seconds
divided by the time scale: the GPU work), and releases pools the next phase does not
need. Holding the trainer while asking for the sampler (the weight hand-over at the
start of a step) is the only hold-and-wait in the plan, and nobody ever holds the
sampler while asking for the trainer, so jobs cannot deadlock.

A fully asynchronous job runs several *lanes* at once (e.g. generation on the sampler
while training on the trainer), each a plan of its own with the same job id; a pool
the job has to itself (not in ``groups``) is never asked for: its windows are
recorded without an RPC, nobody else can hold it.

Every acquire and yield is recorded with wall-clock timestamps (``time.time()``, the
clock the simulated devices journal with) so that the checker, the summary and the
timeline work from what the job really saw.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence

import tslice.client as tsclient
from tslice.common import errors
from tslice.phases import trace


@dataclasses.dataclass(frozen=True)
class Window:
    """One acquire of ``group`` by ``job``: asked at ``requested``, held [acquired, yielded]."""

    run: str
    job: str
    pool: str
    group: str
    step: int
    phase: str
    requested: float
    acquired: float | None = None
    yielded: float | None = None
    waited_ms: int = 0
    context_restored: bool = False
    grant_epoch: int = 0
    error: str = ""


@dataclasses.dataclass(frozen=True)
class JobUpdate:
    """Progress of a job for live views: what it does now and which pools it holds."""

    run: str
    job: str
    step: int
    steps: int
    #: Phase being worked on, ``wait <pool>`` while queued, or ``done``/``failed``.
    activity: str
    holding: tuple[str, ...]
    t: float


@dataclasses.dataclass(frozen=True)
class SimJob:
    """What one job runs: its plan, where each pool lives and how fast time goes."""

    job_id: str
    #: Lanes run at the same time, each a list of steps of phases (sync jobs: one lane).
    lanes: Sequence[Sequence[Sequence[trace.Phase]]]
    #: Pool name -> orchestrator group id; a pool not named here is the job's own.
    groups: Mapping[str, str]
    #: Pool name -> device bytes per node the job occupies while resident (0 = agent default).
    footprints: Mapping[str, int]
    #: Trace seconds per wall-clock second.
    time_scale: float
    #: Phase stretch while sharing the host with other jobs (``PhaseModel.contention``).
    slowdown: float = 1.0


@dataclasses.dataclass(frozen=True)
class JobResult:
    run: str
    job: str
    started: float
    finished: float
    steps_done: int
    windows: tuple[Window, ...]
    error: str = ""


UpdateCallback = Callable[[JobUpdate], None]


async def run_job(
    job: SimJob,
    *,
    address: str,
    run: str,
    on_update: UpdateCallback | None = None,
    acquire_timeout_s: float | None = None,
) -> JobResult:
    """Play ``job``'s plan against the orchestrator at ``address``; never raises for RPC errors.

    A failed acquire ends the job early; the result's ``error`` says why and the
    window stays without ``acquired`` so the checker reports it.
    """
    runners: list[_Runner] = []

    def holding() -> tuple[str, ...]:
        return tuple(sorted(pool for r in runners for pool in r.held))

    runners.extend(
        _Runner(
            job,
            plan,
            run=run,
            on_update=on_update,
            acquire_timeout_s=acquire_timeout_s,
            holding=holding,
        )
        for plan in job.lanes
    )
    started = time.time()
    # A job with every pool to itself asks nobody: no orchestrator, no client.
    client = tsclient.AsyncClient(address, job_id=job.job_id) if job.groups else None
    try:
        await asyncio.gather(*(_play(runner, client) for runner in runners))
    finally:
        if client is not None:
            await client.close()
    return JobResult(
        run=run,
        job=job.job_id,
        started=started,
        finished=time.time(),
        steps_done=min(r.steps_done for r in runners),
        windows=tuple(sorted((w for r in runners for w in r.windows), key=lambda w: w.requested)),
        error="; ".join(r.error for r in runners if r.error),
    )


async def _play(runner: _Runner, client: tsclient.AsyncClient | None) -> None:
    try:
        await runner.play(client)
    except errors.TsliceError as err:
        runner.error = str(err)
        runner.report("failed")
    finally:
        await runner.release_all(client)


class _Runner:
    def __init__(
        self,
        job: SimJob,
        plan: Sequence[Sequence[trace.Phase]],
        *,
        run: str,
        on_update: UpdateCallback | None,
        acquire_timeout_s: float | None,
        holding: Callable[[], tuple[str, ...]],
    ) -> None:
        self.job = job
        self.plan = plan
        self.holding = holding
        self.run = run
        self.on_update = on_update
        self.acquire_timeout_s = acquire_timeout_s
        self.windows: list[Window] = []
        self.held: dict[str, int] = {}  # pool -> index of its open window
        self.started = time.time()
        self.steps_done = 0
        self.step = 0
        self.error = ""

    def report(self, activity: str) -> None:
        if self.on_update is None:
            return
        self.on_update(
            JobUpdate(
                run=self.run,
                job=self.job.job_id,
                step=self.step,
                steps=len(self.plan),
                activity=activity,
                holding=self.holding(),
                t=time.time(),
            )
        )

    async def play(self, client: tsclient.AsyncClient | None) -> None:
        self.started = time.time()
        for step, phases in enumerate(self.plan):
            self.step = step
            for phase in phases:
                for pool in sorted(set(self.held) - set(phase.pools)):
                    await self.release(client, pool)
                for pool in phase.pools:
                    if pool not in self.held:
                        await self.acquire(client, pool, phase.name)
                self.report(phase.name)
                await asyncio.sleep(phase.duration_s * self.job.slowdown / self.job.time_scale)
            self.steps_done = step + 1
        for pool in sorted(self.held):
            await self.release(client, pool)
        self.report("done")

    async def acquire(self, client: tsclient.AsyncClient | None, pool: str, phase: str) -> None:
        group = self.job.groups.get(pool, "")
        self.report(f"wait {pool}")
        requested = time.time()
        index = len(self.windows)
        self.windows.append(
            Window(
                run=self.run,
                job=self.job.job_id,
                pool=pool,
                group=group,
                step=self.step,
                phase=phase,
                requested=requested,
            )
        )
        if not group:  # the job's own pool: nobody to ask
            self.windows[index] = dataclasses.replace(self.windows[index], acquired=requested)
            self.held[pool] = index
            return
        assert client is not None  # a job with groups has a client
        try:
            result = await client.acquire(
                group,
                timeout=self.acquire_timeout_s,
                footprint_bytes=self.job.footprints.get(pool) or None,
            )
        except errors.TsliceError as err:
            self.windows[index] = dataclasses.replace(self.windows[index], error=str(err))
            raise
        self.windows[index] = dataclasses.replace(
            self.windows[index],
            acquired=time.time(),
            waited_ms=result.waited_ms,
            context_restored=result.context_restored,
            grant_epoch=result.grant_epoch,
        )
        self.held[pool] = index

    async def release(self, client: tsclient.AsyncClient | None, pool: str) -> None:
        index = self.held.pop(pool)
        # The window closes when the job lets go, before the RPC: the device may be
        # snapshotted as soon as the orchestrator reads the Yield.
        self.windows[index] = dataclasses.replace(self.windows[index], yielded=time.time())
        if pool in self.job.groups:
            assert client is not None
            await client.yield_(self.job.groups[pool])

    async def release_all(self, client: tsclient.AsyncClient | None) -> None:
        for pool in sorted(self.held):
            try:
                await self.release(client, pool)
            except errors.TsliceError as err:
                self.error = self.error or f"yield of {pool} failed: {err}"
