"""Wire messages to the client's frozen values: one rule for every message family.

The client's result types name their fields after the wire's, so a value is built by
reading the same-named fields of the message: repeated ones become tuples, an unset
field with presence (``optional``) becomes ``None``. Only what needs converting
(enums, timestamps, nested messages) is given by the caller.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from typing import Any, TypeVar

from google.protobuf import message as pb_message
from google.protobuf import timestamp_pb2
from google.protobuf.internal import enum_type_wrapper

T = TypeVar("T")
E = TypeVar("E", bound=enum.Enum)

#: A generated enum (``Name(number)`` raises ValueError for a number it does not know).
_WireEnum = enum_type_wrapper.EnumTypeWrapper


def value(kind: type[T], message: pb_message.Message, /, **given: Any) -> T:
    """A ``kind`` (a dataclass) from the same-named fields of ``message``; ``given``
    supplies the fields that need converting."""
    fields = message.DESCRIPTOR.fields_by_name
    values: dict[str, Any] = {}
    for field in dataclasses.fields(kind):  # type: ignore[arg-type]
        name = field.name
        if name in given:
            values[name] = given[name]
        elif _is_repeated(fields[name]):
            values[name] = tuple(getattr(message, name))
        elif fields[name].has_presence and not message.HasField(name):
            values[name] = None
        else:
            values[name] = getattr(message, name)
    return kind(**values)


def _is_repeated(field: Any) -> bool:
    # protobuf 7 has only ``is_repeated``; before 6.31 there is only ``label``.
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == field.LABEL_REPEATED)


def enum_member(kind: type[E], wire: _WireEnum, number: int, *, prefix: str) -> E:
    """Wire enum number -> ``kind`` member (wire name less ``prefix``); a number or name
    this client does not know is ``kind.UNSPECIFIED``."""
    try:
        return kind(wire.Name(number).removeprefix(prefix))
    except ValueError:
        return kind["UNSPECIFIED"]


def enum_name(wire: _WireEnum, number: int) -> str:
    """Wire enum number -> its full wire name (llm-d's result types carry names); an
    unknown number as its digits."""
    try:
        return wire.Name(number)
    except ValueError:
        return str(number)


def time(message: pb_message.Message, name: str) -> datetime.datetime | None:
    """The timestamp field ``name`` of ``message`` in UTC, ``None`` when unset."""
    if not message.HasField(name):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, name)
    return stamp.ToDatetime(tzinfo=datetime.timezone.utc)
