"""Bounds on what a caller may send a server, checked before anything is done with it.

Both servers run these checks at their edges, so that hostile or broken input is
refused with INVALID_ARGUMENT and a short message before it costs anything; the job
side runs the same id check on its own settings, so a bad name fails at start:

- every job, group and node id is well formed (:func:`check_id`): Kubernetes label
  values, Slurm job names and UUIDs all fit; whitespace, control characters and path
  tricks do not;

- every enum field (nested messages included) holds a value of its enum: protobuf
  keeps unknown numbers of open enums as plain ints, which would otherwise travel on
  into the backends (an unknown suspend mode left an operation PENDING);
- every repeated field has at most :data:`MAX_REPEATED` entries (or its own bound) and
  every string at most :data:`MAX_TEXT` characters, so work proportional to a request
  stays small;
- a caller's value is never echoed in full: :func:`shown` quotes at most
  :data:`MAX_SHOWN` characters of it.

No I/O, no grpc: the servicers turn :class:`InvalidInput` into their refusal.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from google.protobuf import descriptor
from google.protobuf import message as pb_message

#: Characters of a job, group or node id.
MAX_ID_LENGTH = 253
_ID_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._:@/+=-]{0,251}[A-Za-z0-9_])?$")
#: Characters of a caller's value quoted in an error message.
MAX_SHOWN = 64
#: Entries of a repeated field (tags, endpoints, devices, evict, give_way, pids...).
MAX_REPEATED = 1024
#: Characters of a string field that is not an id (URLs, tags, names).
MAX_TEXT = 2048
#: Characters of an error message a server sends (gRPC refuses metadata over 16 KiB).
MAX_MESSAGE = 2048
#: Entries of a list quoted in an error message.
MAX_SHOWN_ITEMS = 8
#: Shortest holder lease (``lease_ms``) a server takes, other than 0 (no lease): the
#: Python client opens its Hold stream a quarter of the lease after the grant, and a
#: shorter lease lapses before any client can be expected to have opened one (1 ms did).
MIN_LEASE_MS = 100

_FD = descriptor.FieldDescriptor


class InvalidInput(ValueError):
    """A request field is out of bounds; the message names the field and the bound."""


class InvalidIdError(InvalidInput):
    """An id is empty or malformed; the message says which and why."""


def check_id(kind: str, value: str) -> str:
    """Return ``value`` if it is a well-formed id, else raise :class:`InvalidIdError`."""
    if not value:
        raise InvalidIdError(f"{kind} is required (got an empty string)")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(
            f"{kind} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}"
        )
    if not _ID_RE.fullmatch(value):
        raise InvalidIdError(
            f"{kind} {value!r} is malformed: use letters, digits and . _ : @ / + = -, "
            "starting with a letter or digit and ending with a letter, digit or _"
        )
    return value


def shown(value: str, limit: int = MAX_SHOWN) -> str:
    """``repr(value)``, cut after ``limit`` characters with an ellipsis and the length."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}… ({len(value)} characters)"


def shown_list(items: Sequence[object], limit: int = MAX_SHOWN_ITEMS) -> str:
    """A list as ``['a', 'b', …]``: at most ``limit`` entries, each cut by :func:`shown`."""
    quoted = [shown(i) if isinstance(i, str) else repr(i) for i in items[:limit]]
    more = f", … ({len(items)} entries)" if len(items) > limit else ""
    return f"[{', '.join(quoted)}{more}]"


def bounded(text: str, limit: int = MAX_MESSAGE) -> str:
    """``text`` in at most ``limit`` characters: cut, with an ellipsis and how much was
    cut (a server's last safety net: whatever a message quotes, it stays short)."""
    if len(text) <= limit:
        return text
    # The note counts against the limit too; its length grows with the count it names.
    keep = limit
    while True:
        note = f"… ({len(text) - keep} more characters cut)"
        if keep + len(note) <= limit:
            return text[:keep] + note
        if len(note) > limit:
            return text[:limit]
        keep = limit - len(note)


def enum_values(enum: descriptor.EnumDescriptor) -> str:
    """``NAME (n), ...`` of every value of ``enum``, for messages that name them."""
    return ", ".join(f"{v.name} ({v.number})" for v in enum.values)


def check_lease(field: str, lease_ms: int) -> int:
    """``lease_ms``: 0 (no lease) or at least :data:`MIN_LEASE_MS`."""
    if lease_ms < 0:
        raise InvalidInput(f"{field} must be >= 0 (got {lease_ms}); 0 = no lease")
    if lease_ms < MIN_LEASE_MS and lease_ms != 0:
        raise InvalidInput(
            f"{field} must be 0 (no lease) or at least {MIN_LEASE_MS} ms (got {lease_ms}): a "
            "shorter lease lapses before the holder can open its Hold stream; use 5000 or "
            "more where the orchestrator may restart"
        )
    return lease_ms


def check_enum(field: str, enum: descriptor.EnumDescriptor, value: int) -> int:
    """``value`` if it is a value of ``enum``, else :class:`InvalidInput` naming the valid ones."""
    if value not in enum.values_by_number:
        raise InvalidInput(
            f"{field} is {value}, which is not a {enum.name}; use one of {enum_values(enum)}"
        )
    return value


def check_count(field: str, count: int, limit: int = MAX_REPEATED) -> None:
    if count > limit:
        raise InvalidInput(f"{field} has {count} entries; at most {limit} are accepted")


def check_text(field: str, value: str, limit: int = MAX_TEXT) -> None:
    if len(value) > limit:
        raise InvalidInput(f"{field} is {len(value)} characters long; at most {limit}")


def check_message(
    message: pb_message.Message,
    *,
    prefix: str = "",
    counts: Mapping[str, int] | None = None,
) -> None:
    """Check every set field of ``message``, nested messages included (see the module doc).

    ``counts`` gives some repeated fields (by dotted path, e.g.
    ``"backend_config.app_endpoint.endpoints"``) their own bound. Counts are checked
    before the entries, so a huge list is refused without looking at its entries.
    """
    _walk(message, prefix, counts or {})


#: Whether a field is repeated, by its descriptor (fields do not change: asked once each).
_REPEATED: dict[descriptor.FieldDescriptor, bool] = {}


def _walk(message: pb_message.Message, prefix: str, counts: Mapping[str, int]) -> None:
    for field, value in message.ListFields():
        path = f"{prefix}{field.name}"
        repeated = _REPEATED.get(field)
        if repeated is None:
            repeated = _REPEATED[field] = _is_repeated(field)
        if repeated:
            check_count(path, len(value), counts.get(path, MAX_REPEATED))
        items = list(value) if repeated else [value]
        if field.type == _FD.TYPE_ENUM and field.enum_type is not None:
            for item in items:
                check_enum(path, field.enum_type, item)
        elif field.type == _FD.TYPE_STRING:
            for item in items:
                check_text(path, item)
        elif field.type == _FD.TYPE_MESSAGE:
            for index, item in enumerate(items):
                where = f"{path}[{index}]." if repeated else f"{path}."
                _walk(item, where, counts)


def _is_repeated(field: descriptor.FieldDescriptor) -> bool:
    # protobuf >= 6.31 has is_repeated (and 7 dropped label); older ones only label.
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(field, "label", None) == _FD.LABEL_REPEATED)
