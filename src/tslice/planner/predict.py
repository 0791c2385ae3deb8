"""The planner's throughput model: jobs sharing pools, played out in simulated time.

A discrete-event model of what :mod:`tslice.phases.rljob` does against the orchestrator,
without processes: every lane of every job walks its phases (before a phase it yields
the pools the phase does not need, then asks for the new ones in order, keeping what it
holds: the weight hand-over holds the trainer while asking for the sampler); each
shared pool is a FIFO lock. A hand-over to another job costs the pool's snapshot of the
resident job plus the restore of the incoming one (a job never loaded before has nothing
to restore), plus what whole switches took beyond those copies where the recording
measured them (an event log's SWITCH_DONE: the orchestrator's own work); a pool yielded
while nobody waits keeps its resident, so a job that asks again gets it back at no cost,
as the orchestrator's zero-cost re-acquire does. While jobs share, every phase is
stretched by the model's contention factor (the replay does the same).

This is the *predicted* side of a plan: fast enough to score every grouping of a few
jobs. :mod:`tslice.planner.simulate` checks the recommendation on the real
orchestrator.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence

from tslice.phases import trace

Lanes = Sequence[Sequence[Sequence[trace.Phase]]]
_Op = tuple[str, str, float]  # ("acquire" | "release" | "hold", pool, seconds)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """Jobs run together: when the last one finished, and what each pool did."""

    makespan_s: float
    #: Pool -> seconds some job held it.
    held_s: Mapping[str, float]
    #: Pool -> hand-overs from one job to another.
    switches: Mapping[str, int]
    #: Pool -> seconds spent moving state (snapshots + restores).
    switching_s: Mapping[str, float]


def solo_s(lanes: Lanes) -> float:
    """A job alone on pools of its own: its longest lane, uncontended, never switching."""
    return max(sum(p.duration_s for step in lane for p in step) for lane in lanes)


def pools_of(lanes: Lanes) -> set[str]:
    return {pool for lane in lanes for step in lane for p in step for pool in p.pools}


def _ops(lane: Sequence[Sequence[trace.Phase]], slowdown: float) -> Iterator[_Op]:
    held: set[str] = set()
    for step in lane:
        for phase in step:
            for pool in sorted(held - set(phase.pools)):
                held.discard(pool)
                yield ("release", pool, 0.0)
            for pool in phase.pools:
                if pool not in held:
                    held.add(pool)
                    yield ("acquire", pool, 0.0)
            yield ("hold", "", phase.duration_s * slowdown)
    for pool in sorted(held):
        yield ("release", pool, 0.0)


@dataclasses.dataclass
class _Pool:
    snapshot_s: float
    restore_s: float
    #: What a hand-over costs beyond its copies (the orchestrator's own work).
    overhead_s: float
    holder: str | None = None
    resident: str | None = None
    saved: set[str] = dataclasses.field(default_factory=set)
    queue: collections.deque[tuple[str, Callable[[], None]]] = dataclasses.field(
        default_factory=collections.deque
    )
    granted_at: float = 0.0
    held_s: float = 0.0
    switches: int = 0
    switching_s: float = 0.0


class _Engine:
    def __init__(
        self,
        switch: Mapping[str, trace.SwitchCost],
        shared: Sequence[str],
        overhead_s: Mapping[str, float],
    ) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.pools = {
            p: _Pool(switch[p].snapshot.median, switch[p].restore.median, overhead_s.get(p, 0.0))
            for p in shared
        }

    def at(self, t: float, then: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), then))

    def run(self) -> None:
        while self._heap:
            self.now, _, then = heapq.heappop(self._heap)
            then()

    def acquire(self, job: str, pool: str, then: Callable[[], None]) -> None:
        p = self.pools[pool]
        if p.holder is None and not p.queue:
            self._grant(p, job, then)
        else:
            p.queue.append((job, then))

    def release(self, pool: str) -> None:
        p = self.pools[pool]
        p.held_s += self.now - p.granted_at
        p.holder = None
        if p.queue:
            job, then = p.queue.popleft()
            self._grant(p, job, then)

    def _grant(self, p: _Pool, job: str, then: Callable[[], None]) -> None:
        p.holder = job
        cost = 0.0
        if p.resident is not None and p.resident != job:
            p.saved.add(p.resident)
            cost += p.snapshot_s + p.overhead_s
            p.switches += 1
        if p.resident != job and job in p.saved:
            p.saved.discard(job)
            cost += p.restore_s
        p.resident = job
        p.switching_s += cost

        def granted() -> None:
            p.granted_at = self.now
            then()

        self.at(self.now + cost, granted)


def together(
    plans: Mapping[str, Lanes],
    *,
    switch: Mapping[str, trace.SwitchCost],
    shared: Sequence[str],
    slowdown: float,
    overhead_s: Mapping[str, float] | None = None,
) -> Outcome:
    """``plans`` run at once on one set of ``shared`` pools (FIFO, see the module doc);
    ``overhead_s``: per pool, what a hand-over costs beyond its snapshot and restore."""
    engine = _Engine(switch, shared, overhead_s or {})
    finished: list[float] = []

    def play(job: str, ops: Iterator[_Op]) -> None:
        for kind, pool, seconds in ops:
            if kind == "hold":
                engine.at(engine.now + seconds, lambda: play(job, ops))
                return
            if pool not in engine.pools:  # a private pool: nobody to ask
                continue
            if kind == "release":
                engine.release(pool)
            else:
                engine.acquire(job, pool, lambda: play(job, ops))
                return
        finished.append(engine.now)

    for job, lanes in plans.items():
        for lane in lanes:
            play(job, _ops(lane, slowdown))
    engine.run()
    if len(finished) != sum(len(lanes) for lanes in plans.values()):
        raise RuntimeError("a lane never finished: the jobs' lock order can deadlock")
    return Outcome(
        makespan_s=max(finished),
        held_s={name: p.held_s for name, p in engine.pools.items()},
        switches={name: p.switches for name, p in engine.pools.items()},
        switching_s={name: p.switching_s for name, p in engine.pools.items()},
    )
