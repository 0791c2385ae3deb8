"""Job, group and node identifiers, validated once at every boundary."""

from __future__ import annotations

import re

MAX_ID_LENGTH = 253
# Kubernetes label values, Slurm job names and UUIDs all fit; whitespace, control
# characters and path tricks do not.
_ID_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._:@/+=-]{0,251}[A-Za-z0-9_])?$")


class InvalidIdError(ValueError):
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
