"""What a demo run measured, from what the jobs saw and what the orchestrator reported.

The jobs' acquire/yield windows give each pool's duty cycle (the share of the run it
was held); the orchestrator's events give the hand-overs and the median durations of
snapshots and restores, scaled back to trace seconds to compare with the recording.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import tslice.client as tsclient
from tslice.phases import rljob, trace


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """One run of the demo (exclusive or time-sliced), as measured."""

    name: str
    start: float
    end: float
    #: Share of the run's makespan each pool was held by some job.
    duty: Mapping[str, float]
    switches: int
    steps_done: int
    windows: tuple[rljob.Window, ...]
    errors: tuple[str, ...]

    @property
    def makespan_s(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class OpStats:
    """Median duration of one kind of device-state move on one pool."""

    count: int
    demo_ms: float
    trace_s: float
    recorded_trace_s: float


def event_time(event: tsclient.OrchestratorEvent) -> float:
    """When the orchestrator says the event happened (now, if it says nothing)."""
    return event.time.timestamp() if event.time is not None else time.time()


def summarise(
    name: str,
    start: float,
    end: float,
    results: Sequence[rljob.JobResult],
    events: Sequence[tsclient.OrchestratorEvent],
    *,
    pools: Sequence[str] = trace.POOLS,
    private: Sequence[str] = (),
) -> RunSummary:
    """The run from ``start`` to ``end``: what its jobs did and the switches in between.

    A shared pool's duty is the share of the run some job held it; a private pool's
    (one device per job) is the mean over the jobs of the share each held its own.
    """
    windows = tuple(w for r in results for w in r.windows)
    span = max(end - start, 1e-9)
    duty = {
        pool: (
            statistics.fmean(
                _held([w for w in windows if w.job == r.job], pool, start, end) for r in results
            )
            if pool in private
            else _held(windows, pool, start, end)
        )
        / span
        for pool in pools
    }
    # A hand-over from one job to another; a first grant on an empty pool is no switch.
    switches = sum(
        1
        for e in list(events)
        if e.kind == tsclient.EventKind.SWITCH_DONE
        and e.from_job
        and e.from_job != e.job_id
        and start <= event_time(e) <= end
    )
    return RunSummary(
        name=name,
        start=start,
        end=end,
        duty=duty,
        switches=switches,
        steps_done=sum(r.steps_done for r in results),
        windows=windows,
        errors=tuple(f"job {r.job}: {r.error}" for r in results if r.error),
    )


def handovers_s(windows: Sequence[rljob.Window], pool: str) -> list[float]:
    """Hand-overs of ``pool`` as the jobs felt them: one job's yield to the grant of a
    different job that was already waiting (switch, orchestration and reply included)."""
    held = sorted(
        (w for w in windows if w.pool == pool and w.acquired is not None),
        key=lambda w: w.acquired or 0.0,
    )
    out: list[float] = []
    for before, after in itertools.pairwise(held):
        if (
            before.job != after.job
            and before.yielded is not None
            and after.acquired is not None
            and after.requested < before.yielded
        ):
            out.append(after.acquired - before.yielded)
    return out


def _held(windows: Sequence[rljob.Window], pool: str, start: float, end: float) -> float:
    """Seconds within [start, end] that some job held ``pool`` (overlaps counted once)."""
    spans = sorted(
        (max(w.acquired, start), min(w.yielded if w.yielded is not None else end, end))
        for w in windows
        if w.pool == pool and w.acquired is not None
    )
    total, reach = 0.0, start
    for lo, hi in spans:
        begin = max(lo, reach)
        if hi > begin:
            total += hi - begin
            reach = hi
    return total


def op_stats(
    events: Sequence[tsclient.OrchestratorEvent], model: trace.PhaseModel, time_scale: float
) -> tuple[dict[str, OpStats], dict[str, OpStats]]:
    """Median snapshot and restore of each shared pool, beside the recorded medians."""

    def stats(kind: tsclient.EventKind, recorded: Callable[[str], float]) -> dict[str, OpStats]:
        out: dict[str, OpStats] = {}
        for pool in model.shared:
            ms = [e.duration_ms for e in events if e.kind == kind and e.group_id == pool]
            median = float(statistics.median(ms)) if ms else 0.0
            out[pool] = OpStats(
                count=len(ms),
                demo_ms=round(median, 1),
                trace_s=round(median / 1000.0 * time_scale, 2),
                recorded_trace_s=round(recorded(pool), 2),
            )
        return out

    return (
        stats(tsclient.EventKind.SNAPSHOT_DONE, lambda p: model.switch[p].snapshot.median),
        stats(tsclient.EventKind.RESTORE_DONE, lambda p: model.switch[p].restore.median),
    )
