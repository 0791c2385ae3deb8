"""``AsyncPhases``: :class:`~tslice.rl.Phases` over :class:`~tslice.AsyncClient`.

Same roles, groups, rules and no-op mode; ``begin``, ``end`` and ``close`` are
awaited and ``phase`` is an ``async with`` block. Use it inside one event loop.
A ``workload=`` is registered at construction and its acknowledgement awaited at
the first begin (or ``async with AsyncPhases(...)``), off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import MappingProxyType

from typing_extensions import Self

from tslice.client import USE_CLIENT_DEFAULT, AcquireResult, AsyncClient
from tslice.common import errors
from tslice.rl import _book, _workload, phases, roles


class AsyncPhases:
    """asyncio twin of :class:`~tslice.rl.Phases` (arguments as there)."""

    def __init__(
        self,
        *,
        job_id: str | None = None,
        address: str | None = None,
        trainer_group: str | None = "trainer",
        sampler_group: str | None = "sampler",
        role: roles.Role | str = roles.Role.COLOCATED,
        client: AsyncClient | None = None,
        timeout: float | None = None,
        workload: object | None = None,
        agent: str | None = None,
        register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
    ) -> None:
        if client is not None and address is not None:
            raise errors.ConfigError("pass either client= or address= to AsyncPhases, not both")
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self._owns_client = client is None
        self._client = (
            client
            if client is not None
            else AsyncClient(address, job_id=USE_CLIENT_DEFAULT if job_id is None else job_id)
        )
        self._timeout = timeout
        self._job = (job_id if job_id is not None else self._client.job_id) or ""
        self._book = _book.PhaseBook(
            role, trainer_group, sampler_group, enabled=self._client.enabled, job_id=self._job
        )
        self._register_timeout = register_timeout
        self._workloads: _workload.Registrations | None = None
        self._registered = False
        planned = _workload.plan(workload, self._book.role, self._book.pools)
        if planned and self.enabled:
            registrations = _workload.Registrations(
                agent=_workload.agent_address(agent), job_id=self._job, planned=planned
            )
            registrations.start()
            self._workloads = registrations

    @classmethod
    def from_env(
        cls,
        role: roles.Role | str | None = None,
        *,
        client: AsyncClient | None = None,
        timeout: float | None = None,
        workload: object | None = None,
        agent: str | None = None,
        register_timeout: float | None = _workload.DEFAULT_REGISTER_TIMEOUT_S,
    ) -> Self:
        """As :meth:`Phases.from_env`."""
        trainer, sampler = phases.env_groups()
        return cls(
            trainer_group=trainer,
            sampler_group=sampler,
            role=phases.env_role(role),
            client=client,
            timeout=timeout,
            workload=workload,
            agent=agent,
            register_timeout=register_timeout,
        )

    @property
    def enabled(self) -> bool:
        return self._client.enabled

    @property
    def role(self) -> roles.Role:
        return self._book.role

    @property
    def job_id(self) -> str:
        return self._job

    @property
    def client(self) -> AsyncClient:
        return self._client

    @property
    def trainer_group(self) -> str | None:
        return self._book.pools.get(roles.Pool.TRAINER)

    @property
    def sampler_group(self) -> str | None:
        return self._book.pools.get(roles.Pool.SAMPLER)

    @property
    def open_phases(self) -> tuple[roles.Phase, ...]:
        return self._book.open_phases()

    def groups_for(self, phase: roles.Phase | str) -> tuple[str, ...]:
        return self._book.groups_for(phase)

    async def wait_registered(self) -> None:
        """Wait (off the loop) until the agent acknowledged the workload; once."""
        if self._workloads is None or self._registered:
            return
        await asyncio.to_thread(self._workloads.wait, self._register_timeout)
        self._registered = True

    async def begin(
        self, phase: roles.Phase | str, *, timeout: float | None = None
    ) -> phases.Grants:
        entry = self._book.opening(phase, "this AsyncPhases")
        try:
            await self.wait_registered()
            grants = await self._take(entry, self._timeout if timeout is None else timeout)
        except BaseException:
            self._book.abandon(entry)
            raise
        if not self._book.opened(entry):
            await self._release(entry, None)
            raise roles.PhaseError(f"phase {entry.phase.value!r} began while closing")
        return grants

    async def end(self, phase: roles.Phase | str) -> None:
        await self._release(self._book.ending(phase), None)

    @contextlib.asynccontextmanager
    async def phase(
        self, phase: roles.Phase | str, *, timeout: float | None = None
    ) -> AsyncIterator[phases.Grants]:
        grants = await self.begin(phase, timeout=timeout)
        try:
            yield grants
        except BaseException as exc:
            with contextlib.suppress(roles.PhaseError):
                await self._release(self._book.ending(phase), exc)
            raise
        await self.end(phase)

    async def close(self) -> None:
        first: BaseException | None = None
        for entry in self._book.close():
            try:
                await self._release(entry, None)
            except Exception as exc:
                first = first or exc
        if self._workloads is not None:
            await asyncio.to_thread(self._workloads.close)
        if self._owns_client:
            await self._client.close()
        if first is not None:
            raise first

    async def __aenter__(self) -> Self:
        await self.wait_registered()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncPhases(job_id={self._job!r}, role={self.role.value!r}, "
            f"trainer_group={self.trainer_group!r}, sampler_group={self.sampler_group!r}, "
            f"enabled={self.enabled})"
        )

    async def _take(self, entry: _book.OpenPhase, timeout: float | None) -> phases.Grants:
        if not self.enabled:
            if not self._client.config.disabled_on_purpose:
                _book.announce_noop(self._client.config.noop_reason)
            return MappingProxyType(dict.fromkeys(entry.groups, phases._NOOP))
        deadline = None if timeout is None else time.monotonic() + timeout
        grants: dict[str, AcquireResult] = {}
        try:
            for group in entry.groups:
                wait = USE_CLIENT_DEFAULT if deadline is None else phases._left(deadline)
                hold = self._client.slice(group, job_id=self._job, timeout=wait)
                grants.update(await hold.__aenter__())
                entry.holds.append(hold)
        except BaseException as exc:
            await self._release(entry, exc)
            raise
        return MappingProxyType(grants)

    @staticmethod
    async def _release(entry: _book.OpenPhase, exc: BaseException | None) -> None:
        holds, entry.holds = entry.holds, []
        first: BaseException | None = None
        for hold in reversed(holds):
            try:
                await hold.__aexit__(type(exc) if exc else None, exc, None)
            except Exception as failure:
                first = first or failure
        if first is not None:
            raise first
