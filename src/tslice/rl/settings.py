"""Where :meth:`Phases.from_env` finds its settings (first variable set wins).

The orchestrator address and the job id are the client's own settings
(``$TSLICE_ORCHESTRATOR`` else llm-d's ``$TIMESLICE_ORCH_ADDR``; ``$TSLICE_JOB_ID``
else ``$TIMESLICE_JOB_ID``); the rest is read here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Final

from tslice.common import errors, validation

#: The trainer pool's group.
TRAINER_GROUP_ENV: Final = ("TSLICE_TRAINER_GROUP", "TIMESLICE_TRAINER_GROUP")
#: The sampler pool's group.
SAMPLER_GROUP_ENV: Final = ("TSLICE_SAMPLER_GROUP", "TIMESLICE_SAMPLER_GROUP")
#: A colocated job's only group, when neither pool has one (llm-d's colocated setting).
GROUP_ENV: Final = ("TSLICE_GROUP", "TIMESLICE_GROUP")
#: The role, when ``from_env`` is not given one (``colocated``, ``trainer``, ``sampler``).
ROLE_ENV: Final = ("TSLICE_ROLE",)
#: The node agent that workloads register with (the last two: register_workload's own).
AGENT_ENV: Final = ("TSLICE_AGENT", "TSLICE_AGENT_ADDR", "SNAPSHOT_AGENT_ADDR")


def first_env(
    names: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[str, str] | None:
    """``(name, value)`` of the first of ``names`` set to something non-blank."""
    env = os.environ if environ is None else environ
    for name in names:
        value = env.get(name, "").strip()
        if value:
            return name, value
    return None


def env_names(names: Sequence[str]) -> str:
    """``$A (or $B)`` for messages."""
    first, *others = names
    if not others:
        return f"${first}"
    return f"${first} (or " + ", ".join(f"${n}" for n in others) + ")"


def check_group(value: str | None, *, source: str) -> str | None:
    """A group id, checked; ``None`` or blank stays ``None`` (not configured)."""
    if value is None or not value.strip():
        return None
    try:
        return validation.check_id("group", value.strip())
    except validation.InvalidIdError as err:
        raise errors.ConfigError(f"{err} (from {source})") from err


def env_group(names: Sequence[str]) -> str | None:
    found = first_env(names)
    return None if found is None else check_group(found[1], source=f"${found[0]}")
