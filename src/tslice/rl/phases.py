"""``Phases``: an RL job reports its phases; tslice takes the right groups for each.

::

    from tslice.rl import Phases

    phases = Phases.from_env(role="colocated")     # a no-op when nothing is configured
    for step in range(steps):
        with phases.phase("generate"):             # the sampler group
            rollouts = generate(policy)
        rewards = score(rollouts)                  # CPU: another job may use the GPUs
        with phases.phase("train"):                # the trainer group
            train(policy, rollouts, rewards)
        with phases.phase("weight_sync"):          # both groups, granted together
            push_weights(policy)
    phases.close()

Frameworks with begin/end hooks call ``phases.begin("train")`` and
``phases.end("train")`` instead. Which phase takes which group for which role is
:mod:`tslice.rl.roles`; the rules for begins and ends are in :mod:`tslice.rl._book`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MappingProxyType
from typing import TYPE_CHECKING

from tslice.client import USE_CLIENT_DEFAULT, AcquireResult, Client
from tslice.rl import _base, _book, _workload, roles

if TYPE_CHECKING:
    from typing_extensions import Self

#: What a phase's groups were granted with (group -> result); empty for a phase that
#: takes no group, and success at once in no-op mode.
Grants = _base.Grants


class Phases(_base.PhasesBase[Client]):
    """The phases of one RL process, mapped onto tslice groups.

    Args:
        job_id: the job (else ``$TSLICE_JOB_ID``, else ``$TIMESLICE_JOB_ID``).
        address: the orchestrator (else ``$TSLICE_ORCHESTRATOR``, else
            ``$TIMESLICE_ORCH_ADDR``); none anywhere: no-op mode.
        trainer_group, sampler_group: the two pools' groups; the same group, or only
            one of them, is fine for a colocated job (every phase then takes it).
        role: ``"colocated"``, ``"trainer"`` or ``"sampler"`` (:class:`Role`).
        client: a :class:`~tslice.Client` to use instead of making one (then not
            closed by :meth:`close`; ``address`` must not be given too).
        timeout: seconds a begin may wait for its groups, all of them together
            (:class:`~tslice.AcquireTimeout` after; the job is then no longer
            queued); ``None``: the client's default (as long as it takes).
        workload: an adapter to register with the node agent (``TorchAdapter``, an
            engine, an object with ``snapshot``/``restore``...), so that its state is
            offloaded when another job takes the group and restored at the next grant.
            One adapter goes to the role's pool; a colocated job with two groups gives
            ``{"trainer": adapter, "sampler": adapter}``.
        agent: the node agent's address for ``workload`` (else ``$TSLICE_AGENT``,
            ``$TSLICE_AGENT_ADDR``, ``$SNAPSHOT_AGENT_ADDR``).
        register_timeout: seconds to wait for the agent to acknowledge each
            registration (a :class:`~tslice.ConfigError` after); ``None``: do not wait.

    In no-op mode (no orchestrator configured, or ``TSLICE_DISABLED=1``) phases run
    without taking groups and the first begin says so once on stderr; the same
    checks apply (unknown phases, unbalanced ends), so a script that runs without
    the platform runs with it.

    A phase's groups not held yet are granted together, all or nothing
    (:meth:`~tslice.Client.acquire_set`: ``weight_sync`` gets both pools as soon as
    both are free, and both switch at once); from an orchestrator without it, one
    after the other, trainer group first (one global order for every job).
    Thread-safe; a begin waits without blocking ends in other threads.
    """

    def _connect(self, address: str | None, job_id: str | None) -> Client:
        return Client(address, job_id=USE_CLIENT_DEFAULT if job_id is None else job_id)

    def _registering(self, registrations: _workload.Registrations) -> None:
        registrations.wait(self._register_timeout)

    def _construction_failed(self) -> None:
        self._close_client()

    # -- phases -----------------------------------------------------------------------

    def begin(self, phase: roles.Phase | str, *, timeout: float | None = None) -> Grants:
        """Take ``phase``'s groups; returns when the job's state is resident on them.

        ``timeout`` overrides the Phases' own for this begin.
        """
        entry = self._opening(phase)
        try:
            grants = self._take(entry, timeout)
        except BaseException:
            self._book.abandon(entry)
            raise
        if not self._book.opened(entry):
            self._release(entry, None)
            raise roles.PhaseError(f"phase {entry.phase.value!r} began while closing")
        return grants

    def end(self, phase: roles.Phase | str) -> None:
        """Yield ``phase``'s groups (those no other open phase still needs)."""
        self._release(self._book.ending(phase), None)

    @contextlib.contextmanager
    def phase(self, phase: roles.Phase | str, *, timeout: float | None = None) -> Iterator[Grants]:
        """``with phases.phase("train"):`` -- begin, run the block, end (also on errors)."""
        grants = self.begin(phase, timeout=timeout)
        try:
            yield grants
        except BaseException as exc:
            with contextlib.suppress(roles.PhaseError):  # the block ended it itself
                self._release(self._book.ending(phase), exc)
            raise
        self.end(phase)

    def close(self) -> None:
        """End the phases still open, stop the workload channels, close the client
        (if this Phases made it). Idempotent."""
        first: BaseException | None = None
        for entry in self._book.close():
            try:
                self._release(entry, None)
            except Exception as exc:
                first = first or exc
        if self._workloads is not None:
            self._workloads.close()
        self._close_client()
        if first is not None:
            raise first

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------

    def _take(self, entry: _book.OpenPhase, timeout: float | None) -> Grants:
        if not self.enabled:
            return self._noop_grants(entry)
        grants: dict[str, AcquireResult] = {}
        try:
            for hold in self._slices(entry, timeout):
                grants.update(hold.__enter__())
                entry.holds.append(hold)
        except BaseException as exc:
            self._release(entry, exc)
            raise
        return MappingProxyType(grants)

    @staticmethod
    def _release(entry: _book.OpenPhase, exc: BaseException | None) -> None:
        """Exit the phase's holds, latest first; with ``exc`` (the phase failed) a
        failed yield is logged by the client rather than raised over it."""
        holds, entry.holds = entry.holds, []
        first: BaseException | None = None
        for hold in reversed(holds):
            try:
                hold.__exit__(type(exc) if exc else None, exc, None)
            except Exception as failure:
                first = first or failure
        if first is not None:
            raise first

    def _close_client(self) -> None:
        if self._owns_client:
            self._client.close()
