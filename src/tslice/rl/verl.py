"""veRL: time-slicing at the phase boundaries of verl's PPO trainer, by one config key.

::

    python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode=timeslice

``timeslice`` is verl's synchronous trainer (``PPOTrainerSync``, verl's default mode)
with :class:`TimeSliceHooks` mixed in. verl looks trainer modes up in its registry
(``verl.trainer.ppo.v1.register_trainer``); this module registers ``timeslice`` when
it is imported in a process where verl is loaded, which verl does itself at
``import verl`` through its ``verl.plugins`` entry points (tslice declares one) or
``$VERL_USE_EXTERNAL_MODULES=tslice.rl.verl``. The trainer runs in verl's TaskRunner
actor, the single controller: that process takes the groups for the whole job (role
``colocated``, see :mod:`tslice.rl.roles`), from the environment that Ray gives it
(``TIMESLICE_JOB_ID``, ``TIMESLICE_ORCH_ADDR``, ``TIMESLICE_TRAINER_GROUP``,
``TIMESLICE_SAMPLER_GROUP``, or ``TSLICE_GROUP`` when rollout and training share the
GPUs). Without them the trainer runs as verl's own, and says so once on stderr. Inside,
the trainer is verl's ``sync`` mode: it sets ``trainer.v1.trainer_mode`` back to
``sync``, since verl's replay buffer and storage code test the mode's name.

Phases at verl's hooks (V1 ``PPOTrainer``; names as in verl 0.9.1)::

    init()                         init          model load on both pools, first weight sync
    on_validate_begin/_end         eval          validation rollouts
    on_step_begin                  generate      prepare_step() submits the batch to the
                                                 rollout replicas right after this hook
    on_sample_begin                generate      (again, for parameter_sync_step > 1)
    on_sample_end                  generate -> train   after the replicas went to sleep
    _save_checkpoint()             save          (inside train)
    on_step_end                    train -> weight_sync   around update_weights()
    fit() returning or raising     every open phase ends

A hand-over from one phase to the next takes the new phase's groups before it yields
the old one's when the tslice rules allow it (trainer group first), so a group both
need is never given up in between.

For the ``cuda`` backend, each of verl's GPU worker processes announces itself to its
node agent when verl loads this plugin there (:func:`tslice.rl.ray.announce_gpu_worker`:
the job id from ``$TIMESLICE_JOB_ID``, the group from ``$TSLICE_GROUP`` or the role's),
so a veRL job's snapshot finds them with no patch.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, cast

from tslice.rl import phases as _phases
from tslice.rl import ray as _ray
from tslice.rl import roles

#: The trainer mode to select (``trainer.v1.trainer_mode``).
TRAINER_MODE = "timeslice"

_registered: dict[str, type] = {}


class TimeSliceHooks:
    """Mix into a verl V1 ``PPOTrainer`` subclass, first among the bases::

        class MyTrainer(tslice.rl.verl.TimeSliceHooks, PPOTrainerSync): ...

    Its phases are the process's (:func:`tslice.rl.ray.phases`, role ``colocated``),
    made at ``init()`` in the process that runs the trainer; override
    :meth:`tslice_make_phases` to make them otherwise.
    """

    _tslice: _phases.Phases | None = None
    #: The verl mode this trainer runs as (``"sync"``; set by :func:`register`), or
    #: ``None`` to leave the config alone.
    tslice_runs_as: str | None = None

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        mode = self.tslice_runs_as
        if mode is not None and config.trainer.v1.trainer_mode != mode:
            # verl branches on the mode's *name* ("sync" or not: replay buffer, storage,
            # checkpoints), so the config names the mode this trainer really is; in place,
            # so that verl's TaskRunner and the logged config agree with the trainer.
            config.trainer.v1.trainer_mode = mode
        _next(self, TimeSliceHooks).__init__(config, *args, **kwargs)

    @property
    def tslice_phases(self) -> _phases.Phases:
        """The Phases this trainer reports to (made on first use)."""
        if self._tslice is None:
            self._tslice = self.tslice_make_phases()
        return self._tslice

    def tslice_make_phases(self) -> _phases.Phases:
        return _ray.phases(role=roles.Role.COLOCATED)

    # -- verl's entry points -------------------------------------------------------------

    def init(self) -> None:
        with self.tslice_phases.phase(roles.Phase.INIT):
            _next(self, TimeSliceHooks).init()

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        # fit() returns from inside its loop at the last step, before on_train_end.
        try:
            return _next(self, TimeSliceHooks).fit(*args, **kwargs)
        finally:
            self._tslice_end_all()

    def on_validate_begin(self) -> None:
        self._tslice_begin(roles.Phase.EVAL)
        _next(self, TimeSliceHooks).on_validate_begin()

    def on_validate_end(self) -> None:
        _next(self, TimeSliceHooks).on_validate_end()
        self._tslice_end(roles.Phase.EVAL)

    def on_step_begin(self) -> None:
        _next(self, TimeSliceHooks).on_step_begin()
        self._tslice_begin(roles.Phase.GENERATE)

    def on_sample_begin(self) -> None:
        self._tslice_begin(roles.Phase.GENERATE)
        _next(self, TimeSliceHooks).on_sample_begin()

    def on_sample_end(self) -> None:
        _next(self, TimeSliceHooks).on_sample_end()  # sync: the rollout replicas sleep
        self._tslice_hand_over(roles.Phase.GENERATE, roles.Phase.TRAIN)

    def _save_checkpoint(self) -> Any:
        with self.tslice_phases.phase(roles.Phase.SAVE):
            return _next(self, TimeSliceHooks)._save_checkpoint()

    def on_step_end(self) -> None:
        self._tslice_hand_over(roles.Phase.TRAIN, roles.Phase.WEIGHT_SYNC)
        try:
            _next(self, TimeSliceHooks).on_step_end()  # sync: update_weights()
        finally:
            self._tslice_end(roles.Phase.WEIGHT_SYNC)

    # -- plumbing ------------------------------------------------------------------------

    def _tslice_begin(self, phase: roles.Phase) -> None:
        """Begin ``phase`` unless it is open already (hooks may repeat a begin)."""
        if phase not in self.tslice_phases.open_phases:
            self.tslice_phases.begin(phase)

    def _tslice_end(self, phase: roles.Phase) -> None:
        if phase in self.tslice_phases.open_phases:
            self.tslice_phases.end(phase)

    def _tslice_hand_over(self, old: roles.Phase, new: roles.Phase) -> None:
        """End ``old`` and begin ``new``, holding the groups both need throughout."""
        phases = self.tslice_phases
        if old not in phases.open_phases:
            self._tslice_begin(new)
            return
        held, wanted = set(phases.groups_for(old)), set(phases.groups_for(new))
        trainer, sampler = phases.trainer_group, phases.sampler_group
        # Taking the trainer group while holding the sampler group without it is what
        # the fixed global order forbids; then the old phase has to go first.
        if trainer in wanted - held and sampler in held:
            self._tslice_end(old)
            self._tslice_begin(new)
        else:
            self._tslice_begin(new)
            self._tslice_end(old)

    def _tslice_end_all(self) -> None:
        if self._tslice is None:
            return
        for phase in reversed(self._tslice.open_phases):
            self._tslice.end(phase)


def _next(obj: object, cls: type) -> Any:
    """``super(cls, obj)`` as ``Any``: the next class is verl's, unknown to the checker."""
    return cast(Any, super(cls, obj))


def register(name: str = TRAINER_MODE, base: type | None = None) -> type:
    """Register ``TimeSliceHooks`` + ``base`` (verl's ``PPOTrainerSync`` by default) as
    verl trainer mode ``name``; returns the class. Idempotent.

    The class runs as the verl mode its base is registered under (``sync``): verl's code
    tests the mode's name, so the trainer sets ``trainer.v1.trainer_mode`` back to it.
    """
    known = _registered.get(name)
    if known is not None:
        return known
    v1 = importlib.import_module("verl.trainer.ppo.v1")
    parent = v1.PPOTrainerSync if base is None else base
    modes = importlib.import_module("verl.trainer.ppo.v1.trainer_base").TRAINER_REGISTRY
    runs_as = next(
        (mode for klass in parent.__mro__ for mode, known in modes.items() if known is klass),
        None,
    )
    cls = type(
        f"TimeSliced{parent.__name__}",
        (TimeSliceHooks, parent),
        {
            "__module__": __name__,
            "__doc__": f"verl's {parent.__name__}, time-sliced by tslice.",
            "tslice_runs_as": runs_as,
        },
    )
    v1.register_trainer(name)(cls)
    _registered[name] = cls
    return cls


# verl imports this module while it loads (entry point or $VERL_USE_EXTERNAL_MODULES):
# register then; imported without verl, the module stays light and registers nothing.
if "verl" in sys.modules:
    register()
# verl loads its plugins in every process that imports it, its GPU workers (FSDP or
# Megatron ranks, rollout engines) included: each announces itself to its node agent,
# so that the cuda backend finds the job's processes with no patch. Only a Ray worker
# that Ray gave GPUs does (not the TaskRunner, not the driver).
_ray.announce_gpu_worker(only_in_ray=True)
