"""slime: a phase callback that its driver loads by path.

slime's drivers (``train.py``, ``train_async.py``) call a *phase callback* at
every GPU phase boundary: ``on_phase_begin(phase, role, context)``,
``on_phase_end(phase, role, context)``, and ``close()`` after the loop; the class
is named by ``--phase-callback-path`` and instantiated without arguments. llm-d's
integration is ``--phase-callback-path timeslice_slime.callback.TimesliceCallback``;
tslice's is the same class name at another path, configured by the same
environment variables::

    python train.py ... --phase-callback-path tslice.rl.slime.TimesliceCallback

    TIMESLICE_JOB_ID          the job (a fresh one per attempt)
    TIMESLICE_ORCH_ADDR       the orchestrator, host:port
    TIMESLICE_TRAINER_GROUP   the trainer pool's group
    TIMESLICE_SAMPLER_GROUP   the sampler pool's group

(or tslice's ``TSLICE_*`` names, see :mod:`tslice.rl.settings`). Without an
orchestrator address the callback is a no-op, said once on stderr.

The driver is the one process that holds the job's groups (its Ray actors do the
GPU work), so the callback is a :class:`~tslice.rl.Phases` of role
``colocated``. slime's phases map onto tslice's: ``init``, ``generate``,
``train``, ``weight_sync``, ``eval`` and ``save`` are themselves; ``offload`` and
``onload`` (the rollout engine's memory moving, on the sampler GPUs) count as
``generate``, ``create`` (actor re-creation, on the trainer GPUs) as ``train``; a
phase name slime adds later is placed by its role argument (``sampler``,
``trainer``, ``both``). A slime phase whose groups an open phase already holds
takes no new group (``eval`` while ``train_async.py``'s next generation is in
flight holds the sampler group once); two slime phases that stand for the same
tslice phase at once (``onload`` inside ``generate``) share it until both ended.
At the end of ``weight_sync`` both groups are yielded (llm-d's guide
version keeps the trainer group until the next ``train``; tslice lets another job
train in between).

The callback duck-types slime's ``PhaseCallback`` instead of subclassing it, so
this module imports no slime and works with any driver that calls the three
methods.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from tslice.rl import roles
from tslice.rl.phases import Phases

log = logging.getLogger(__name__)

_P = roles.Phase

#: slime's phase names, as tslice phases.
SLIME_PHASES: dict[str, roles.Phase] = {
    "init": _P.INIT,
    "generate": _P.GENERATE,
    "train": _P.TRAIN,
    "weight_sync": _P.WEIGHT_SYNC,
    "eval": _P.EVAL,
    "save": _P.SAVE,
    "offload": _P.GENERATE,
    "onload": _P.GENERATE,
    "create": _P.TRAIN,
}
#: A phase name not in :data:`SLIME_PHASES`, by slime's role argument (the pools it uses).
SLIME_ROLES: dict[str, roles.Phase] = {
    "sampler": _P.GENERATE,
    "trainer": _P.TRAIN,
    "both": _P.WEIGHT_SYNC,
}


def tslice_phase(phase: str, role: str) -> roles.Phase:
    """The tslice phase that slime's ``(phase, role)`` stands for."""
    known = SLIME_PHASES.get(phase)
    if known is not None:
        return known
    by_role = SLIME_ROLES.get(role)
    if by_role is None:
        raise roles.PhaseError(
            f"slime phase {phase!r} with role {role!r} cannot be placed: known phases are "
            f"{', '.join(SLIME_PHASES)}; an unknown phase needs role "
            f"{', '.join(repr(r) for r in SLIME_ROLES)}"
        )
    return by_role


class TimesliceCallback:
    """slime phase callback: takes the job's groups at slime's phase boundaries.

    ``phases`` is for tests and programmatic use; slime calls ``TimesliceCallback()``,
    which reads the environment (:meth:`Phases.from_env <tslice.rl.Phases.from_env>`).
    """

    def __init__(self, phases: Phases | None = None) -> None:
        self.phases = phases if phases is not None else Phases.from_env(role="colocated")
        # slime phase -> the tslice phase it stands for; tslice phase -> slime phases in it.
        self._open: dict[str, roles.Phase] = {}
        self._users: dict[roles.Phase, set[str]] = {}
        self._lock = threading.Lock()

    def on_phase_begin(
        self, phase: str, role: str, context: Mapping[str, Any] | None = None
    ) -> None:
        stand_in = tslice_phase(phase, role)
        with self._lock:
            if phase in self._open:
                raise roles.PhaseError(
                    f"slime phase {phase!r} began twice without ending (context {context!r})"
                )
            self._open[phase] = stand_in
            users = self._users.setdefault(stand_in, set())
            users.add(phase)
            if len(users) > 1:
                return  # its tslice phase is open already, for another slime phase
        try:
            grants = self.phases.begin(stand_in)
        except BaseException:
            with self._lock:
                self._forget(phase, stand_in)
            raise
        log.info(
            "slime phase %s began (%s): waited %s ms",
            phase,
            stand_in.value,
            {group: grant.waited_ms for group, grant in grants.items()},
            extra={"job_id": self.phases.job_id, "rollout_id": _rollout(context)},
        )

    def on_phase_end(self, phase: str, role: str, context: Mapping[str, Any] | None = None) -> None:
        with self._lock:
            stand_in = self._open.get(phase)
            if stand_in is None:
                raise roles.PhaseError(
                    f"slime phase {phase!r} ended without a begin (open now: "
                    f"{', '.join(self._open) or 'none'})"
                )
            last = self._forget(phase, stand_in)
        if last:
            self.phases.end(stand_in)
            log.info(
                "slime phase %s ended",
                phase,
                extra={"job_id": self.phases.job_id, "rollout_id": _rollout(context)},
            )

    def close(self) -> None:
        """Yield whatever is still held and close the client (slime calls it after the loop)."""
        with self._lock:
            self._open.clear()
            self._users.clear()
        self.phases.close()

    def _forget(self, phase: str, stand_in: roles.Phase) -> bool:
        """Drop ``phase``; True when it was the last slime phase in ``stand_in``."""
        del self._open[phase]
        users = self._users[stand_in]
        users.discard(phase)
        if users:
            return False
        del self._users[stand_in]
        return True


def _rollout(context: Mapping[str, Any] | None) -> object:
    return None if context is None else context.get("rollout_id")
