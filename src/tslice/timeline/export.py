"""Orchestrator events in the recorded-run format (``shared/traces/*.json``).

A real run's history (``tslice events --since 2h --export run.json``) becomes a document
that ``tslice plan``, ``bench/trace_replay.py`` and ``tslice timeline`` read as they read
a recorded trace:

* a lock window of a group per grant: GRANTED (a re-grant to the holder, "already held",
  is the same window) to the holder's YIELDED or CANCELLED (or the end of the export);
* ``acquired`` (with ``wait_ms``: the GRANTED's wait, ``restore_ms`` and the job's RL
  ``step``: one step per grant of the first group the job ever held) and ``yielded``
  events; ``ckpt_done`` / ``restore_done`` per node (SNAPSHOT_DONE, RESTORE_DONE) with
  ``ms``, and the ``checkpointing`` / ``restoring`` that began them;
* ``switches``: every completed switch (SWITCH_STARTED to SWITCH_DONE) and ``failures``
  (SWITCH_FAILED), additions of tslice's that other readers ignore;
* ``duty_gpus``: per group, the share of each time bucket some job held it (the
  orchestrator knows who holds the devices, not how busy they keep them);
* a ``summary`` (switches, medians, duty, time each job held).

Times are seconds from the first event (or ``start``), multiplied by ``time_scale``: 1 for
a real run; for a time-compressed run (the demo runs a recorded trace 750x faster) the
scale brings it back to the trace's clock, and the planner's phases stay longer than its
rounding.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tslice.client as tsclient

GRANTED = tsclient.EventKind.GRANTED.value
YIELDED = tsclient.EventKind.YIELDED.value
CANCELLED = tsclient.EventKind.CANCELLED.value
SWITCH_STARTED = tsclient.EventKind.SWITCH_STARTED.value
SNAPSHOT_DONE = tsclient.EventKind.SNAPSHOT_DONE.value
RESTORE_DONE = tsclient.EventKind.RESTORE_DONE.value
SWITCH_DONE = tsclient.EventKind.SWITCH_DONE.value
SWITCH_FAILED = tsclient.EventKind.SWITCH_FAILED.value

#: Points of each duty curve.
DUTY_POINTS = 150


def record(event: tsclient.OrchestratorEvent) -> dict[str, Any]:
    """One event as a line of an event log (what ``tslice events --json`` prints)."""
    out = dataclasses.asdict(event)
    out["kind"] = event.kind.value
    out["time"] = event.time.isoformat() if event.time is not None else None
    return out


def write_events(path: Path, events: Iterable[tsclient.OrchestratorEvent]) -> Path:
    """An event log file: one JSON object per line (what ``tslice plan`` reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for event in events:
            out.write(json.dumps(record(event)) + "\n")
    return path


def seconds(value: Any) -> float | None:
    """An event record's time (ISO 8601 or seconds since the epoch); None if unreadable."""
    try:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        return datetime.datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        return None


@dataclasses.dataclass
class _Group:
    holder: str | None = None
    since: float = 0.0
    switch_from: str = ""
    switch_to: str = ""
    switch_at: float | None = None
    last_switch_ms: float = 0.0


def document(
    records: Iterable[Mapping[str, Any]],
    *,
    time_scale: float = 1.0,
    label: str = "",
    start: float | None = None,
    end: float | None = None,
    groups: Sequence[str] = (),
) -> dict[str, Any]:
    """The recorded-run document of ``records`` (event-log records, any order; those
    without a readable time are skipped). ``start``/``end``: the export's bounds, seconds
    since the epoch (default: the first and last event); ``groups``: the pools' order
    (default: by first grant), so that several exports number their GPUs alike."""
    timed = sorted(
        ((t, i, r) for i, r in enumerate(records) if (t := seconds(r.get("time"))) is not None),
        key=lambda x: x[:2],
    )
    origin = start if start is not None else (timed[0][0] if timed else 0.0)
    last = end if end is not None else (timed[-1][0] if timed else origin)
    scale = time_scale

    def at(when: float) -> float:
        return round((when - origin) * scale, 3)

    groups_order = list(groups)
    state: dict[str, _Group] = collections.defaultdict(_Group)
    windows: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    events: list[dict[str, Any]] = []
    switches: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    nodes: dict[str, list[str]] = collections.defaultdict(list)
    first_group: dict[str, str] = {}
    steps: collections.Counter[str] = collections.Counter()

    def close(gid: str, g: _Group, when: float) -> None:
        if g.holder is not None:
            windows[gid].append({"t0": at(g.since), "t1": at(when), "job": g.holder})
            events.append({"t": at(when), "kind": "yielded", "job": g.holder, "pool": gid})
        g.holder = None

    for when, _, r in timed:
        kind, gid = str(r.get("kind", "")), str(r.get("group_id", ""))
        job, node = str(r.get("job_id", "")), str(r.get("node", ""))
        ms = float(r.get("duration_ms") or 0) * scale
        if not gid:
            continue
        g = state[gid]
        if node and node not in nodes[gid]:
            nodes[gid].append(node)
        if kind == GRANTED and job:
            if g.holder == job and r.get("detail") == "already held":
                continue
            close(gid, g, when)
            g.holder, g.since = job, when
            if first_group.setdefault(job, gid) == gid:
                steps[job] += 1
            restored = g.last_switch_ms if g.switch_to == job else 0.0
            events.append(
                {
                    "t": at(when),
                    "kind": "acquired",
                    "job": job,
                    "pool": gid,
                    "wait_ms": round(ms, 3),
                    "restore_ms": round(restored, 3),
                    "step": max(steps[job] - 1, 0),
                }
            )
            g.switch_to, g.last_switch_ms = "", 0.0
        elif kind in (YIELDED, CANCELLED) and job and g.holder == job:
            close(gid, g, when)
        elif kind == SWITCH_STARTED:
            g.switch_from, g.switch_to, g.switch_at = str(r.get("from_job", "")), job, when
        elif kind in (SNAPSHOT_DONE, RESTORE_DONE):
            began, done = (
                ("checkpointing", "ckpt_done")
                if kind == SNAPSHOT_DONE
                else (
                    "restoring",
                    "restore_done",
                )
            )
            move = {"job": job, "pool": gid, "node": node}
            events.append({"t": round(at(when) - ms / 1000, 3), "kind": began, **move})
            events.append({"t": at(when), "kind": done, **move, "ms": round(ms, 3)})
        elif kind == SWITCH_DONE:
            t1 = at(when)
            t0 = at(g.switch_at) if g.switch_at is not None else round(t1 - ms / 1000, 3)
            switches.append(
                {
                    "pool": gid,
                    "from": str(r.get("from_job", "")) or g.switch_from,
                    "to": job,
                    "t0": t0,
                    "t1": t1,
                    "ms": round(ms, 3),
                }
            )
            g.switch_at, g.last_switch_ms = None, ms
        elif kind == SWITCH_FAILED and not node:
            failures.append(
                {"pool": gid, "t": at(when), "to": job, "detail": str(r.get("detail", ""))}
            )
            g.switch_at = None
    for gid, g in state.items():
        close(gid, g, max(last, g.since))
    duration = at(last)
    events.sort(key=lambda e: e["t"])
    order = [gid for gid in groups_order if gid in state]
    order += sorted(
        (gid for gid in windows if gid not in order),
        key=lambda gid: min(w["t0"] for w in windows[gid]),
    )
    order += sorted(gid for gid in state if gid not in order)
    duty = {str(i): _duty(windows.get(gid, []), duration) for i, gid in enumerate(order)}
    jobs = sorted({w["job"] for ws in windows.values() for w in ws})
    return {
        "label": label or "tslice run",
        "meta": {
            "source": "tslice event history",
            "started": datetime.datetime.fromtimestamp(origin, datetime.timezone.utc).isoformat(
                timespec="seconds"
            ),
            "time_scale": scale,
            "clock": _clock(scale),
            "nodes": {gid: nodes[gid] for gid in order if nodes.get(gid)},
        },
        "pool_map": {str(i): gid for i, gid in enumerate(order)},
        "jobs": {j: {"short": j, "full": j} for j in jobs},
        "timeslice": {
            "duration_s": duration,
            "duty_gpus": duty,
            "windows": {gid: windows[gid] for gid in order if gid in windows},
            "events": events,
            "switches": switches,
            "failures": failures,
        },
        "summary": _summary(windows, events, switches, duty, duration),
    }


def _clock(scale: float) -> str:
    if scale == 1:
        return "seconds of the run"
    return f"seconds of the run x {scale:g} (time scale)"


def _duty(windows: Sequence[Mapping[str, Any]], duration: float) -> list[list[float]]:
    """Share of each of :data:`DUTY_POINTS` buckets that some job held the group, percent."""
    if duration <= 0:
        return []
    width = duration / DUTY_POINTS
    out = []
    for i in range(DUTY_POINTS):
        lo, hi = i * width, (i + 1) * width
        held = sum(max(0.0, min(hi, w["t1"]) - max(lo, w["t0"])) for w in windows)
        out.append([round(lo, 3), round(min(held / width, 1.0) * 100, 1)])
    return out


def _summary(
    windows: Mapping[str, Sequence[Mapping[str, Any]]],
    events: Sequence[Mapping[str, Any]],
    switches: Sequence[Mapping[str, Any]],
    duty: Mapping[str, Sequence[Sequence[float]]],
    duration: float,
) -> dict[str, Any]:
    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 1) if values else None

    held: dict[str, float] = collections.defaultdict(float)
    for ws in windows.values():
        for w in ws:
            held[w["job"]] += w["t1"] - w["t0"]
    per_gpu = {
        gpu: round(statistics.fmean(p[1] for p in curve), 1) for gpu, curve in duty.items() if curve
    }
    out: dict[str, Any] = {
        "duty_ts": round(statistics.fmean(per_gpu.values()), 1) if per_gpu else 0.0,
        "duty_gpu": {gpu: [None, value] for gpu, value in per_gpu.items()},
        "ts_min": round(duration / 60, 2),
        "swaps": len(switches),
        "lock_cycles": sum(len(ws) for ws in windows.values()),
        "med_ckpt_ms": median([e["ms"] for e in events if e["kind"] == "ckpt_done"]),
        "med_restore_ms": median([e["ms"] for e in events if e["kind"] == "restore_done"]),
        "med_switch_ms": median([s["ms"] for s in switches]),
        "held_s": {job: round(s, 3) for job, s in sorted(held.items())},
    }
    return {k: v for k, v in out.items() if v is not None}
