"""What :class:`~tslice.rl.Phases` and :class:`~tslice.rl.AsyncPhases` share: the
arguments and their checks, ``from_env``, the facts, and the no-op grants.

Only the calls that wait (begin, end, close) differ between the two: blocking there,
awaited in the asyncio twin. The rules a begin or an end follows are
:mod:`tslice.rl._book`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from tslice.client import (
    USE_CLIENT_DEFAULT,
    AcquireResult,
    AsyncClient,
    AsyncSliceContext,
    Client,
    SliceContext,
)
from tslice.common import errors
from tslice.rl import _book, _workload, roles, settings

if TYPE_CHECKING:
    from typing_extensions import Self

#: What a phase's groups were granted with (group -> result); empty for a phase that
#: takes no group, and success at once in no-op mode.
Grants = Mapping[str, AcquireResult]

_NOOP = AcquireResult(success=True, waited_ms=0, context_restored=False, grant_epoch=0)

ClientT = TypeVar("ClientT", Client, AsyncClient)


class PhasesBase(Generic[ClientT]):
    """The part of a Phases that does not wait (arguments: :class:`~tslice.rl.Phases`)."""

    def __init__(
        self,
        *,
        job_id: str | None = None,
        address: str | None = None,
        trainer_group: str | None = "trainer",
        sampler_group: str | None = "sampler",
        role: roles.Role | str = roles.Role.COLOCATED,
        client: ClientT | None = None,
        timeout: float | None = None,
        workload: object | None = None,
        agent: str | None = None,
        register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
    ) -> None:
        owner = type(self).__name__
        if client is not None and address is not None:
            raise errors.ConfigError(f"pass either client= or address= to {owner}, not both")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self._owns_client = client is None
        self._client: ClientT = client if client is not None else self._connect(address, job_id)
        self._timeout = timeout
        self._job: str = (job_id if job_id is not None else self._client.job_id) or ""
        self._register_timeout = register_timeout
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
                self._workloads = registrations
                self._registering(registrations)
        except BaseException:
            self._construction_failed()
            raise

    def _connect(self, address: str | None, job_id: str | None) -> ClientT:
        """The client this Phases makes (and closes) when none is given."""
        raise NotImplementedError

    def _registering(self, registrations: _workload.Registrations) -> None:
        """The workload registrations started (a blocking Phases waits for them here)."""

    def _construction_failed(self) -> None:
        """``__init__`` failed after the client was made (release what can be, now)."""

    @classmethod
    def from_env(
        cls,
        role: roles.Role | str | None = None,
        *,
        client: ClientT | None = None,
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
    def client(self) -> ClientT:
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

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(job_id={self._job!r}, role={self.role.value!r}, "
            f"trainer_group={self.trainer_group!r}, sampler_group={self.sampler_group!r}, "
            f"enabled={self.enabled})"
        )

    # -- for begin --------------------------------------------------------------------

    def _opening(self, phase: roles.Phase | str) -> _book.OpenPhase:
        return self._book.opening(phase, f"this {type(self).__name__}")

    def _noop_grants(self, entry: _book.OpenPhase) -> Grants:
        """What a begin returns in no-op mode (saying once that phases take no group)."""
        if not self._client.config.disabled_on_purpose:
            _book.announce_noop(self._client.config.noop_reason)
        return MappingProxyType(dict.fromkeys(entry.groups, _NOOP))

    def _slices(self, entry: _book.OpenPhase, timeout: float | None) -> Iterator[Any]:
        """One slice of all the phase's groups, waiting within ``timeout`` (else the
        Phases'): two groups not held yet are granted together (AcquireSet); from an
        orchestrator without it, one by one in the phase's order (trainer group first:
        one order for every job)."""
        if not entry.groups:
            return
        timeout = self._timeout if timeout is None else timeout
        wait = USE_CLIENT_DEFAULT if timeout is None else timeout
        client = self._client
        if isinstance(client, AsyncClient):
            yield AsyncSliceContext(client, groups=entry.groups, job=self._job, timeout=wait)
        else:
            yield SliceContext(client, groups=entry.groups, job=self._job, timeout=wait)


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
