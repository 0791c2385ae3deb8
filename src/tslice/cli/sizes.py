"""Byte sizes and rates on the command line: ``80GiB``, ``25GB/s``, or plain numbers."""

from __future__ import annotations

import pydantic

from tslice.common import errors

_BYTES: pydantic.TypeAdapter[pydantic.ByteSize] = pydantic.TypeAdapter(pydantic.ByteSize)


def parse_bytes(text: str, *, option: str, what: str = "") -> int:
    """``80GiB`` / ``60GB`` / ``1048576`` -> bytes; :class:`ConfigError` naming ``option``."""
    try:
        value = int(_BYTES.validate_python(text.strip()))
    except pydantic.ValidationError as err:
        raise errors.ConfigError(
            f"{option} {text!r} is not "
            + (what or "a size: use e.g. 80GiB, 60GB or a number of bytes")
        ) from err
    if value <= 0:
        raise errors.ConfigError(f"{option} must be positive (got {text!r})")
    return value


def parse_rate(text: str, *, option: str) -> int:
    """``25GB/s`` / ``25GB`` / ``25000000000`` -> bytes per second."""
    stripped = text.strip()
    for suffix in ("/s", "ps"):
        if stripped.lower().endswith(suffix):
            stripped = stripped[: -len(suffix)]
            break
    return parse_bytes(
        stripped, option=option, what="a rate: use e.g. 25GB/s, 500MB/s or bytes per second"
    )


def parse_bytes_or_none(text: str | None, *, option: str) -> int | None:
    """:func:`parse_bytes`, with ``None`` (the flag not given) passed through."""
    return None if text is None else parse_bytes(text, option=option)


def parse_rate_or_none(text: str | None, *, option: str) -> int | None:
    """:func:`parse_rate`, with ``None`` (the flag not given) passed through."""
    return None if text is None else parse_rate(text, option=option)
