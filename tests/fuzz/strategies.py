"""Hypothesis strategies for any protobuf message, built from its descriptor.

Every field of a message may be set (one member of each oneof), nested messages
included, with values a careful client would send (ids of a small shared pool, so that
examples meet each other's state on the server) mixed with hostile ones: control
characters, strings of a few MB, unknown enum numbers, the extremes of each integer
type, repeated fields just past the servers' 1,024-entry bound. Huge values are built
by repetition, not drawn character by character, so that hypothesis stays fast.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from google.protobuf import descriptor, message_factory
from google.protobuf import message as pb_message
from hypothesis import strategies as st

from tslice.common import validation

_FD = descriptor.FieldDescriptor

#: Ids that examples share: a valid id from here often names a job or group another
#: example already created.
POOL_IDS = ("job-a", "job-b", "g1", "g2", "node-a")
#: The servers refuse strings longer than this, and ids longer than 253.
_LONG = validation.MAX_TEXT
_LONG_ID = validation.MAX_ID_LENGTH
_HUGE = 3_000_000

_INT_RANGES = {
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _FD.TYPE_ENUM: (-(2**31), 2**31 - 1),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    _FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _FD.TYPE_UINT32: (0, 2**32 - 1),
    _FD.TYPE_FIXED32: (0, 2**32 - 1),
    _FD.TYPE_UINT64: (0, 2**64 - 1),
    _FD.TYPE_FIXED64: (0, 2**64 - 1),
}


def valid_ids() -> st.SearchStrategy[str]:
    """Ids the servers accept (see ``tslice.common.validation``)."""
    return st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9._:@/+=-]{0,30}[A-Za-z0-9_])?", fullmatch=True)


def _huge_text() -> st.SearchStrategy[str]:
    return st.builds(
        lambda n, unit: (unit * (n // len(unit) + 1))[:n],
        st.one_of(
            st.integers(_LONG_ID - 1, _LONG_ID + 2),
            st.integers(_LONG - 1, _LONG + 2),
            st.integers(_LONG + 3, _HUGE),
        ),
        st.sampled_from(["x", "\x00", "é", "a/", "\u202e", "🙂", "%s{}"]),
    )


def texts(*, wild: bool) -> st.SearchStrategy[str]:
    """Strings for any string field: pool ids and valid ids; ``wild``: also any text,
    control characters, strings of a few MB."""
    pool = st.sampled_from(POOL_IDS)
    if not wild:
        return st.one_of(pool, pool, valid_ids())
    # one_of picks a branch uniformly: repeated branches weigh the ids that get past
    # the servers' edge checks, so that examples reach deeper code too.
    return st.one_of(
        pool,
        pool,
        pool,
        valid_ids(),
        valid_ids(),
        st.text(max_size=40),
        st.text(st.characters(codec="utf-8", max_codepoint=0x1F), max_size=20),
        st.sampled_from(["", " ", "a b", "../..", "a\n", "a\r", "a\x00", "-a", "a-", "😀"]),
        _huge_text(),
    )


def integers(field_type: int, *, wild: bool = True) -> st.SearchStrategy[int]:
    """Any value of the type, its extremes and the bounds the servers care about
    (not ``wild``: small values a client would send)."""
    low, high = _INT_RANGES[field_type]
    if not wild:
        return st.integers(0, 3000)
    edges = (low, low + 1, -1, 0, 1, 1024, 1025, 2**31 - 1, 2**53, 2**62, 10**15, high - 1, high)
    return st.one_of(
        st.integers(0, 5000),
        st.sampled_from([v for v in edges if low <= v <= high]),
        st.integers(low, high),
    )


def enums(enum: descriptor.EnumDescriptor, *, wild: bool) -> st.SearchStrategy[int]:
    """Known values; ``wild``: unknown numbers too (protobuf keeps them in open enums)."""
    known = st.sampled_from([v.number for v in enum.values])
    return st.one_of(known, integers(_FD.TYPE_ENUM)) if wild else known


def _scalar(field: descriptor.FieldDescriptor, depth: int, wild: bool) -> st.SearchStrategy[Any]:
    if field.type == _FD.TYPE_MESSAGE:
        return _messages(field.message_type, depth + 1, wild)
    if field.type == _FD.TYPE_ENUM and field.enum_type is not None:
        return enums(field.enum_type, wild=wild)
    if field.type == _FD.TYPE_STRING:
        return texts(wild=wild)
    if field.type == _FD.TYPE_BYTES:
        return st.binary(max_size=64)
    if field.type == _FD.TYPE_BOOL:
        return st.booleans()
    if field.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        return st.floats(allow_nan=True, width=32 if field.type == _FD.TYPE_FLOAT else 64)
    return integers(field.type, wild=wild)


def _repeated(
    field: descriptor.FieldDescriptor, depth: int, wild: bool
) -> st.SearchStrategy[list[Any]]:
    entry = _scalar(field, depth, wild)
    if not wild:
        return st.lists(entry, max_size=3)
    past_bound = validation.MAX_REPEATED + 1
    # Past the bound, the entries are copies of one tame value: enough to be refused,
    # and the message stays within gRPC's 4 MB.
    tame = _scalar(field, depth, False)
    many = st.builds(lambda v, n: [v] * n, tame, st.sampled_from([past_bound, past_bound + 500]))
    short = st.lists(entry, max_size=4)
    return st.one_of(short, short, short, many)


def _map(field: descriptor.FieldDescriptor, depth: int, wild: bool) -> st.SearchStrategy[Any]:
    """A map field (``map<K, V>``, a repeated entry message on the wire): a dict."""
    entry = field.message_type
    keys = _scalar(entry.fields_by_name["key"], depth, wild)
    values = _scalar(entry.fields_by_name["value"], depth, wild)
    return st.dictionaries(keys, values, max_size=4)


def _field_strategies(
    desc: descriptor.Descriptor, depth: int, wild: bool
) -> dict[str, st.SearchStrategy[Any]]:
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in desc.fields:
        if field.type == _FD.TYPE_MESSAGE and depth >= 4:
            continue
        if field.type == _FD.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            fields[field.name] = _map(field, depth, wild)
            continue
        repeated = validation._is_repeated(field)
        fields[field.name] = (_repeated if repeated else _scalar)(field, depth, wild)
    return fields


def _real_oneofs(desc: descriptor.Descriptor) -> list[Sequence[descriptor.FieldDescriptor]]:
    # proto3 `optional` fields are synthetic oneofs of one field: not a choice.
    return [o.fields for o in desc.oneofs if len(o.fields) > 1 or not o.name.startswith("_")]


@functools.cache
def messages(desc: descriptor.Descriptor, *, with_field: str = "") -> st.SearchStrategy[Any]:
    """A message of type ``desc`` with any subset of its fields set (one member of
    each oneof at most; ``with_field`` always): tame (every field set with what a client
    would send, to get past the edge checks into the servers' logic) or wild (any
    subset of the fields, hostile values anywhere)."""
    return st.one_of(_messages(desc, 0, False, with_field), _messages(desc, 0, True, with_field))


@functools.cache
def _messages(
    desc: descriptor.Descriptor, depth: int, wild: bool, with_field: str = ""
) -> st.SearchStrategy[Any]:
    cls = message_factory.GetMessageClass(desc)
    fields = _field_strategies(desc, depth, wild)
    oneof_members = [tuple(f.name for f in members) for members in _real_oneofs(desc)]
    in_oneof = {name for members in oneof_members for name in members}

    @st.composite
    def build(draw: st.DrawFn) -> pb_message.Message:
        values: dict[str, Any] = {}
        for name, strategy in fields.items():
            # Tame: every field set (ids are required); wild: any subset.
            if name not in in_oneof and (not wild or name == with_field or draw(st.booleans())):
                values[name] = draw(strategy)
        for members in oneof_members:
            forced = with_field if with_field in members else None
            chosen = forced or draw(st.sampled_from((None, *members) if wild else members))
            if chosen is not None and chosen in fields:
                values[chosen] = draw(fields[chosen])
        return cls(**values)

    return build()


def random_bytes() -> st.SearchStrategy[bytes]:
    """Bytes sent as a serialized request: garbage, truncated varints, wrong wire types,
    a length prefix longer than the message."""
    return st.one_of(
        st.binary(max_size=200),
        st.sampled_from([b"\xff", b"\x0a\x05ab", b"\x08", b"\x0b", b"\x0a\xff\xff\xff\xff\x0f"]),
    )
