"""What the planner takes from a recording, checked before it is used.

A recording is untrusted input (an event log is whatever ``tslice events --json`` or
anyone else wrote), and what it names ends up in the topology file ``tslice plan
--apply`` writes (its comments name the jobs, its groups are the recording's pools).
So, before anything is derived from it:

- JSON is strict: ``NaN``, ``Infinity`` and numbers too large for a float (``1e999``)
  are refused, and so is nesting deeper than :data:`MAX_DEPTH` (a recording is at
  most a few levels deep; Python's parser alone fails with a RecursionError);
- every job and group name is an id as the servers take it (``tslice.common.validation``: no
  whitespace, so a name cannot start a line of its own in the file);
- every event's fields have their types: ``time`` a finite number or an ISO 8601 string,
  ``duration_ms`` a finite number >= 0, ``kind`` a string.

Each refusal is a :class:`recording.PlanInputError` naming where and what.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from tslice.common import errors, validation

#: Nesting of a recording's JSON (a trace is four levels deep).
MAX_DEPTH = 32


class PlanInputError(errors.ConfigError):
    """The planner's input cannot be used; the message names what is wrong and the fix."""


def parse(text: str, where: str) -> Any:
    """``text`` as strict JSON (see the module doc); ``ValueError`` if it is not JSON at all."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise PlanInputError(
            f"{where} is nested too deeply to be a recording (at most {MAX_DEPTH} levels)"
        ) from None
    _check_values(value, where)
    return value


def _check_values(value: Any, where: str) -> None:
    """Depth within MAX_DEPTH and every number finite, walked without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise PlanInputError(
                f"{where} holds {item}, not a finite number: give finite numbers (JSON has "
                "no NaN or Infinity, and 1e999 is too large for a float)"
            )
        if isinstance(item, Mapping | list):
            if depth > MAX_DEPTH:
                raise PlanInputError(
                    f"{where} is nested more than {MAX_DEPTH} levels deep: not a recording"
                )
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)


def name(where: str, kind: str, value: Any) -> str:
    """A job or group name: an id (see the module doc)."""
    if not isinstance(value, str):
        raise PlanInputError(f"{where}: {kind} must be a string (got {type(value).__name__})")
    try:
        return validation.check_id(kind, value)
    except validation.InvalidIdError as err:
        raise PlanInputError(f"{where}: {err}") from None


def number(where: str, field: str, value: Any, *, minimum: float | None = None) -> float:
    """A finite number (not a string, not a boolean), at least ``minimum`` where given."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanInputError(
            f"{where}: {field} must be a number (got {type(value).__name__} "
            f"{validation.shown(str(value))})"
        )
    if not math.isfinite(value) or (minimum is not None and value < minimum):
        bound = f" >= {minimum:g}" if minimum is not None else ""
        raise PlanInputError(f"{where}: {field} must be a finite number{bound} (got {value})")
    return float(value)


def event(where: str, record: Mapping[str, Any]) -> None:
    """One orchestrator event of an event log (the fields the planner reads)."""
    if not isinstance(record.get("kind"), str):
        raise PlanInputError(f'{where}: kind must be a string such as "GRANTED"')
    name(where, "group_id", record.get("group_id"))
    for field in ("job_id", "from_job"):
        if record.get(field) not in (None, ""):
            name(where, field, record[field])
    if record.get("duration_ms") is not None:
        number(where, "duration_ms", record["duration_ms"], minimum=0)
    when = record.get("time")
    if not isinstance(when, str):
        number(where, "time", when)


def trace_names(where: str, timeslice: Mapping[str, Any]) -> None:
    """The pools and jobs a trace's windows name (what a topology file would carry)."""
    windows = timeslice.get("windows")
    if not isinstance(windows, Mapping):
        return  # the derivation says what is missing
    for pool, items in windows.items():
        name(where, "pool", pool)
        for window in items if isinstance(items, list) else ():
            if isinstance(window, Mapping) and "job" in window:
                name(f"{where} (windows of {pool})", "job", window["job"])
