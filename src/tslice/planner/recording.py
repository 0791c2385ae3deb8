"""What the planner reads: a recorded trace or an orchestrator event log, as one format.

Two inputs are accepted, told apart by their content:

* a **recorded trace** (``shared/traces/*.json``, the format :mod:`tslice.phases.trace`
  reads): one JSON object with ``timeslice``;
* an **event log**: the orchestrator's ``WatchEvents`` stream as JSON lines, one event a
  line, as ``tslice events --json`` prints it and ``tslice demo --events FILE`` saves it
  (``time`` ISO 8601, ``kind``, ``group_id``, ``job_id``, ``node``, ``duration_ms``,
  ``from_job``, ``detail``, ...).

An event log is turned into the trace format (by the export of ``tslice events
--export``, :mod:`tslice.timeline.export`) so that one derivation
(:mod:`tslice.phases.derive`) serves both: a window of a group is a job's GRANTED to its
YIELDED (or CANCELLED, or the end of the log); its request time is the grant minus the
wait GRANTED reports; a job's RL step starts at each grant of the first group the job
was ever granted (its steps repeat, so that group opens every step); SNAPSHOT_DONE and
RESTORE_DONE give the switch costs. The derivation drops stretches under half a trace
second as rounding noise, which would be every phase of a time-compressed demo: an event
log's clock is therefore read in milliseconds (one model second =
:data:`EVENT_LOG_UNIT_S` of the log), and :attr:`Recording.unit_s` converts back.

What a recording names and holds is checked first (:mod:`.input_checks`): strict JSON,
ids for every job and group, typed event fields.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tslice.client as tsclient
from tslice.planner import input_checks
from tslice.timeline import export

TRACE = "trace"
EVENT_LOG = "event log"
#: Seconds of an event log per model second (see the module docstring).
EVENT_LOG_UNIT_S = 0.001

_FIX = (
    "give a recorded trace (a JSON object with 'timeslice', e.g. shared/traces/*.json) or "
    "an event log (JSON lines from `tslice events --json > FILE` or `tslice demo --events "
    "FILE`)"
)


PlanInputError = input_checks.PlanInputError


@dataclasses.dataclass(frozen=True)
class Recording:
    """A source in the trace format, and how to read its clock."""

    path: Path
    kind: str
    #: The trace format (:mod:`tslice.phases.trace`), times in model seconds.
    raw: Mapping[str, Any]
    #: Seconds of the source per model second (1 for a trace).
    unit_s: float
    #: Group -> SWITCH_DONE durations, seconds of the source (event logs only).
    switch_done_s: Mapping[str, Sequence[float]]


def load(path: Path) -> Recording:
    """Read a trace or an event log; :class:`PlanInputError` naming the problem and the fix."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanInputError(f"{path} does not exist: {_FIX}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise PlanInputError(f"{path} cannot be read ({err}): {_FIX}") from None
    if not text.strip():
        raise PlanInputError(
            f"{path} is empty: record an event log while jobs run (`tslice events --json > "
            f"{path.name}`, or `tslice demo --events {path.name}`)"
        )
    try:
        whole: Any = input_checks.parse(text, str(path))
    except ValueError:
        whole = None
    if isinstance(whole, Mapping) and "timeslice" in whole:
        if isinstance(whole["timeslice"], Mapping):
            input_checks.trace_names(str(path), whole["timeslice"])
        return Recording(path, TRACE, whole, 1.0, {})
    if isinstance(whole, Mapping) and "kind" in whole:
        input_checks.event(str(path), whole)
        return _from_events(path, [whole])
    if isinstance(whole, list) and whole and all(_is_event(e) for e in whole):
        for number, record in enumerate(whole, 1):
            input_checks.event(f"{path} event {number}", record)
        return _from_events(path, whole)
    if whole is not None:
        raise PlanInputError(f"{path} is JSON but neither a trace nor an event log: {_FIX}")
    records: list[Mapping[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            record = input_checks.parse(line, where)
        except ValueError:
            raise PlanInputError(
                f"{path} line {number} is not JSON ({line[:40]!r}): unknown format; {_FIX}"
            ) from None
        if not _is_event(record):
            raise PlanInputError(
                f"{path} line {number} is not an orchestrator event (it needs 'kind', "
                f"'group_id' and 'time'): {_FIX}"
            )
        input_checks.event(where, record)
        records.append(record)
    return _from_events(path, records)


def _is_event(record: Any) -> bool:
    return isinstance(record, Mapping) and {"kind", "group_id", "time"} <= set(record)


def _time(path: Path, record: Mapping[str, Any]) -> float:
    when = export.seconds(record.get("time"))
    if when is None:
        raise PlanInputError(
            f"{path}: event {dict(record)} has no readable 'time' (ISO 8601, as `tslice "
            "events --json` writes it)"
        )
    return when


def _from_events(path: Path, records: Sequence[Mapping[str, Any]]) -> Recording:
    """The event log in the trace format (see the module docstring): the export of
    ``tslice events --export`` (:mod:`tslice.timeline.export`), on a clock in ms."""
    for record in records:
        _time(path, record)  # an unreadable time is refused, naming the event
    if not any(r.get("kind") == tsclient.EventKind.GRANTED.value for r in records):
        raise PlanInputError(
            f"{path} has {len(records)} event(s) but no GRANTED one: no job held a group "
            "while it was recorded; record the log while jobs run"
        )
    scale = 1.0 / EVENT_LOG_UNIT_S
    doc = export.document(records, time_scale=scale)
    run = doc["timeslice"]
    windows: Mapping[str, list[dict[str, Any]]] = run["windows"]
    events: list[dict[str, Any]] = run["events"]
    _check_switch_costs(path, windows, events)
    switch_done: dict[str, list[float]] = collections.defaultdict(list)
    for s in run["switches"]:
        if s["from"]:
            switch_done[s["pool"]].append(s["ms"] / scale / 1000.0)
    raw = {"meta": {"source": "event log"}, "timeslice": {"windows": windows, "events": events}}
    return Recording(path, EVENT_LOG, raw, EVENT_LOG_UNIT_S, dict(switch_done))


def _check_switch_costs(
    path: Path, windows: Mapping[str, list[dict[str, Any]]], events: Sequence[Mapping[str, Any]]
) -> None:
    """A group several jobs took turns on needs its snapshot and restore times."""
    timed = {(e["kind"], e["pool"]) for e in events}
    for group, items in windows.items():
        if len({w["job"] for w in items}) < 2:
            continue
        for kind, name in (("ckpt_done", "SNAPSHOT_DONE"), ("restore_done", "RESTORE_DONE")):
            if (kind, group) not in timed:
                raise PlanInputError(
                    f"{path}: group {group} was shared by several jobs but the log has no "
                    f"{name} event of it, so its switch cost is unknown: record the log "
                    "from before the jobs start (`tslice events --json` sees only what "
                    "happens while it runs)"
                )
