"""Scheduling policies of a group: who of the live waiters is granted next.

:class:`Policy` is the interface and FIFO (the default); :class:`Priority` (with
aging), :class:`FairShare` (weighted device time) and :class:`CostAware` (switch
costs and gaps) extend it. Each states its starvation bound in its docstring. The
group's lock (``tslice.orchestrator.group.lock``) consults its policy whenever it promotes
a waiter; :func:`build` makes one from its configuration (``spec``).
"""

from __future__ import annotations

from tslice.orchestrator.policy.base import Average, Phases, Policy, View, Waiter
from tslice.orchestrator.policy.cost_aware import CostAware
from tslice.orchestrator.policy.fair_share import FairShare
from tslice.orchestrator.policy.prefetch import Prefetch, should_prefetch
from tslice.orchestrator.policy.priority import Priority
from tslice.orchestrator.policy.spec import (
    KINDS,
    CostAwareSpec,
    FairShareSpec,
    FifoSpec,
    PolicySpec,
    PrioritySpec,
    kind_of,
)

__all__ = [
    "KINDS",
    "Average",
    "CostAware",
    "CostAwareSpec",
    "FairShare",
    "FairShareSpec",
    "FifoSpec",
    "Phases",
    "Policy",
    "PolicySpec",
    "Prefetch",
    "Priority",
    "PrioritySpec",
    "View",
    "Waiter",
    "build",
    "kind_of",
    "should_prefetch",
]


def build(spec: PolicySpec) -> Policy:
    """The policy object for one group (each group gets its own: it keeps state)."""
    if isinstance(spec, PrioritySpec):
        return Priority(spec)
    if isinstance(spec, FairShareSpec):
        return FairShare(spec)
    if isinstance(spec, CostAwareSpec):
        return CostAware(spec)
    return Policy()
