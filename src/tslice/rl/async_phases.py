"""``AsyncPhases``: :class:`~tslice.rl.Phases` over :class:`~tslice.AsyncClient`.

Same arguments, roles, groups, rules and no-op mode; ``begin``, ``end`` and
``close`` are awaited and ``phase`` is an ``async with`` block. Use it inside one
event loop. A ``workload=`` is registered at construction and its acknowledgement
awaited at the first begin (or ``async with AsyncPhases(...)``), off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import TYPE_CHECKING

from tslice.client import USE_CLIENT_DEFAULT, AcquireResult, AsyncClient
from tslice.rl import _base, _book, roles
from tslice.rl._base import Grants

if TYPE_CHECKING:
    from typing_extensions import Self


class AsyncPhases(_base.PhasesBase[AsyncClient]):
    """asyncio twin of :class:`~tslice.rl.Phases` (arguments as there)."""

    _registered = False

    def _connect(self, address: str | None, job_id: str | None) -> AsyncClient:
        return AsyncClient(address, job_id=USE_CLIENT_DEFAULT if job_id is None else job_id)

    async def wait_registered(self) -> None:
        """Wait (off the loop) until the agent acknowledged the workload; once."""
        if self._workloads is None or self._registered:
            return
        await asyncio.to_thread(self._workloads.wait, self._register_timeout)
        self._registered = True

    async def begin(self, phase: roles.Phase | str, *, timeout: float | None = None) -> Grants:
        entry = self._opening(phase)
        try:
            await self.wait_registered()
            grants = await self._take(entry, timeout)
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
    ) -> AsyncIterator[Grants]:
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

    async def _take(self, entry: _book.OpenPhase, timeout: float | None) -> Grants:
        if not self.enabled:
            return self._noop_grants(entry)
        grants: dict[str, AcquireResult] = {}
        try:
            for hold in self._slices(entry, timeout):
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
