"""A document in the recorded-run format (``shared/traces/*.json``) as a :class:`Timeline`.

The format: ``pool_map`` (GPU -> pool), ``jobs``, ``meta``, ``summary`` and one or two
runs, ``baseline`` (jobs alone) and ``timeslice``, each with ``duration_s``,
``windows.<pool>`` (``t0``, ``t1``, ``job``), ``events`` (``acquired``, ``yielded``,
``ckpt_done`` and ``restore_done`` with their ``ms``...) and ``duty_gpus.<gpu>`` (``[t,
percent]`` points). Exports of tslice's own history (:mod:`tslice.timeline.export`) add
``switches`` (whole switches) and a ``node`` on each move; other readers ignore them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tslice.common import errors
from tslice.timeline import model

_RUNS = (("baseline", "baseline: each job alone"), ("timeslice", "time-sliced"))
_MOVES = {"ckpt_done": model.SNAPSHOT, "restore_done": model.RESTORE}

#: Summary keys shown, in order, with their labels and how they read.
_SUMMARY = (
    ("speedup", "speedup", "{:g}x"),
    ("duty_base", "duty, baseline", "{:g} %"),
    ("duty_ts", "duty, time-sliced", "{:g} %"),
    ("base_min", "makespan, baseline", "{:g} min"),
    ("ts_min", "makespan, time-sliced", "{:g} min"),
    ("swaps", "switches", "{:g}"),
    ("med_ckpt_ms", "median snapshot", "{:g} ms"),
    ("med_restore_ms", "median restore", "{:g} ms"),
    ("med_switch_ms", "median switch", "{:g} ms"),
    ("cost_saving_pct", "GPU-hours saved", "{:g} %"),
)


class TimelineInputError(errors.ConfigError):
    """The document is not in the recorded-run format; the message names what is missing."""


def timeline(doc: Mapping[str, Any], *, title: str | None = None) -> model.Timeline:
    """The timeline of a recorded-run document (every run it has)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("timeslice"), Mapping):
        raise TimelineInputError(
            "not a recorded run: a JSON object with 'timeslice' (windows, events, duty_gpus) "
            "is needed, as in shared/traces/*.json or `tslice events --export FILE`"
        )
    pool_map = _pool_map(doc)
    runs = [
        _run(name, _mapping(doc.get(key)), pool_map)
        for key, name in _RUNS
        if _mapping(doc.get(key)).get("windows") or _mapping(doc.get(key)).get("duty_gpus")
    ]
    pools = pools_of(doc, runs)
    jobs = _jobs(doc, runs)
    meta = _mapping(doc.get("meta"))
    clock = str(meta.get("clock", "seconds of the recorded run"))
    return model.Timeline(
        title=title or str(doc.get("label") or meta.get("title") or "tslice timeline"),
        pools=pools,
        jobs=jobs,
        runs=runs,
        summary=summary_rows(doc),
        clock=clock,
    )


def run_of(doc: Mapping[str, Any], *, name: str) -> model.Run:
    """The time-sliced run of ``doc`` (the only one of an export) as ``name``."""
    return _run(name, _mapping(doc.get("timeslice")), _pool_map(doc))


def _pool_map(doc: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in _mapping(doc.get("pool_map")).items()}


def summary_rows(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    meta = _mapping(doc.get("meta"))
    for key in ("framework", "mode", "algo", "model", "hardware", "source", "started"):
        if isinstance(meta.get(key), str | int | float) and meta.get(key) != "":
            rows.append((key, str(meta[key])))
    summary = _mapping(doc.get("summary"))
    for key, label, fmt in _SUMMARY:
        value = summary.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            rows.append((label, fmt.format(round(value, 2))))
    held = _mapping(summary.get("held_s"))
    for job, seconds in sorted(held.items()):
        if isinstance(seconds, int | float):
            rows.append((f"held by {job}", model.duration_text(float(seconds))))
    return rows


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _items(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def _num(value: Any, default: float = 0.0) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default


def _run(name: str, run: Mapping[str, Any], pool_map: Mapping[str, str]) -> model.Run:
    windows_by_pool = _mapping(run.get("windows"))
    raw_windows = [
        (str(pool), w)
        for pool, items in windows_by_pool.items()
        for w in _items(items)
        if isinstance(w, Mapping)
    ]
    events = [e for e in _items(run.get("events")) if isinstance(e, Mapping)]
    duty = _mapping(run.get("duty_gpus"))
    starts = [_num(w.get("t0")) for _, w in raw_windows]
    starts += [_num(p[0]) for curve in duty.values() for p in _items(curve)[:1] if _items(p)]
    origin = min([0.0, *starts])
    acquired = {
        (str(e.get("job")), str(e.get("pool")), round(_num(e.get("t")), 3)): e
        for e in events
        if e.get("kind") == "acquired"
    }
    windows = []
    for pool, w in raw_windows:
        t0, t1, job = _num(w.get("t0")), _num(w.get("t1")), str(w.get("job", ""))
        got = acquired.get((job, pool, round(t0, 3)), {})
        detail = ", ".join(
            f"{label} {model.duration_text(_num(got.get(key)) / 1000)}"
            for key, label in (("wait_ms", "waited"), ("restore_ms", "restore"))
            if _num(got.get(key)) > 0
        )
        if "step" in got:
            detail = f"step {got['step']}" + (f", {detail}" if detail else "")
        windows.append(model.Window(pool, job, t0 - origin, t1 - origin, detail))
    moves = []
    for e in events:
        kind = _MOVES.get(str(e.get("kind")))
        if kind is None:
            continue
        end = _num(e.get("t")) - origin
        took = _num(e.get("ms")) / 1000
        moves.append(
            model.Move(
                str(e.get("pool", "")),
                str(e.get("job", "")),
                kind,
                end - took,
                end,
                str(e.get("node", "")),
            )
        )
    switches = [
        model.Switch(
            str(s.get("pool", "")),
            str(s.get("from", "")),
            str(s.get("to", "")),
            _num(s.get("t0")) - origin,
            _num(s.get("t1")) - origin,
        )
        for s in _items(run.get("switches"))
        if isinstance(s, Mapping)
    ]
    curves = []
    for gpu, curve in sorted(duty.items(), key=lambda kv: str(kv[0]).zfill(8)):
        points = [(_num(p[0]) - origin, _num(p[1])) for p in _items(curve) if len(_items(p)) >= 2]
        owner = pool_map.get(str(gpu), "")
        curves.append((f"GPU {gpu}" + (f" ({owner})" if owner else ""), points))
    ends = [w.t1 for w in windows] + [m.t1 for m in moves]
    ends += [p[0] for _, pts in curves for p in pts[-1:]]
    duration = _num(run.get("duration_s"), 0.0) or (max(ends, default=1.0) or 1.0)
    return model.Run(
        name=name,
        duration_s=max(duration, max(ends, default=0.0)),
        windows=sorted(windows, key=lambda w: (w.t0, w.pool)),
        moves=sorted(moves, key=lambda m: m.t0),
        switches=sorted(switches, key=lambda s: s.t0),
        duty=curves,
    )


def pools_of(doc: Mapping[str, Any], runs: Sequence[model.Run]) -> list[model.Pool]:
    """The pools, in the order of their GPUs (``pool_map``), then of the windows."""
    pool_map = _pool_map(doc)
    names: list[str] = []
    for _, pool in sorted(pool_map.items(), key=lambda kv: kv[0].zfill(8)):
        if pool not in names:
            names.append(pool)
    for run in runs:
        for w in run.windows:
            if w.pool not in names:
                names.append(w.pool)
    nodes = _mapping(_mapping(doc.get("meta")).get("nodes"))
    out = []
    for pool in names:
        where = ", ".join(str(n) for n in _items(nodes.get(pool)))
        if not where:
            gpus = [g for g, p in pool_map.items() if p == pool]
            where = ", ".join(f"GPU {g}" for g in gpus)
        out.append(model.Pool(pool, where))
    return out


def _jobs(doc: Mapping[str, Any], runs: Sequence[model.Run]) -> list[str]:
    jobs = [str(j) for j in _mapping(doc.get("jobs"))]
    for run in runs:
        for w in run.windows:
            if w.job not in jobs:
                jobs.append(w.job)
    return jobs
