"""How an agent names its grant mark when it refuses a stale grant, and how it is read.

An agent records, per group, the highest grant epoch it was told (its *mark*) and
refuses older grants (FAILED_PRECONDITION), so that a delayed or replayed grant never
moves anything. An orchestrator that lost its database starts again from epoch 0 and
every grant it sends is then stale: it learns the agent's mark from the refusal and
numbers its next grant past it (never below an agent's mark). The mark travels at the
end of the refusal's message as ``[grant mark N]``, over unary calls and over the
GrantStream alike (its replies carry a status code and message only).
"""

from __future__ import annotations

import re

#: Marks at or above this are not adopted (the orchestrator's counter could not pass
#: them without overflowing int64): such a node is refused as before, and degraded.
MAX_ADOPTED = 2**62

_MARK = re.compile(r"\[grant mark (\d{1,19})\]$")


def tagged(message: str, mark: int) -> str:
    """``message`` with the agent's mark appended, as :func:`mark_of` reads it."""
    return f"{message} [grant mark {mark}]"


def mark_of(message: str) -> int | None:
    """The mark a stale-grant refusal names, or None."""
    found = _MARK.search(message)
    return int(found.group(1)) if found else None
