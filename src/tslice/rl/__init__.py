"""tslice for RL jobs: report phases, not locks.

::

    from tslice.rl import Phases

    phases = Phases.from_env(role="colocated")   # TIMESLICE_*/TSLICE_* variables; no-op if unset
    with phases.phase("generate"):               # the sampler group
        ...
    with phases.phase("train"):                  # the trainer group
        ...
    with phases.phase("weight_sync"):            # both groups, granted together
        ...

Roles and the groups of each phase: :mod:`tslice.rl.roles`. Framework integrations
live in their own modules (``tslice.rl.slime``...) and import their framework
lazily, so ``import tslice.rl`` needs none of them.
"""

from __future__ import annotations

from tslice.rl.async_phases import AsyncPhases
from tslice.rl.phases import Grants, Phases
from tslice.rl.roles import Phase, PhaseError, Role, phase_groups

__all__ = ["AsyncPhases", "Grants", "Phase", "PhaseError", "Phases", "Role", "phase_groups"]
