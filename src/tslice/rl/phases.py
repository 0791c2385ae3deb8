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
        with phases.phase("weight_sync"):          # both groups, trainer group first
            push_weights(policy)
    phases.close()

Frameworks with begin/end hooks call ``phases.begin("train")`` and
``phases.end("train")`` instead. Which phase takes which group for which role is
:mod:`tslice.rl.roles`; the rules for begins and ends are in :mod:`tslice.rl._book`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType

from typing_extensions import Self

from tslice.client import USE_CLIENT_DEFAULT, AcquireResult, Client
from tslice.common import errors
from tslice.rl import _book, _workload, roles, settings

#: What a phase's groups were granted with (group -> result); empty for a phase that
#: takes no group, and success at once in no-op mode.
Grants = Mapping[str, AcquireResult]

_NOOP = AcquireResult(success=True, waited_ms=0, context_restored=False, grant_epoch=0)


class Phases:
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

    Several groups are taken one after the other, trainer group first (one global
    order for every job; the atomic all-or-nothing multi-group acquire does not
    exist yet). Thread-safe; a begin waits without blocking ends in other threads.
    """

    def __init__(
        self,
        *,
        job_id: str | None = None,
        address: str | None = None,
        trainer_group: str | None = "trainer",
        sampler_group: str | None = "sampler",
        role: roles.Role | str = roles.Role.COLOCATED,
        client: Client | None = None,
        timeout: float | None = None,
        workload: object | None = None,
        agent: str | None = None,
        register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
    ) -> None:
        if client is not None and address is not None:
            raise errors.ConfigError("pass either client= or address= to Phases, not both")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self._owns_client = client is None
        self._client = client if client is not None else _make_client(address, job_id)
        self._timeout = timeout
        job = job_id if job_id is not None else self._client.job_id
        self._job = job or ""
        self._workloads: _workload.Registrations | None = None
        try:
            self._book = _book.PhaseBook(
                role, trainer_group, sampler_group, enabled=self._client.enabled, job_id=self._job
            )
            planned = _workload.plan(workload, self._book.role, self._book.pools)
            if planned and self.enabled:
                registrations = _workload.Registrations(
                    agent=_workload.agent_address(agent), job_id=self._job, planned=planned
                )
                registrations.start()
                registrations.wait(register_timeout)
                self._workloads = registrations
        except BaseException:
            self._close_client()
            raise

    @classmethod
    def from_env(
        cls,
        role: roles.Role | str | None = None,
        *,
        client: Client | None = None,
        timeout: float | None = None,
        workload: object | None = None,
        agent: str | None = None,
        register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
    ) -> Self:
        """Phases configured by the environment (llm-d's names or tslice's).

        ``role`` defaults to ``$TSLICE_ROLE``, else colocated. Groups:
        ``$TSLICE_TRAINER_GROUP`` / ``$TIMESLICE_TRAINER_GROUP``,
        ``$TSLICE_SAMPLER_GROUP`` / ``$TIMESLICE_SAMPLER_GROUP``; with neither,
        ``$TSLICE_GROUP`` / ``$TIMESLICE_GROUP`` is a colocated job's only group.
        """
        trainer, sampler = env_groups()
        return cls(
            trainer_group=trainer,
            sampler_group=sampler,
            role=env_role(role),
            client=client,
            timeout=timeout,
            workload=workload,
            agent=agent,
            register_timeout=register_timeout,
        )

    # -- facts ------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False in no-op mode: phases take no groups."""
        return self._client.enabled

    @property
    def role(self) -> roles.Role:
        return self._book.role

    @property
    def job_id(self) -> str:
        return self._job

    @property
    def client(self) -> Client:
        return self._client

    @property
    def trainer_group(self) -> str | None:
        return self._book.pools.get(roles.Pool.TRAINER)

    @property
    def sampler_group(self) -> str | None:
        return self._book.pools.get(roles.Pool.SAMPLER)

    @property
    def open_phases(self) -> tuple[roles.Phase, ...]:
        """The phases begun and not yet ended, in the order they began."""
        return self._book.open_phases()

    def groups_for(self, phase: roles.Phase | str) -> tuple[str, ...]:
        """The groups ``phase`` takes for this role, in acquisition order."""
        return self._book.groups_for(phase)

    # -- phases -----------------------------------------------------------------------

    def begin(self, phase: roles.Phase | str, *, timeout: float | None = None) -> Grants:
        """Take ``phase``'s groups; returns when the job's state is resident on them.

        ``timeout`` overrides the Phases' own for this begin.
        """
        entry = self._book.opening(phase, "this Phases")
        try:
            grants = self._take(entry, self._timeout if timeout is None else timeout)
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

    def __repr__(self) -> str:
        return (
            f"Phases(job_id={self._job!r}, role={self.role.value!r}, "
            f"trainer_group={self.trainer_group!r}, sampler_group={self.sampler_group!r}, "
            f"enabled={self.enabled})"
        )

    # -- plumbing ---------------------------------------------------------------------

    def _take(self, entry: _book.OpenPhase, timeout: float | None) -> Grants:
        if not self.enabled:
            if not self._client.config.disabled_on_purpose:
                _book.announce_noop(self._client.config.noop_reason)
            return MappingProxyType(dict.fromkeys(entry.groups, _NOOP))
        deadline = None if timeout is None else time.monotonic() + timeout
        grants: dict[str, AcquireResult] = {}
        try:
            for group in entry.groups:
                wait = USE_CLIENT_DEFAULT if deadline is None else _left(deadline)
                hold = self._client.slice(group, job_id=self._job, timeout=wait)
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


def _left(deadline: float) -> float:
    # A tiny positive wait still lets the client raise its own AcquireTimeout.
    return max(deadline - time.monotonic(), 1e-3)


def _make_client(address: str | None, job_id: str | None) -> Client:
    return Client(address, job_id=USE_CLIENT_DEFAULT if job_id is None else job_id)


def env_groups() -> tuple[str | None, str | None]:
    """``(trainer group, sampler group)`` from the environment (see ``from_env``)."""
    trainer = settings.env_group(settings.TRAINER_GROUP_ENV)
    sampler = settings.env_group(settings.SAMPLER_GROUP_ENV)
    if trainer is None and sampler is None:
        only = settings.env_group(settings.GROUP_ENV)
        return only, only
    return trainer, sampler


def env_role(role: roles.Role | str | None) -> roles.Role:
    if role is not None:
        return roles.parse_role(role)
    found = settings.first_env(settings.ROLE_ENV)
    if found is None:
        return roles.Role.COLOCATED
    try:
        return roles.parse_role(found[1])
    except roles.PhaseError as err:
        raise errors.ConfigError(f"${found[0]}: {err}") from None
