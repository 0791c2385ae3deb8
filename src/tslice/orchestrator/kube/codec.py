"""A group's persisted record as JSON, generically (no client library; HA mode's state).

The record (``tslice.orchestrator.persistence.records.LockRecord``) is turned into JSON from its
dataclass fields and back from their type hints, so a field added to it later (with a
default) is stored and read without a change here: a field the JSON lacks takes its
default (state written by an older release), a key the record no longer has is ignored
(state written by a newer one). Nested dataclasses, tuples (``tuple[X, ...]`` and fixed),
optionals and plain values are handled; nothing else is needed by the records.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any, TypeVar

from tslice.orchestrator.persistence import records

_D = TypeVar("_D")


def encode(record: records.LockRecord) -> str:
    """``record`` as compact JSON (keys sorted: the same record is the same text)."""
    return json.dumps(dataclasses.asdict(record), sort_keys=True, separators=(",", ":"))


def decode(text: str) -> records.LockRecord:
    """The record of :func:`encode`'s JSON; ``ValueError`` if it is not one."""
    try:
        return _dataclass(records.LockRecord, json.loads(text))
    except (TypeError, KeyError, AttributeError, json.JSONDecodeError) as err:
        raise ValueError(f"not a lock record ({type(err).__name__}: {err})") from err


_HINTS: dict[type[Any], dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _dataclass(cls: type[_D], data: Any) -> _D:
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__} must be a JSON object, not {type(data).__name__}")
    hints = _hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    values = {name: _value(hints[name], data[name]) for name in known if name in data}
    return cls(**values)


def _value(hint: Any, data: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if data is None and type(None) in options:
            return None
        (inner,) = [o for o in options if o is not type(None)]
        return _value(inner, data)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], item) for item in data)
        return tuple(_value(a, item) for a, item in zip(args, data, strict=True))
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return _dataclass(hint, data)
    if hint is float and isinstance(data, int):
        return float(data)
    return data
