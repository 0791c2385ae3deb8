"""``AsyncClient``: the asyncio twin of :class:`~tslice.client.Client` (``grpc.aio``).

The method bodies differ from :mod:`tslice.client._client`'s only in ``await``; keep
the two side by side when editing (a parity test compares their public surfaces).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import (
    _admin,
    _base,
    _channel,
    _config,
    _events,
    _lease,
    _services,
    _slice,
    _types,
)
from tslice.common import errors

if TYPE_CHECKING:
    from typing_extensions import Self


class AsyncClient(_base.BaseClient[_lease.AsyncHoldKeeper]):
    """asyncio twin of :class:`Client` (``grpc.aio``; use it inside one event loop).

    ::

        async with tslice.AsyncClient() as client:
            async with client.slice("sampler"):
                await generate()
    """

    def _init_io(self) -> None:
        # Created on first use, inside the running loop the client will serve.
        self._calls: _services.AsyncOrchestratorCalls | None = None
        self._key_locks: dict[_base.HoldKey, asyncio.Lock] = {}

    def _orchestrator(self, what: str) -> _services.AsyncOrchestratorCalls:
        self._require_enabled(what)
        if self._calls is None:
            endpoint = self._endpoint()
            transport = _channel.AsyncTransport(endpoint.aio_channel(), endpoint)
            self._calls = _services.AsyncOrchestratorCalls(transport)
        return self._calls

    @property
    def orchestrator_stub(self) -> opb_grpc.TimeSliceOrchestratorServiceAsyncStub:
        """The raw generated stub on this client's aio channel (escape hatch; no retry)."""
        return self._orchestrator("use the raw stub").stub

    async def acquire(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        footprint_bytes: int | None = None,
    ) -> _types.AcquireResult:
        """See :meth:`Client.acquire`."""
        call = self._prepare_acquire(group, job_id, timeout, footprint_bytes)
        if call is None:
            return _base.NOOP_ACQUIRE
        calls = self._calls or self._orchestrator("acquire")
        try:
            response = await calls.acquire(call.request, call.options)
        except errors.DeadlineExceeded as err:
            raise self._timed_out(call) from err
        if response.success and self._lease_ms:
            replaced = self._keep(calls, call.job, call.group, response.grant_epoch)
            if replaced is not None:
                await replaced.stop()
        return self._acquired(response)

    async def acquire_set(
        self,
        groups: Iterable[str],
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        footprint_bytes: int | None = None,
    ) -> dict[str, _types.AcquireResult]:
        """See :meth:`Client.acquire_set`; a cancelled task leaves the job queued nowhere."""
        call = self._prepare_acquire_set(groups, job_id, timeout, footprint_bytes)
        if call.answer is not None:
            return call.answer
        with self._acquire_set_errors(call):
            response = await self._orchestrator("acquire a set of groups").acquire_set(
                call.request, call.options
            )
        results = self._set_results(call, response)
        if self._lease_ms:
            calls = self._orchestrator("hold")
            for group, result in results.items():
                replaced = self._keep(calls, call.job, group, result.grant_epoch)
                if replaced is not None:
                    await replaced.stop()
        return results

    async def yield_(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _types.YieldResult:
        """See :meth:`Client.yield_`."""
        call = self._prepare_yield(group, job_id, timeout)
        if call.answer is not None:
            if call.keeper is not None:
                await call.keeper.stop()
            return call.answer
        calls = self._calls or self._orchestrator("yield")
        try:
            response = await calls.yield_(call.request, call.options)
        except BaseException:
            call.failed()
            raise
        keeper = self._leases.pop((call.job, call.group))
        if keeper is not None:
            await keeper.stop()
        return self._yielded(response)

    release = yield_

    async def status(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _types.GroupStatus:
        """See :meth:`Client.status`."""
        calls = self._orchestrator("read a group's status")
        response = await calls.get_group_status(*self._status_request(group, timeout))
        return _types.group_status(response)

    async def list_groups(
        self, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> tuple[str, ...]:
        """See :meth:`Client.list_groups`."""
        calls = self._orchestrator("list groups")
        return tuple((await calls.list_groups(*self._list_request(timeout))).group_ids)

    async def clear_degraded(
        self,
        group: str | None = None,
        *,
        node: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> tuple[str, ...]:
        """See :meth:`Client.clear_degraded`."""
        calls = self._orchestrator("clear a degraded node")
        response = await calls.clear_degraded(*self._clear_degraded_request(group, node, timeout))
        return tuple(response.cleared)

    async def evict(
        self,
        group: str | None,
        job: str,
        *,
        reason: str = "",
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> tuple[_admin.Eviction, ...]:
        """See :meth:`Client.evict`."""
        calls = self._orchestrator("evict a job")
        request = self._evict_request(group, job, reason, timeout)
        return _admin.evictions(await calls.evict(*request))

    async def drain(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _admin.DrainState:
        """See :meth:`Client.drain`."""
        calls = self._orchestrator("drain a group")
        return _admin.drain_state(await calls.drain(*self._drain_request(group, True, timeout)))

    async def resume(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _admin.DrainState:
        """See :meth:`Client.resume`."""
        calls = self._orchestrator("resume a group")
        return _admin.drain_state(await calls.drain(*self._drain_request(group, False, timeout)))

    def watch_events(
        self,
        group: str | None = None,
        *,
        kinds: Iterable[_types.EventKind] = (),
        timeout: float | None = None,
        stored: _types.StoredEvents | None = None,
    ) -> _events.EventStream:
        """See :meth:`Client.watch_events`; ``await events.started()`` returns once the
        orchestrator has subscribed the stream, ``aclose()`` ends it."""
        calls = self._orchestrator("watch events")
        request = self._watch_request(group, kinds, timeout, stored)
        return _events.EventStream(calls.watch_events(*request))

    def slice(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.AsyncSliceContext:
        """See :meth:`Client.slice` (one AcquireSet for its groups); use with ``async with``."""
        return _slice.AsyncSliceContext(
            self, groups=self._slice_groups(groups), job=self._job(job_id), timeout=timeout
        )

    #: The decorator spelling of :meth:`slice`, for coroutine functions.
    sliced = slice

    async def close(self) -> None:
        """Close the channel; idempotent. Groups still held stay held (yield first)
        until their lease runs out."""
        self._closed = True
        for keeper in self._leases.pop_all():
            await keeper.stop()
        calls, self._calls = self._calls, None
        if calls is not None:
            await calls.close()
            await calls.transport.channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncClient(address={self.address!r}, job_id={self.job_id!r}, enabled={self.enabled})"
        )

    # -- leases ----------------------------------------------------------------------------

    def _keep(
        self, calls: _services.AsyncOrchestratorCalls, job: str, group: str, epoch: int
    ) -> _lease.AsyncHoldKeeper | None:
        """Hold the lease of a new grant from a task; returns the keeper it replaces
        (to stop)."""
        options = _channel.CallOptions(job_id=job, group_id=group)
        keeper = _lease.AsyncHoldKeeper(
            self._lease(job, group, epoch), hold=lambda request: calls.hold(request, options)
        )
        return self._leases.swap((job, group), keeper)

    # -- slice plumbing (called by AsyncSliceContext) -------------------------------

    def _key_lock(self, key: _base.HoldKey) -> asyncio.Lock:
        return self._key_locks.setdefault(key, asyncio.Lock())

    async def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]:
        if self._noop():
            return dict.fromkeys(groups, _base.NOOP_ACQUIRE)
        clock = self._slice_clock(timeout)
        results: dict[str, _types.AcquireResult] = {}
        try:
            rest = groups
            if self._holds.wants_set(groups):
                rest = await self._hold_set(groups, job, clock, results)
            for group in rest:
                results[group] = await self._hold(job, group, clock)
        except BaseException:
            await self._exit_slice(tuple(results), job, raise_errors=False)
            raise
        return {group: results[group] for group in groups}

    async def _hold_set(
        self,
        groups: tuple[str, ...],
        job: str,
        clock: _slice.SliceClock,
        results: dict[str, _types.AcquireResult],
    ) -> tuple[str, ...]:
        """See :meth:`Client._hold_set`."""
        async with contextlib.AsyncExitStack() as locked:
            for group in sorted(groups):
                await locked.enter_async_context(self._key_lock((job, group)))
            wanted = self._holds.join(groups, job, results)
            if len(wanted) < 2:
                return wanted
            wait = clock.remaining(job=job, group=",".join(wanted))
            try:
                granted = await self.acquire_set(wanted, job_id=job, timeout=wait)
            except errors.RPCError as err:
                if not self._holds.set_refused(err):
                    raise
                return wanted
            self._holds.record_set(job, granted, results)
            return ()

    async def _hold(self, job: str, group: str, clock: _slice.SliceClock) -> _types.AcquireResult:
        key = (job, group)
        async with self._key_lock(key):
            held = self._holds.held(key)
            if held is None:
                wait = clock.remaining(job=job, group=group)
                held = await self.acquire(group, job_id=job, timeout=wait)
                self._holds.record(key, held)
            return held

    async def _exit_slice(self, groups: tuple[str, ...], job: str, *, raise_errors: bool) -> None:
        if not self.enabled:
            return
        # Shielded: a slice left because its task was cancelled must still yield, or
        # the job would keep the group while doing nothing with it.
        failures = await asyncio.shield(self._release(groups, job))
        _slice.released(failures, job, raise_errors=raise_errors)

    async def _release(self, groups: tuple[str, ...], job: str) -> list[tuple[str, BaseException]]:
        failures: list[tuple[str, BaseException]] = []
        for group in reversed(groups):
            key = (job, group)
            async with self._key_lock(key):
                if not self._holds.drop(key):
                    continue
                try:
                    await self.yield_(group, job_id=job)
                except Exception as exc:
                    failures.append((group, exc))
        return failures
