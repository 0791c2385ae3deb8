"""The credential of a Slurm job: a bearer token the prolog writes for the job's user.

``tslice-slurm1:<job>:<array job>:<user>:<HMAC-SHA256 in hex>``, the HMAC keyed with the
cluster's job key (a file on the orchestrator's host and on every GPU node, readable by
root only, as munge's key is). Only a holder of the key mints one, so a token names the
Slurm job and user it was written for; the orchestrator checks it (``identity``). Pure:
no I/O beyond reading the key file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from pathlib import Path

PREFIX = "tslice-slurm1"
#: Least bytes of a job key.
MIN_KEY_BYTES = 32
DEFAULT_KEY_FILE = Path("/etc/tslice/slurm/job.key")


class BadToken(ValueError):
    """A token with our prefix that does not check out (forged, or another key's)."""


@dataclasses.dataclass(frozen=True)
class Claims:
    """Who a token was written for."""

    job: str
    #: The array's job id ("" when the job is no array task).
    array_job: str
    user: str


def load_key(path: Path) -> bytes:
    """The job key (the file's bytes, surrounding whitespace stripped); ValueError with
    the fix if it is unreadable or short."""
    try:
        key = path.read_bytes().strip()
    except OSError as err:
        raise ValueError(
            f"cannot read the Slurm job key {path} ({err.strerror or err}); create it once "
            f"(openssl rand -hex 32 > {path}; chmod 600 {path}) and copy it to the "
            "orchestrator's host and every GPU node"
        ) from err
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the Slurm job key {path} has {len(key)} bytes; it needs at least {MIN_KEY_BYTES} "
            f"(openssl rand -hex 32 > {path})"
        )
    return key


def _mac(key: bytes, body: str) -> str:
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def mint(key: bytes, claims: Claims) -> str:
    """The token of ``claims``; ValueError for fields that cannot go in one."""
    for field, value in (("job", claims.job), ("array job", claims.array_job)):
        if not (value.isdigit() or (field == "array job" and value == "")):
            raise ValueError(f"the Slurm {field} id {value!r} is not a number")
    if not claims.user or ":" in claims.user or not claims.user.isprintable():
        raise ValueError(f"{claims.user!r} is not a user name")
    body = f"{PREFIX}:{claims.job}:{claims.array_job}:{claims.user}"
    return f"{body}:{_mac(key, body)}"


def read(key: bytes, token: str) -> Claims | None:
    """The claims of a token of ours (None: not one of ours); BadToken if it does not
    check out."""
    if not token.startswith(PREFIX + ":"):
        return None
    body, _, mac = token.rpartition(":")
    parts = body.split(":")
    if len(parts) != 4 or not hmac.compare_digest(_mac(key, body), mac):
        raise BadToken("the Slurm job token does not check out (another cluster's key?)")
    _, job, array_job, user = parts
    return Claims(job=job, array_job=array_job, user=user)
