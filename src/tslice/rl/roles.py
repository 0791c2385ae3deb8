"""Phases, roles, and which groups each phase of each role takes (pure logic, no I/O).

An RL job has two pools of accelerators, each a tslice group: the *trainer* group
(optimiser, reference and critic models) and the *sampler* group (the rollout
engine). Its phases are :class:`Phase`; the process that reports them plays a
:class:`Role`:

=============  ===================  =================  ===========================
phase          colocated            trainer            sampler
=============  ===================  =================  ===========================
init           trainer + sampler    trainer            sampler
generate       sampler              --                 sampler
train          trainer              trainer            --
weight_sync    trainer + sampler    trainer + sampler  --
eval           sampler              --                 sampler
save           trainer              trainer            --
=============  ===================  =================  ===========================

``--``: not this role's phase; it holds nothing (the other role's process takes
its group). Why the sampler holds nothing during ``weight_sync``: the orchestrator
keys a lock by job, not by process, and one Yield releases it whatever the number
of Acquires. If the sampler process took the sampler group too, whichever side
finished first would release it under the other. The trainer process therefore
holds both groups for the whole transfer, and the sampler's receiving end runs
inside that window (the transfer cannot finish before the sampler has received).

``init`` of a colocated job takes both groups: loading the models onto devices that
another job's state occupies would overrun that job's memory.

Groups that are the same group, or a group that is not configured, collapse: a
colocated job with a single group takes it in every phase; a trainer whose sampler
pool is not time-sliced takes only the trainer group in ``weight_sync``.

A phase's groups that are not held yet are granted together, all or nothing
(AcquireSet: ``weight_sync`` gets both pools once both are free). From an
orchestrator without it they are taken **trainer group first, then sampler group**,
by every role and every phase: that is one fixed global order (also the one llm-d's
integrations use), so two jobs can never each hold one pool while waiting for the
other.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Final

from tslice.common import errors

if TYPE_CHECKING:
    from typing_extensions import Self


class PhaseError(errors.TsliceError):
    """A phase was used wrongly (unknown name, ended without a begin, out of order...).

    The message names the phase, what is open, and what to do instead.
    """


class _Name(str, enum.Enum):
    """A name that prints as itself; parsing an unknown one lists the known ones."""

    _value_: str

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: Self | str) -> Self:
        """``name`` as a member; an unknown name is a :class:`PhaseError` listing them."""
        if isinstance(name, cls):
            return name
        try:
            return cls(name)
        except ValueError:
            what = cls.__name__.lower()
            known = ", ".join(member.value for member in cls)
            raise PhaseError(f"unknown {what} {name!r}; the {what}s are: {known}") from None


class Phase(_Name):
    """The phases of an RL step (compare equal to their names: ``Phase.TRAIN == "train"``)."""

    INIT = "init"
    GENERATE = "generate"
    TRAIN = "train"
    WEIGHT_SYNC = "weight_sync"
    EVAL = "eval"
    SAVE = "save"


class Role(_Name):
    """What the reporting process runs: every phase, or one pool's side of them."""

    #: One process runs every phase (a single driver, or trainer and sampler on shared GPUs).
    COLOCATED = "colocated"
    #: The trainer side of a disaggregated job (its own process, its own pool).
    TRAINER = "trainer"
    #: The sampler side of a disaggregated job.
    SAMPLER = "sampler"


class Pool(_Name):
    """The two pools of a job, in the order they are acquired."""

    TRAINER = "trainer"
    SAMPLER = "sampler"


_T, _S = Pool.TRAINER, Pool.SAMPLER

#: Pools each phase takes, per role, in acquisition order (trainer first).
POOLS: Final[dict[Role, dict[Phase, tuple[Pool, ...]]]] = {
    Role.COLOCATED: {
        Phase.INIT: (_T, _S),
        Phase.GENERATE: (_S,),
        Phase.TRAIN: (_T,),
        Phase.WEIGHT_SYNC: (_T, _S),
        Phase.EVAL: (_S,),
        Phase.SAVE: (_T,),
    },
    Role.TRAINER: {
        Phase.INIT: (_T,),
        Phase.GENERATE: (),
        Phase.TRAIN: (_T,),
        Phase.WEIGHT_SYNC: (_T, _S),
        Phase.EVAL: (),
        Phase.SAVE: (_T,),
    },
    Role.SAMPLER: {
        Phase.INIT: (_S,),
        Phase.GENERATE: (_S,),
        Phase.TRAIN: (),
        Phase.WEIGHT_SYNC: (),
        Phase.EVAL: (_S,),
        Phase.SAVE: (),
    },
}


def parse_phase(phase: Phase | str) -> Phase:
    """``phase`` as a :class:`Phase`; an unknown name is a :class:`PhaseError` listing them."""
    return Phase.parse(phase)


def parse_role(role: Role | str) -> Role:
    """``role`` as a :class:`Role`; an unknown name is a :class:`PhaseError` listing them."""
    return Role.parse(role)


def pool_groups(
    role: Role, trainer_group: str | None, sampler_group: str | None
) -> dict[Pool, str]:
    """Which group each pool is, after collapsing: a colocated job with one group uses
    it for both pools; a pool without a group is left out."""
    groups: dict[Pool, str] = {}
    if trainer_group:
        groups[_T] = trainer_group
    if sampler_group:
        groups[_S] = sampler_group
    if role is Role.COLOCATED and len(groups) == 1:
        (only,) = groups.values()
        groups = {_T: only, _S: only}
    return groups


def phase_groups(
    role: Role | str,
    phase: Phase | str,
    trainer_group: str | None,
    sampler_group: str | None,
) -> tuple[str, ...]:
    """The groups ``phase`` of ``role`` takes, in acquisition order, without repeats."""
    pools = POOLS[parse_role(role)][parse_phase(phase)]
    groups = pool_groups(parse_role(role), trainer_group, sampler_group)
    return tuple(dict.fromkeys(groups[p] for p in pools if p in groups))


def required_pools(role: Role) -> tuple[Pool, ...]:
    """The pools a role cannot run without (colocated: at least one, checked apart)."""
    if role is Role.TRAINER:
        return (_T,)
    if role is Role.SAMPLER:
        return (_S,)
    return ()
