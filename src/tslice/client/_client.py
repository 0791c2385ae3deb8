"""``Client`` (blocking, ``grpc.Channel``) and ``AsyncClient`` (``grpc.aio``).

Both keep their logic in :class:`~tslice.client._base.BaseClient`; the method
bodies below differ only in ``await``. Keep them side by side when editing: a
parity test compares their public surfaces.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Iterator, Sequence
from types import TracebackType

import grpc
import grpc.aio
from typing_extensions import Self

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2_grpc as opb_grpc
from tslice.client import _base, _channel, _config, _lease, _retry, _services, _slice, _types
from tslice.common import errors


class Client(_base.BaseClient):
    """Blocking client of the tslice orchestrator.

    ::

        client = tslice.Client()             # address and job id from the environment
        with client.slice("trainer"):        # acquire ... yield, also on exceptions
            train_step()

    With no orchestrator configured (no ``address``, no ``$TSLICE_ORCHESTRATOR``)
    or with ``TSLICE_DISABLED=1`` the client is a no-op: ``acquire`` and
    ``yield_`` return success at once, so the same script runs without the
    platform. ``UNAVAILABLE`` (orchestrator restarting) is retried transparently
    until the call's deadline.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        job_id: _config.JobId = _config.USE_CLIENT_DEFAULT,
        default_group: str | None = None,
        timeout: float | None = None,
        call_timeout: float = _config.DEFAULT_CALL_TIMEOUT_S,
        channel_options: Sequence[_channel.ChannelOption] | None = None,
        footprint_bytes: int | None = None,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        lease_s: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        connect_timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> None:
        super().__init__(
            address,
            job_id=job_id,
            default_group=default_group,
            timeout=timeout,
            call_timeout=call_timeout,
            channel_options=channel_options,
            footprint_bytes=footprint_bytes,
            retry=retry,
            lease_s=lease_s,
            connect_timeout=connect_timeout,
        )
        self._channel: grpc.Channel | None = None
        self._calls: _services.OrchestratorCalls | None = None
        self._guard = threading.Lock()
        self._key_locks: dict[_base.HoldKey, threading.Lock] = {}
        self._keepers: dict[_base.HoldKey, _lease.HoldKeeper] = {}

    def _orchestrator(self, what: str) -> _services.OrchestratorCalls:
        self._require_enabled(what)
        with self._guard:
            if self._calls is None:
                assert self._config.address is not None
                self._channel = grpc.insecure_channel(
                    self._config.address,
                    options=_channel.channel_options(self._config.channel_options),
                )
                self._calls = _services.OrchestratorCalls(
                    _channel.SyncTransport(
                        self._channel,
                        target=self._config.address,
                        retry=self._config.retry,
                        connect_timeout=self._config.connect_timeout,
                        peer="the orchestrator",
                    )
                )
            return self._calls

    @property
    def orchestrator_stub(self) -> opb_grpc.TimeSliceOrchestratorServiceStub:
        """The raw generated stub on this client's channel (escape hatch; no retry)."""
        return self._orchestrator("use the raw stub").stub

    def acquire(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        footprint_bytes: int | None = None,
    ) -> _types.AcquireResult:
        """Block until the job holds ``group`` and its state is resident on every node.

        ``timeout`` (seconds; ``None`` = wait as long as it takes) raises
        :class:`~tslice.common.errors.AcquireTimeout` on expiry, and the job leaves the
        queue. UNAVAILABLE is retried with back-off until the deadline.
        """
        job, group_id = self._job(job_id), self._group(group)
        request = self._acquire_request(job, group_id, footprint_bytes)
        wait = self._acquire_timeout(timeout)
        if self._noop():
            return _base.NOOP_ACQUIRE
        started = time.monotonic()
        try:
            response = self._orchestrator("acquire").acquire(
                request, self._options(job, group_id, wait)
            )
        except errors.DeadlineExceeded as err:
            raise self._acquire_timed_out(err, job=job, group=group_id, started=started) from err
        if response.success and self._lease_ms:
            self._keep(job, group_id, response.grant_epoch)
        return _types.acquire_result(response)

    def yield_(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _types.YieldResult:
        """Release ``group``; returns at once (the switch, if any, happens later)."""
        job, group_id = self._job(job_id), self._group(group)
        request = self._yield_request(job, group_id)
        wait = self._call_timeout(timeout)
        if not self.enabled:
            return _base.NOOP_YIELD
        if self._was_lost(group_id):
            self._unkeep(job, group_id)
            return self._lost_yield()
        with self._guard:
            keeper = self._keepers.get((job, group_id))
        if keeper is not None:
            keeper.releasing()
        try:
            response = self._orchestrator("yield").yield_(
                request, self._options(job, group_id, wait)
            )
        except BaseException:
            if keeper is not None:
                keeper.resume()
            raise
        self._unkeep(job, group_id)
        return _types.yield_result(response)

    release = yield_

    def status(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _types.GroupStatus:
        """Lock, queue and residency of ``group``."""
        calls = self._orchestrator("read a group's status")
        group_id = self._group(group)
        response = calls.get_group_status(
            opb.GetGroupStatusRequest(group_id=group_id),
            self._options(self.job_id, group_id, self._call_timeout(timeout)),
        )
        return _types.group_status(response)

    def list_groups(
        self, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> tuple[str, ...]:
        """Ids of the groups the orchestrator knows."""
        calls = self._orchestrator("list groups")
        response = calls.list_groups(
            opb.ListGroupsRequest(), self._options(self.job_id, None, self._call_timeout(timeout))
        )
        return tuple(response.group_ids)

    def watch_events(
        self,
        group: str | None = None,
        *,
        kinds: Iterable[_types.EventKind] = (),
        timeout: float | None = None,
    ) -> Iterator[_types.OrchestratorEvent]:
        """Stream orchestrator events (of ``group``, or of every group when ``None``;
        only ``kinds`` when given, filtered by the server).

        Close the returned generator to end the stream. Not retried: a stream cut by
        an orchestrator restart ends with :class:`~tslice.common.errors.Unavailable`.
        """
        calls = self._orchestrator("watch events")
        group_id = "" if group is None else self._group(group)
        stream = calls.watch_events(
            opb.WatchEventsRequest(group_id=group_id, kinds=_types.event_kinds(kinds)),
            self._options(self.job_id, group_id, _config.check_timeout("timeout", timeout)),
        )
        stream.started()  # subscribed: no event published from here on is missed
        return _events(stream)

    def slice(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.SliceContext:
        """Hold ``groups`` (default: the default group) for a ``with`` block or a call.

        Groups are acquired in sorted order, whatever order they are given in, so that
        two jobs taking the same two groups cannot deadlock; they are yielded in
        reverse order on exit, also when the block raises. ``timeout`` bounds the
        acquisition of all of them together.
        """
        return _slice.SliceContext(
            self, groups=self._slice_groups(groups), job=self._job(job_id), timeout=timeout
        )

    def sliced(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.SliceContext:
        """Decorator form of :meth:`slice`: ``@client.sliced("trainer")``."""
        return self.slice(*groups, job_id=job_id, timeout=timeout)

    def close(self) -> None:
        """Close the channel; idempotent. Groups still held stay held (yield first)
        until their lease runs out."""
        self._closed = True
        with self._guard:
            keepers, self._keepers = list(self._keepers.values()), {}
        for keeper in keepers:
            keeper.stop()
        with self._guard:
            channel, calls, self._channel, self._calls = self._channel, self._calls, None, None
        if calls is not None:
            calls.close()
        if channel is not None:
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(address={self.address!r}, job_id={self.job_id!r}, enabled={self.enabled})"

    # -- leases ----------------------------------------------------------------------------

    def _keep(self, job: str, group: str, epoch: int) -> None:
        """Hold the lease of a new grant from a daemon thread (replaces an older keeper)."""
        self._forget_lost(group)
        calls, options = self._orchestrator("hold"), self._options(job, group, None)
        keeper = _lease.HoldKeeper(
            hold=lambda request: calls.hold(request, options),
            job=job,
            group=group,
            epoch=epoch,
            lease_ms=self._lease_ms,
            on_lost=lambda reason: self._lease_lost(job, group, reason),
        )
        with self._guard:
            old = self._keepers.get((job, group))
            self._keepers[(job, group)] = keeper
        if old is not None:
            old.stop()

    def _unkeep(self, job: str, group: str) -> None:
        with self._guard:
            keeper = self._keepers.pop((job, group), None)
        if keeper is not None:
            keeper.stop()

    # -- slice plumbing (called by SliceContext) ------------------------------------

    def _key_lock(self, key: _base.HoldKey) -> threading.Lock:
        with self._guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]:
        if self._noop():
            return dict.fromkeys(groups, _base.NOOP_ACQUIRE)
        started = time.monotonic()
        deadline = self._deadline(self._acquire_timeout(timeout))
        results: dict[str, _types.AcquireResult] = {}
        try:
            for group in groups:
                results[group] = self._hold(job, group, deadline, started)
        except BaseException:
            self._exit_slice(tuple(results), job, raise_errors=False)
            raise
        return results

    def _hold(
        self, job: str, group: str, deadline: float | None, started: float
    ) -> _types.AcquireResult:
        key = (job, group)
        # Serialises acquire/yield transitions of one (job, group) across threads, so
        # a slice never runs while another thread's exit is yielding the same group.
        with self._key_lock(key):
            held = self._held(key)
            if held is not None:
                return held
            wait = self._remaining(deadline, job=job, group=group, started=started)
            result = self.acquire(group, job_id=job, timeout=wait)
            self._check_granted(result, job=job, group=group)
            self._record_hold(key, result)
            return result

    def _exit_slice(self, groups: tuple[str, ...], job: str, *, raise_errors: bool) -> None:
        if not self.enabled:
            return
        failures: list[tuple[str, BaseException]] = []
        for group in reversed(groups):
            key = (job, group)
            with self._key_lock(key):
                if not self._drop_hold(key):
                    continue
                try:
                    self.yield_(group, job_id=job)
                except Exception as exc:
                    failures.append((group, exc))
        if failures and raise_errors:
            self._report_release_failures(failures[1:], job)
            raise failures[0][1]
        self._report_release_failures(failures, job)


def _events(
    stream: _channel.SyncStream[opb.OrchestratorEvent],
) -> Iterator[_types.OrchestratorEvent]:
    try:
        for message in stream:
            yield _types.orchestrator_event(message)
    finally:
        stream.cancel()


class AsyncClient(_base.BaseClient):
    """asyncio twin of :class:`Client` (``grpc.aio``; use it inside one event loop).

    ::

        async with tslice.AsyncClient() as client:
            async with client.slice("sampler"):
                await generate()
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        job_id: _config.JobId = _config.USE_CLIENT_DEFAULT,
        default_group: str | None = None,
        timeout: float | None = None,
        call_timeout: float = _config.DEFAULT_CALL_TIMEOUT_S,
        channel_options: Sequence[_channel.ChannelOption] | None = None,
        footprint_bytes: int | None = None,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        lease_s: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        connect_timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> None:
        super().__init__(
            address,
            job_id=job_id,
            default_group=default_group,
            timeout=timeout,
            call_timeout=call_timeout,
            channel_options=channel_options,
            footprint_bytes=footprint_bytes,
            retry=retry,
            lease_s=lease_s,
            connect_timeout=connect_timeout,
        )
        # Created on first use, inside the running loop the client will serve.
        self._channel: grpc.aio.Channel | None = None
        self._calls: _services.AsyncOrchestratorCalls | None = None
        self._key_locks: dict[_base.HoldKey, asyncio.Lock] = {}
        self._keepers: dict[_base.HoldKey, _lease.AsyncHoldKeeper] = {}

    def _orchestrator(self, what: str) -> _services.AsyncOrchestratorCalls:
        self._require_enabled(what)
        if self._calls is None:
            assert self._config.address is not None
            self._channel = grpc.aio.insecure_channel(
                self._config.address,
                options=_channel.channel_options(self._config.channel_options),
            )
            self._calls = _services.AsyncOrchestratorCalls(
                _channel.AsyncTransport(
                    self._channel,
                    target=self._config.address,
                    retry=self._config.retry,
                    connect_timeout=self._config.connect_timeout,
                    peer="the orchestrator",
                )
            )
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
        job, group_id = self._job(job_id), self._group(group)
        request = self._acquire_request(job, group_id, footprint_bytes)
        wait = self._acquire_timeout(timeout)
        if self._noop():
            return _base.NOOP_ACQUIRE
        started = time.monotonic()
        try:
            response = await self._orchestrator("acquire").acquire(
                request, self._options(job, group_id, wait)
            )
        except errors.DeadlineExceeded as err:
            raise self._acquire_timed_out(err, job=job, group=group_id, started=started) from err
        if response.success and self._lease_ms:
            await self._keep(job, group_id, response.grant_epoch)
        return _types.acquire_result(response)

    async def yield_(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _types.YieldResult:
        """See :meth:`Client.yield_`."""
        job, group_id = self._job(job_id), self._group(group)
        request = self._yield_request(job, group_id)
        wait = self._call_timeout(timeout)
        if not self.enabled:
            return _base.NOOP_YIELD
        if self._was_lost(group_id):
            await self._unkeep(job, group_id)
            return self._lost_yield()
        keeper = self._keepers.get((job, group_id))
        if keeper is not None:
            keeper.releasing()
        try:
            response = await self._orchestrator("yield").yield_(
                request, self._options(job, group_id, wait)
            )
        except BaseException:
            if keeper is not None:
                keeper.resume()
            raise
        await self._unkeep(job, group_id)
        return _types.yield_result(response)

    release = yield_

    async def status(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _types.GroupStatus:
        """See :meth:`Client.status`."""
        calls = self._orchestrator("read a group's status")
        group_id = self._group(group)
        response = await calls.get_group_status(
            opb.GetGroupStatusRequest(group_id=group_id),
            self._options(self.job_id, group_id, self._call_timeout(timeout)),
        )
        return _types.group_status(response)

    async def list_groups(
        self, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> tuple[str, ...]:
        """See :meth:`Client.list_groups`."""
        calls = self._orchestrator("list groups")
        response = await calls.list_groups(
            opb.ListGroupsRequest(), self._options(self.job_id, None, self._call_timeout(timeout))
        )
        return tuple(response.group_ids)

    def watch_events(
        self,
        group: str | None = None,
        *,
        kinds: Iterable[_types.EventKind] = (),
        timeout: float | None = None,
    ) -> EventStream:
        """See :meth:`Client.watch_events`; ``await events.started()`` returns once the
        orchestrator has subscribed the stream, ``aclose()`` ends it."""
        calls = self._orchestrator("watch events")
        group_id = "" if group is None else self._group(group)
        stream = calls.watch_events(
            opb.WatchEventsRequest(group_id=group_id, kinds=_types.event_kinds(kinds)),
            self._options(self.job_id, group_id, _config.check_timeout("timeout", timeout)),
        )
        return EventStream(stream)

    def slice(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.AsyncSliceContext:
        """See :meth:`Client.slice`; use with ``async with``."""
        return _slice.AsyncSliceContext(
            self, groups=self._slice_groups(groups), job=self._job(job_id), timeout=timeout
        )

    def sliced(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.AsyncSliceContext:
        """Decorator form of :meth:`slice` for coroutine functions."""
        return self.slice(*groups, job_id=job_id, timeout=timeout)

    async def close(self) -> None:
        """Close the channel; idempotent. Groups still held stay held (yield first)
        until their lease runs out."""
        self._closed = True
        keepers, self._keepers = list(self._keepers.values()), {}
        for keeper in keepers:
            await keeper.stop()
        channel, calls, self._channel, self._calls = self._channel, self._calls, None, None
        if calls is not None:
            await calls.close()
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncClient(address={self.address!r}, job_id={self.job_id!r}, enabled={self.enabled})"
        )

    # -- leases ----------------------------------------------------------------------------

    async def _keep(self, job: str, group: str, epoch: int) -> None:
        """Hold the lease of a new grant from a task (replaces an older keeper)."""
        self._forget_lost(group)
        calls, options = self._orchestrator("hold"), self._options(job, group, None)
        keeper = _lease.AsyncHoldKeeper(
            hold=lambda request: calls.hold(request, options),
            job=job,
            group=group,
            epoch=epoch,
            lease_ms=self._lease_ms,
            on_lost=lambda reason: self._lease_lost(job, group, reason),
        )
        old = self._keepers.get((job, group))
        self._keepers[(job, group)] = keeper
        if old is not None:
            await old.stop()

    async def _unkeep(self, job: str, group: str) -> None:
        keeper = self._keepers.pop((job, group), None)
        if keeper is not None:
            await keeper.stop()

    # -- slice plumbing (called by AsyncSliceContext) -------------------------------

    def _key_lock(self, key: _base.HoldKey) -> asyncio.Lock:
        return self._key_locks.setdefault(key, asyncio.Lock())

    async def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]:
        if self._noop():
            return dict.fromkeys(groups, _base.NOOP_ACQUIRE)
        started = time.monotonic()
        deadline = self._deadline(self._acquire_timeout(timeout))
        results: dict[str, _types.AcquireResult] = {}
        try:
            for group in groups:
                results[group] = await self._hold(job, group, deadline, started)
        except BaseException:
            await self._exit_slice(tuple(results), job, raise_errors=False)
            raise
        return results

    async def _hold(
        self, job: str, group: str, deadline: float | None, started: float
    ) -> _types.AcquireResult:
        key = (job, group)
        async with self._key_lock(key):
            held = self._held(key)
            if held is not None:
                return held
            wait = self._remaining(deadline, job=job, group=group, started=started)
            result = await self.acquire(group, job_id=job, timeout=wait)
            self._check_granted(result, job=job, group=group)
            self._record_hold(key, result)
            return result

    async def _exit_slice(self, groups: tuple[str, ...], job: str, *, raise_errors: bool) -> None:
        if not self.enabled:
            return
        # Shielded: a slice left because its task was cancelled must still yield, or
        # the job would keep the group while doing nothing with it.
        failures = await asyncio.shield(self._release(groups, job))
        if failures and raise_errors:
            self._report_release_failures(failures[1:], job)
            raise failures[0][1]
        self._report_release_failures(failures, job)

    async def _release(self, groups: tuple[str, ...], job: str) -> list[tuple[str, BaseException]]:
        failures: list[tuple[str, BaseException]] = []
        for group in reversed(groups):
            key = (job, group)
            async with self._key_lock(key):
                if not self._drop_hold(key):
                    continue
                try:
                    await self.yield_(group, job_id=job)
                except Exception as exc:
                    failures.append((group, exc))
        return failures


async def _async_events(
    stream: _channel.AsyncStream[opb.OrchestratorEvent],
) -> AsyncGenerator[_types.OrchestratorEvent, None]:
    try:
        async for message in stream:
            yield _types.orchestrator_event(message)
    finally:
        stream.cancel()


class EventStream(AsyncIterator[_types.OrchestratorEvent]):
    """Events of :meth:`AsyncClient.watch_events`, for ``async for``."""

    def __init__(self, stream: _channel.AsyncStream[opb.OrchestratorEvent]) -> None:
        self._stream = stream
        self._events = _async_events(stream)

    async def started(self) -> None:
        """Return once the orchestrator has subscribed this stream: no event published
        after that is missed."""
        await self._stream.started()

    async def __anext__(self) -> _types.OrchestratorEvent:
        return await self._events.__anext__()

    async def aclose(self) -> None:
        """End the stream."""
        self._stream.cancel()
        await self._events.aclose()
