"""How much one orchestrator takes at once: waiters per group, event watchers (issue 21 §4).

Every queue and every fan-out is bounded, so that no caller (a flood of Acquires, a
thousand idle WatchEvents streams, a scraper without a role) can make the orchestrator
slow for the others. Past a cap the call is refused RESOURCE_EXHAUSTED, naming the cap
and the setting that raises it; nothing is queued or dropped silently. Configured as
``limits:`` in the orchestrator's config file.
"""

from __future__ import annotations

import dataclasses

import pydantic

#: Waiters a GetGroupStatus lists (the first ones; it says how many it left out).
MAX_LISTED_WAITERS = 1000


@dataclasses.dataclass(frozen=True)
class Limits:
    #: Jobs one group's queue takes; an Acquire of one more is refused (RESOURCE_EXHAUSTED).
    max_waiters_per_group: int = 10_000
    #: WatchEvents streams open at once, in all.
    max_watchers: int = 4096
    #: WatchEvents streams one caller (its verified identity, else its host) may hold open.
    max_watchers_per_caller: int = 256


class LimitsModel(pydantic.BaseModel):
    """``limits:`` in the config file (see :class:`Limits`)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    max_waiters_per_group: int = pydantic.Field(default=10_000, ge=1)
    max_watchers: int = pydantic.Field(default=4096, ge=1)
    max_watchers_per_caller: int = pydantic.Field(default=256, ge=1)

    def settings(self) -> Limits:
        return Limits(**self.model_dump())
