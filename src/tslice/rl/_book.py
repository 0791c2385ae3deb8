"""What :class:`~tslice.rl.Phases` and :class:`~tslice.rl.AsyncPhases` share without I/O:
settings checks, the open phases, and the rules a begin or an end must follow.

The rules, the same with and without an orchestrator (so a script that runs in
no-op mode does not break once the platform is there):

- a phase is begun once and ended once; a second begin of an open phase, and an
  end of a phase that is not open, are :class:`~tslice.rl.roles.PhaseError`;
- different phases may be open together (pipelines that overlap generation of
  step N+1 with training of step N); a group needed by several open phases is
  held once and yielded when the last of them ends;
- but a begin may not take the trainer group while an open phase holds the
  sampler group without it: every job takes the trainer group first, so one that
  holds the sampler pool and waits for the trainer pool could deadlock with
  another job that does the opposite.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any

from tslice.common import errors
from tslice.rl import roles, settings

# Once per process, for Phases, AsyncPhases and the framework callbacks together.
_noop_said: list[str] = []
_noop_lock = threading.Lock()


def announce_noop(reason: str) -> None:
    """Say once on stderr that phases take no groups, and why (stderr: visible without
    logging set up, since a job that runs alone unnoticed is what must not happen)."""
    with _noop_lock:
        if _noop_said:
            return
        _noop_said.append(reason)
    print(
        f"tslice.rl: time-slicing is off: {reason}; phases run without taking any group "
        "(set $TSLICE_DISABLED=1 if that is intended)",
        file=sys.stderr,
        flush=True,
    )


@dataclasses.dataclass
class OpenPhase:
    phase: roles.Phase
    groups: tuple[str, ...]
    #: False while its groups are being acquired.
    ready: bool = False
    #: The slice contexts entered for it, in acquisition order.
    holds: list[Any] = dataclasses.field(default_factory=list)


_GROUP_SOURCES = {
    roles.Pool.TRAINER: settings.TRAINER_GROUP_ENV,
    roles.Pool.SAMPLER: settings.SAMPLER_GROUP_ENV,
}


class PhaseBook:
    """The role, its groups, and the phases open now (thread-safe)."""

    def __init__(
        self,
        role: roles.Role | str,
        trainer_group: str | None,
        sampler_group: str | None,
        *,
        enabled: bool,
        job_id: str,
    ) -> None:
        self.role = roles.parse_role(role)
        self.trainer_group = settings.check_group(trainer_group, source="trainer_group")
        self.sampler_group = settings.check_group(sampler_group, source="sampler_group")
        self.pools = roles.pool_groups(self.role, self.trainer_group, self.sampler_group)
        if enabled:
            self._check_configured()
            if not job_id:
                raise errors.ConfigError(
                    "a job id is required: pass job_id= or set $TSLICE_JOB_ID "
                    "(or $TIMESLICE_JOB_ID), or give a client that has one"
                )
        # Acquisition order of each group: the trainer group before the sampler group.
        self._rank = {group: i for i, group in enumerate(dict.fromkeys(self.pools.values()))}
        self._open: dict[roles.Phase, OpenPhase] = {}
        self._lock = threading.Lock()
        self.closed = False

    def _check_configured(self) -> None:
        if self.role is roles.Role.COLOCATED and not self.pools:
            raise errors.ConfigError(
                "a colocated job needs at least one group: pass trainer_group= and/or "
                f"sampler_group=, or set {settings.env_names(settings.TRAINER_GROUP_ENV)} "
                f"and/or {settings.env_names(settings.SAMPLER_GROUP_ENV)} "
                f"(one group for everything: {settings.env_names(settings.GROUP_ENV)})"
            )
        for pool in roles.required_pools(self.role):
            if pool not in self.pools:
                raise errors.ConfigError(
                    f"role {self.role.value!r} needs the {pool} group: pass {pool}_group= or "
                    f"set {settings.env_names(_GROUP_SOURCES[pool])}"
                )

    def groups_for(self, phase: roles.Phase | str) -> tuple[str, ...]:
        return roles.phase_groups(self.role, phase, self.trainer_group, self.sampler_group)

    def open_phases(self) -> tuple[roles.Phase, ...]:
        with self._lock:
            return tuple(self._open)

    # -- begin ------------------------------------------------------------------------

    def opening(self, phase: roles.Phase | str, owner: str) -> OpenPhase:
        """Check that ``phase`` may begin now and record it as being acquired."""
        parsed = roles.parse_phase(phase)
        groups = self.groups_for(parsed)
        with self._lock:
            if self.closed:
                raise roles.PhaseError(f"cannot begin phase {parsed.value!r}: {owner} is closed")
            if parsed in self._open:
                raise roles.PhaseError(
                    f"phase {parsed.value!r} is already open; end it before beginning it again"
                )
            self._check_order(parsed, groups)
            entry = OpenPhase(parsed, groups)
            self._open[parsed] = entry
            return entry

    def _check_order(self, phase: roles.Phase, groups: tuple[str, ...]) -> None:
        held = {g: p for p, e in self._open.items() for g in e.groups}
        if not held:
            return
        last = max(held, key=self._rank.__getitem__)
        for group in groups:
            if group not in held and self._rank[group] < self._rank[last]:
                raise roles.PhaseError(
                    f"phase {phase.value!r} cannot begin while phase {held[last].value!r} "
                    f"holds group {last!r}: it needs group {group!r}, and tslice.rl always "
                    f"takes the trainer group before the sampler group (taking them the other "
                    f"way round could deadlock with another job); end {held[last].value!r} "
                    f"first, or begin {phase.value!r} before it"
                )

    def opened(self, entry: OpenPhase) -> bool:
        """The groups are held; False when the owner was closed meanwhile (release them)."""
        with self._lock:
            if self.closed:
                self._open.pop(entry.phase, None)
                return False
            entry.ready = True
            return True

    def abandon(self, entry: OpenPhase) -> None:
        """The acquisition failed: the phase is not open."""
        with self._lock:
            if self._open.get(entry.phase) is entry:
                del self._open[entry.phase]

    # -- end --------------------------------------------------------------------------

    def ending(self, phase: roles.Phase | str) -> OpenPhase:
        """Check that ``phase`` is open and take it out; its holds are the caller's to exit."""
        parsed = roles.parse_phase(phase)
        with self._lock:
            entry = self._open.get(parsed)
            if entry is None:
                if self.closed:
                    raise roles.PhaseError(
                        f"phase {parsed.value!r} is not open (closing ended every phase)"
                    )
                now = ", ".join(repr(p.value) for p in self._open) or "none"
                raise roles.PhaseError(
                    f"phase {parsed.value!r} was not begun, so it cannot end (open now: {now})"
                )
            if not entry.ready:
                raise roles.PhaseError(
                    f"phase {parsed.value!r} is still acquiring its groups in another thread"
                )
            del self._open[parsed]
            return entry

    def close(self) -> list[OpenPhase]:
        """Refuse further begins; the phases still open, latest first, to end."""
        with self._lock:
            self.closed = True
            entries = [e for e in self._open.values() if e.ready]
            for entry in entries:
                del self._open[entry.phase]
        return entries[::-1]
