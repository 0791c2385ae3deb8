"""Derivation of the phase model (:class:`tslice.phases.trace.PhaseModel`) from a recorded run.

Per job of ``timeslice``, over the job's own lock windows and acquire events:

* A *request* time is ``acquired - max(wait_ms, restore_ms)``: the trace's ``wait_ms``
  includes the restore, except on a free pool where it is 0. Between a request and its
  grant the job waits: waiting is never counted as work.
* Synchronous jobs (one lane): walking the job's grants, yields and requests in time
  order splits its time into stretches holding a constant set of pools (none = CPU).
  Stretches while a request is pending are waits and are dropped; stretches shorter
  than :data:`MIN_PHASE_S` are rounding noise and are dropped. The acquire events'
  ``step`` splits the stretches into RL steps (a step starts at its first grant). Step 0
  also covers model loading and is left out; the steps left are *steady*, and the most
  common sequence of pool sets among them is the job's step. Each phase of it is the
  median (and spread) over the steady steps with that sequence.
* Fully asynchronous jobs (``meta.mode`` says ``async``; without ``meta.mode``: a job
  whose windows on different pools overlap for most of its time): one lane per pool,
  each a cycle of holding the pool (``t1 - t0``) and an idle gap (the yield to the next
  request), window 0 (loading) left out.
* A pool is *private* when windows of different jobs overlap on it (each had its own
  device) or, with several jobs, only one job uses it; else it is *shared*, and its
  switch cost is the median of its ``ckpt_done`` / ``restore_done`` events' ``ms``.
* Jobs that hold shared pools while asking for others in a cycle (A holds x asking for
  y, B holds y asking for x) are refused: their replay could deadlock.
* Contention: the baseline duty curves (``baseline.duty_gpus``, one job alone) show a
  step period (mean spacing of the onsets of activity, the median over GPUs). A
  time-sliced step of the trace (the median over jobs of their longest lane) takes
  longer: the jobs slowed each other down on the shared host. Their ratio (at least 1)
  is the contention; without a baseline it is 1.
"""

from __future__ import annotations

import bisect
import collections
import graphlib
import itertools
import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tslice.common import errors, validation
from tslice.phases import trace

#: Stretches shorter than this (trace seconds) are rounding noise of the recording.
MIN_PHASE_S = 0.5
#: Share of a job's held time that its pools overlap from which the job is asynchronous.
_ASYNC_OVERLAP = 0.5
_MATCH_S = 0.15


class _Window(NamedTuple):
    pool: str
    job: str
    t0: float
    t1: float
    requested: float
    step: int


class _Stretch(NamedTuple):
    pools: frozenset[str] | None  # None: waiting
    start: float
    duration: float


class _Reader:
    """Field access that names the missing field and what it is needed for."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> trace.TraceError:
        return trace.TraceError(f"trace {self.source}: {message}")

    def field(self, obj: Any, key: str, path: str, why: str) -> Any:
        if not isinstance(obj, Mapping):
            raise self.fail(f"{path} must be a JSON object (needed for {why})")
        if key not in obj:
            raise self.fail(f"{path}.{key} is missing (needed for {why})".lstrip("."))
        return obj[key]

    def number(self, obj: Any, key: str, path: str, why: str) -> float:
        value = self.field(obj, key, path, why)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{path}.{key} must be a number (got {value!r}; needed for {why})")
        return float(value)

    def items(self, obj: Any, path: str, why: str) -> list[Any]:
        if not isinstance(obj, list):
            raise self.fail(f"{path} must be a list (needed for {why})")
        return obj


def model(raw: Mapping[str, Any], *, source: str = "<trace>") -> trace.PhaseModel:
    """The phase model of a parsed trace (see the module docstring)."""
    r = _Reader(source)
    ts = r.field(raw, "timeslice", "", "the time-sliced run every phase is measured on")
    by_pool = r.field(ts, "windows", "timeslice", "the lock windows of each pool")
    if not isinstance(by_pool, Mapping) or not by_pool:
        raise r.fail("timeslice.windows has no pool (needed for the lock windows of each pool)")
    events = r.items(
        r.field(ts, "events", "timeslice", "request times, RL steps and switch costs"),
        "timeslice.events",
        "request times, RL steps and switch costs",
    )
    windows = _windows(r, by_pool, _acquired(r, events))
    # A pool nobody held says nothing about the jobs: it is left out.
    pools = _pool_order(
        raw.get("pool_map"), [p for p in by_pool if any(w.pool == p for w in windows)]
    )
    for pool in pools:
        try:
            validation.check_id("a pool's group id", pool)
        except validation.InvalidIdError as err:
            raise r.fail(f"pool {pool!r} of timeslice.windows cannot name a group: {err}") from None
    jobs = sorted({w.job for w in windows})
    private = tuple(p for p in pools if _is_private([w for w in windows if w.pool == p], jobs))
    mode = _mode(r, raw.get("meta"), windows, jobs)
    shapes = tuple(
        _async_shape(r, job, windows, pools)
        if mode == trace.ASYNC
        else _sync_shape(r, job, windows)
        for job in jobs
    )
    shared = tuple(p for p in pools if p not in private)
    _check_wait_order(r, shapes, shared)
    baseline_step = _baseline_step(r, raw.get("baseline"))
    cycle = statistics.median(s.cycle_s for s in shapes)
    return trace.PhaseModel(
        source=source,
        mode=mode,
        pools=shared + private,
        private=private,
        jobs=shapes,
        switch={pool: _switch_cost(r, events, pool) for pool in shared},
        baseline_step_s=baseline_step,
        contention=max(cycle / baseline_step, 1.0) if baseline_step else 1.0,
        recorded=_recorded(raw.get("summary")),
    )


def _pool_order(pool_map: Any, names: Sequence[str]) -> list[str]:
    """The windows' pools in the order of the GPUs they map to (``pool_map``), then the rest."""
    ordered: list[str] = []
    if isinstance(pool_map, Mapping):
        for _, pool in sorted(pool_map.items(), key=lambda kv: str(kv[0]).zfill(8)):
            if pool in names and pool not in ordered:
                ordered.append(pool)
    return ordered + [p for p in names if p not in ordered]


def _acquired(
    r: _Reader, events: list[Any]
) -> dict[tuple[str, str], list[tuple[float, float, int]]]:
    """(job, pool) -> [(granted at, requested at, step)] from the ``acquired`` events."""
    why = "telling waiting from work and splitting RL steps"
    out: dict[tuple[str, str], list[tuple[float, float, int]]] = collections.defaultdict(list)
    for i, e in enumerate(events):
        if not isinstance(e, Mapping) or e.get("kind") != "acquired":
            continue
        path = f"timeslice.events[{i}]"
        t = r.number(e, "t", path, why)
        waited = max(r.number(e, "wait_ms", path, why), float(e.get("restore_ms", 0))) / 1000.0
        step = int(r.number(e, "step", path, why))
        key = (str(r.field(e, "job", path, why)), str(r.field(e, "pool", path, why)))
        out[key].append((t, t - waited, step))
    return out


def _windows(
    r: _Reader,
    by_pool: Mapping[str, Any],
    acquired: Mapping[tuple[str, str], list[tuple[float, float, int]]],
) -> list[_Window]:
    out: list[_Window] = []
    # Each (job, pool)'s grants in time order, so that a window finds its own by bisection
    # (a scan of them all per window was quadratic in a long recording).
    ordered = {key: sorted(grants, key=lambda a: a[0]) for key, grants in acquired.items()}
    times = {key: [a[0] for a in grants] for key, grants in ordered.items()}
    for pool, items in by_pool.items():
        for i, w in enumerate(r.items(items, f"timeslice.windows.{pool}", "the pool's windows")):
            path = f"timeslice.windows.{pool}[{i}]"
            job = str(r.field(w, "job", path, "the job that held the pool"))
            t0 = r.number(w, "t0", path, "when the pool was granted")
            t1 = r.number(w, "t1", path, "when the pool was yielded")
            at = times.get((job, pool), [])
            near = ordered.get((job, pool), [])
            lo = bisect.bisect_left(at, t0 - _MATCH_S)
            hi = bisect.bisect_right(at, t0 + _MATCH_S)
            match = [a for a in near[lo:hi] if abs(a[0] - t0) <= _MATCH_S]
            if not match:
                raise r.fail(
                    f"{path} (job {job}, t0={t0:g}) has no 'acquired' event of job {job} on "
                    f"pool {pool} at t={t0:g} in timeslice.events (needed for its request "
                    "time and RL step)"
                )
            _, requested, step = min(match, key=lambda a: abs(a[0] - t0))
            out.append(_Window(pool, job, t0, t1, min(requested, t0), step))
    return sorted(out, key=lambda w: (w.t0, w.pool))


def _is_private(windows: Sequence[_Window], jobs: Sequence[str]) -> bool:
    users = {w.job for w in windows}
    if len(jobs) > 1 and len(users) == 1:
        return True
    ordered = sorted(windows, key=lambda w: w.t0)
    # The latest end of any job's windows so far, and the latest of any other job: enough
    # to ask "does another job still hold it?" in O(1) (asking every job was quadratic).
    first: tuple[float, str] | None = None
    second: tuple[float, str] | None = None
    for w in ordered:
        other = second if first is not None and first[1] == w.job else first
        if other is not None and other[0] > w.t0 + _MATCH_S:
            return True
        if first is not None and first[1] == w.job:
            first = (max(first[0], w.t1), w.job)
        elif first is None or w.t1 > first[0]:
            first, second = (w.t1, w.job), first
        elif second is None or w.t1 > second[0]:
            second = (w.t1, w.job)
    return False


def _mode(r: _Reader, meta: Any, windows: Sequence[_Window], jobs: Sequence[str]) -> str:
    declared = str(meta.get("mode", "")).lower() if isinstance(meta, Mapping) else ""
    if "async" in declared:
        return trace.ASYNC
    if "sync" in declared:
        return trace.SYNC
    by_job: dict[str, list[_Window]] = collections.defaultdict(list)
    for w in windows:
        by_job[w.job].append(w)
    for job in jobs:
        mine = by_job.get(job, [])
        held = sum(w.t1 - w.t0 for w in mine)
        if held > 0 and 2 * _cross_pool_overlap(mine) / held > _ASYNC_OVERLAP:
            return trace.ASYNC
    return trace.SYNC


def _cross_pool_overlap(windows: Sequence[_Window]) -> float:
    """Sum over pairs of windows on different pools of their overlap, by one sweep: at each
    moment ``n`` windows are open, ``c_p`` of them on pool ``p``, and the pairs on different
    pools number ``(n**2 - sum c_p**2) / 2`` (summing every pair was quadratic)."""
    edges = sorted(
        [(w.t0, 1, w.pool) for w in windows if w.t1 > w.t0]
        + [(w.t1, -1, w.pool) for w in windows if w.t1 > w.t0]
    )
    open_on: collections.Counter[str] = collections.Counter()
    total, squares, last, overlap = 0, 0, 0.0, 0.0
    for t, change, pool in edges:
        overlap += (t - last) * (total * total - squares) / 2
        last = t
        squares += 2 * change * open_on[pool] + 1  # (c + change)**2 - c**2, change = +-1
        open_on[pool] += change
        total += change
    return overlap


def _stretches(windows: Sequence[_Window]) -> list[_Stretch]:
    """The job's time cut at every request, grant and yield; waits have ``pools=None``."""
    points: list[tuple[float, int, str, str]] = []
    for w in windows:
        points += [(w.t1, 0, "yield", w.pool), (w.requested, 1, "ask", w.pool)]
        points.append((w.t0, 2, "grant", w.pool))
    points.sort()
    held: set[str] = set()
    pending: collections.Counter[str] = collections.Counter()
    out: list[_Stretch] = []
    last = points[0][0]
    for t, _, kind, pool in points:
        if t > last:
            pools = None if +pending else frozenset(held)
            if out and out[-1].pools == pools:
                out[-1] = out[-1]._replace(duration=out[-1].duration + t - last)
            else:
                out.append(_Stretch(pools, last, t - last))
        last = max(last, t)
        if kind == "yield":
            held.discard(pool)
        elif kind == "ask":
            pending[pool] += 1
        else:
            pending[pool] -= 1
            held.add(pool)
    return out


def _phase_name(pools: frozenset[str], seen: collections.Counter[str]) -> str:
    base = "+".join(sorted(pools)) or "cpu"
    seen[base] += 1
    return base if seen[base] == 1 else f"{base}#{seen[base]}"


def _sync_shape(r: _Reader, job: str, windows: Sequence[_Window]) -> trace.JobShape:
    mine = [w for w in windows if w.job == job]
    starts: dict[int, float] = {}
    for w in mine:
        starts[w.step] = min(starts.get(w.step, w.t0), w.t0)
    order = sorted(starts, key=lambda s: starts[s])
    steps: dict[int, list[_Stretch]] = {s: [] for s in order}
    for stretch in _stretches(mine):
        if stretch.pools is None or stretch.duration < MIN_PHASE_S:
            continue
        owner = [s for s in order if starts[s] <= stretch.start + 1e-9]
        if owner:
            steps[owner[-1]].append(stretch)
    steady = {s: stretches for s, stretches in steps.items() if s != order[0] and stretches}
    signatures = collections.Counter(tuple(x.pools for x in v) for v in steady.values())
    if not signatures:
        raise r.fail(
            f"job {job} has fewer than two RL steps (the 'step' of its acquired events in "
            "timeslice.events): step 0 covers model loading, so at least one more is needed"
        )
    template = max(signatures, key=lambda sig: (signatures[sig], -_first(steady, sig)))
    matching = [v for v in steady.values() if tuple(x.pools for x in v) == template]
    sets = [pools for pools in template if pools is not None]  # waits were dropped above
    seen: collections.Counter[str] = collections.Counter()
    lane = tuple(
        trace.PhaseStat(
            _phase_name(pools, seen),
            tuple(sorted(pools)),
            trace.Stat.of([v[i].duration for v in matching]),
        )
        for i, pools in enumerate(sets)
    )
    return trace.JobShape(job=job, lanes=(lane,), recorded_steps=1 + len(matching))


def _first(steady: Mapping[int, list[_Stretch]], signature: tuple[Any, ...]) -> int:
    return min(s for s, v in steady.items() if tuple(x.pools for x in v) == signature)


def _async_shape(
    r: _Reader, job: str, windows: Sequence[_Window], pools: Sequence[str]
) -> trace.JobShape:
    lanes: list[tuple[trace.PhaseStat, ...]] = []
    steps: list[int] = []
    for pool in pools:
        mine = sorted((w for w in windows if w.job == job and w.pool == pool), key=lambda w: w.t0)
        if not mine:
            continue
        if len(mine) < 3:
            raise r.fail(
                f"job {job} has {len(mine)} window(s) on pool {pool} in timeslice.windows."
                f"{pool}: an asynchronous lane needs at least 3 (window 0 covers loading)"
            )
        holds = [w.t1 - w.t0 for w in mine[1:]]
        gaps = [max(nxt.requested - w.t1, 0.0) for w, nxt in itertools.pairwise(mine[1:])]
        lanes.append(
            (
                trace.PhaseStat(pool, (pool,), trace.Stat.of(holds)),
                trace.PhaseStat(f"{pool} idle", (), trace.Stat.of(gaps)),
            )
        )
        steps.append(len(mine))
    return trace.JobShape(job=job, lanes=tuple(lanes), recorded_steps=min(steps))


def _check_wait_order(r: _Reader, shapes: Sequence[trace.JobShape], shared: Sequence[str]) -> None:
    """Refuse jobs that hold shared pools while asking for others in a cycle (A holds x
    asking for y, B holds y asking for x): replaying them can deadlock.

    A replayed job asks for a phase's new pools in sorted order while keeping the pools
    the previous phase held too (the step repeats, so the last phase precedes the first).
    """
    edges: dict[tuple[str, str], str] = {}
    for shape in shapes:
        for lane in shape.lanes:
            for before, after in zip((lane[-1], *lane[:-1]), lane, strict=True):
                kept = [p for p in before.pools if p in after.pools and p in shared]
                asked = [p for p in after.pools if p not in before.pools and p in shared]
                for i, pool in enumerate(asked):
                    for held in [*kept, *asked[:i]]:
                        edges.setdefault((held, pool), shape.job)
    order: dict[str, set[str]] = collections.defaultdict(set)
    for held, pool in edges:
        order[pool].add(held)
    try:
        tuple(graphlib.TopologicalSorter(order).static_order())
    except graphlib.CycleError as err:
        cycle: list[str] = err.args[1]
        waits = ", ".join(
            f"job {edges[(held, pool)]} holds {held} while asking for {pool}"
            for held, pool in itertools.pairwise(cycle)
        )
        raise r.fail(
            f"{waits}: replaying these jobs can deadlock (every job needs one lock order)"
        ) from None


def _switch_cost(r: _Reader, events: list[Any], pool: str) -> trace.SwitchCost:
    def durations(kind: str) -> list[float]:
        out = []
        for i, e in enumerate(events):
            if isinstance(e, Mapping) and e.get("kind") == kind and e.get("pool") == pool:
                out.append(r.number(e, "ms", f"timeslice.events[{i}]", f"{pool}'s switch cost"))
        if not out:
            raise r.fail(
                f"timeslice.events has no {kind!r} event of pool {pool!r}, which jobs share: "
                f"its {'snapshot' if kind == 'ckpt_done' else 'restore'} time is needed "
                "for the pool's switch cost"
            )
        return [ms / 1000.0 for ms in out]

    return trace.SwitchCost(
        snapshot=trace.Stat.of(durations("ckpt_done")),
        restore=trace.Stat.of(durations("restore_done")),
    )


def _baseline_step(r: _Reader, baseline: Any) -> float | None:
    """Median over GPUs of the mean spacing between onsets of activity; None: no baseline."""
    if baseline is None:
        return None
    curves = r.field(baseline, "duty_gpus", "baseline", "the step period of a job alone")
    periods: list[float] = []
    for gpu, curve in curves.items() if isinstance(curves, Mapping) else []:
        points = r.items(curve, f"baseline.duty_gpus.{gpu}", "the step period of a job alone")
        onsets = [
            float(points[i][0])
            for i in range(1, len(points))
            if points[i][1] > 0 and points[i - 1][1] <= 0
        ]
        if len(onsets) >= 2:
            periods.append((onsets[-1] - onsets[0]) / (len(onsets) - 1))
    if not periods:
        raise r.fail(
            "baseline.duty_gpus shows fewer than two onsets of activity on every GPU "
            "(needed for the step period of a job alone; drop 'baseline' to assume no "
            "contention)"
        )
    return statistics.median(periods)


def _recorded(summary: Any) -> trace.Recorded:
    s: Mapping[str, Any] = summary if isinstance(summary, Mapping) else {}
    return trace.Recorded(
        speedup=float(s.get("speedup", 0.0)),
        duty_baseline_pct=float(s.get("duty_base", 0.0)),
        duty_time_sliced_pct=float(s.get("duty_ts", 0.0)),
        baseline_min=float(s.get("base_min", 0.0)),
        time_sliced_min=float(s.get("ts_min", 0.0)),
        switches=int(s.get("swaps", 0)),
        gpus_baseline=int(s.get("gpus_bl", 0)),
        gpus_time_sliced=int(s.get("gpus_ts", 0)),
    )


def load(path: Path | None = None) -> trace.PhaseModel:
    """Read a trace file (default: :func:`trace.default_trace_path`) and derive its phase
    model; :class:`ConfigError` if unusable."""
    trace_path = path or trace.default_trace_path()
    try:
        raw = json.loads(trace_path.read_text())
    except FileNotFoundError as err:
        raise errors.ConfigError(f"trace file {trace_path} does not exist") from err
    except (OSError, ValueError) as err:
        raise errors.ConfigError(f"trace file {trace_path} is not readable JSON: {err}") from err
    return model(raw, source=str(trace_path))
