"""What a group's scheduling policy is configured with: plain frozen data.

``tslice.orchestrator.config`` builds these from the topology file (and the
orchestrator-wide default); :func:`tslice.orchestrator.policy.build` turns one into
the policy object that a group's lock consults. Field meanings and their effect on
each policy's starvation bound are documented on the policy classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TypeAlias


@dataclasses.dataclass(frozen=True)
class FifoSpec:
    """First come, first served (the default)."""


@dataclasses.dataclass(frozen=True)
class PrioritySpec:
    """Higher priority first; a waiter gains one priority level per ``aging_s`` waited."""

    aging_s: float = 60.0
    #: job id -> priority (jobs not named have ``default_priority``).
    priorities: Mapping[str, int] = dataclasses.field(default_factory=dict)
    default_priority: int = 0


@dataclasses.dataclass(frozen=True)
class FairShareSpec:
    """The waiter with the least device time per unit of weight goes next."""

    #: job id -> weight (jobs not named have ``default_weight``).
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    default_weight: float = 1.0
    #: Every turn is charged at least this many seconds (a turn of no length still costs).
    quantum_s: float = 1.0
    #: A job's lead over the least-served active job is capped at this many weighted
    #: seconds when it starts waiting: older usage is forgiven.
    memory_s: float = 600.0
    #: A job that comes back keeps at most this much of what it is owed (weighted
    #: seconds below the least-served active job); a new job is owed nothing.
    credit_s: float = 10.0


@dataclasses.dataclass(frozen=True)
class CostAwareSpec:
    """Cheapest switch first; hold the group for a resident that is about to come back."""

    #: A waiter that has waited this long is never passed by a cheaper one nor held
    #: off for the resident again.
    max_defer_s: float = 30.0
    #: Switch-in cost assumed for a job until one is measured, seconds.
    default_switch_s: float = 1.0
    #: Restore bandwidth that turns a footprint into a switch-in cost before one is
    #: measured, bytes per second (0: unknown, use ``default_switch_s``).
    bandwidth_bytes_per_s: float = 0.0
    #: How many gaps of a resident must have been seen before the group waits for it.
    gap_samples: int = 2
    #: How long the group waits for the resident, in expected gaps.
    gap_patience: float = 1.5


PolicySpec: TypeAlias = "FifoSpec | PrioritySpec | FairShareSpec | CostAwareSpec"

#: The names of the policies in the topology file (``policy: {kind: ...}``).
KINDS: Mapping[str, type[FifoSpec | PrioritySpec | FairShareSpec | CostAwareSpec]] = {
    "fifo": FifoSpec,
    "priority": PrioritySpec,
    "fair-share": FairShareSpec,
    "cost-aware": CostAwareSpec,
}


def kind_of(spec: PolicySpec) -> str:
    return next(name for name, cls in KINDS.items() if isinstance(spec, cls))
