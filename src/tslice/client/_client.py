"""``Client``: the blocking client (``grpc.Channel``, no event loop).

Its logic lives in :class:`~tslice.client._base.BaseClient`; the method bodies here
and in :mod:`tslice.client._async_client` differ only in ``await``. Keep them side by
side when editing: a parity test compares their public surfaces.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
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


class Client(_base.BaseClient[_lease.HoldKeeper]):
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

    def _init_io(self) -> None:
        self._calls: _services.OrchestratorCalls | None = None
        self._key_locks: dict[_base.HoldKey, threading.Lock] = {}

    def _orchestrator(self, what: str) -> _services.OrchestratorCalls:
        self._require_enabled(what)
        with self._guard:
            if self._calls is None:
                endpoint = self._endpoint()
                transport = _channel.SyncTransport(endpoint.channel(), endpoint)
                self._calls = _services.OrchestratorCalls(transport)
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
        call = self._prepare_acquire(group, job_id, timeout, footprint_bytes)
        if call is None:
            return _base.NOOP_ACQUIRE
        calls = self._calls or self._orchestrator("acquire")
        try:
            response = calls.acquire(call.request, call.options)
        except errors.DeadlineExceeded as err:
            raise self._timed_out(call) from err
        if response.success and self._lease_ms:
            replaced = self._keep(calls, call.job, call.group, response.grant_epoch)
            if replaced is not None:
                replaced.stop()
        return self._acquired(response)

    def acquire_set(
        self,
        groups: Iterable[str],
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        footprint_bytes: int | None = None,
    ) -> dict[str, _types.AcquireResult]:
        """Block until the job holds every group of ``groups`` (a collection of ids),
        granted all or nothing; returns group -> :class:`AcquireResult` in their order.

        The job holds no group of the set while another one still waits, so two jobs
        that want overlapping sets cannot each hold part of one (no lock order needed);
        the set is granted once every group is free, and the switches of all of them
        run at once. Groups the job holds already count as granted. After the grant
        each group is an ordinary one: its own lease (Hold stream), its own
        :meth:`yield_`. ``timeout`` and errors as for :meth:`acquire`: on expiry,
        failure or Ctrl-C the job is queued nowhere, and a group granted for the set
        meanwhile is yielded again (never one held before). While the set waits for a
        busy group, a free group of it may be kept free for it (a single Acquire of that
        group then waits). An orchestrator without the RPC (llm-d's, an older tslice)
        raises :class:`~tslice.common.errors.RPCError` ``UNIMPLEMENTED``;
        :meth:`slice` falls back by itself.
        """
        call = self._prepare_acquire_set(groups, job_id, timeout, footprint_bytes)
        if call.answer is not None:
            return call.answer
        with self._acquire_set_errors(call):
            response = self._orchestrator("acquire a set of groups").acquire_set(
                call.request, call.options
            )
        results = self._set_results(call, response)
        if self._lease_ms:
            calls = self._orchestrator("hold")
            for group, result in results.items():
                replaced = self._keep(calls, call.job, group, result.grant_epoch)
                if replaced is not None:
                    replaced.stop()
        return results

    def yield_(
        self,
        group: str | None = None,
        *,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _types.YieldResult:
        """Release ``group``; returns at once (the switch, if any, happens later)."""
        call = self._prepare_yield(group, job_id, timeout)
        if call.answer is not None:
            if call.keeper is not None:
                call.keeper.stop()
            return call.answer
        calls = self._calls or self._orchestrator("yield")
        try:
            response = calls.yield_(call.request, call.options)
        except BaseException:
            call.failed()
            raise
        keeper = self._leases.pop((call.job, call.group))
        if keeper is not None:
            keeper.stop()
        return self._yielded(response)

    release = yield_

    def status(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _types.GroupStatus:
        """Lock, queue, residency and degraded nodes of ``group``."""
        calls = self._orchestrator("read a group's status")
        return _types.group_status(calls.get_group_status(*self._status_request(group, timeout)))

    def list_groups(
        self, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> tuple[str, ...]:
        """Ids of the groups the orchestrator knows."""
        calls = self._orchestrator("list groups")
        return tuple(calls.list_groups(*self._list_request(timeout)).group_ids)

    def clear_degraded(
        self,
        group: str | None = None,
        *,
        node: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> tuple[str, ...]:
        """Operator: ``node`` of ``group`` (every degraded node of it when ``None``) takes
        switches again once the cause is fixed; returns the nodes that were cleared.

        A node not in the group is :class:`~tslice.common.errors.NotFound`.
        """
        calls = self._orchestrator("clear a degraded node")
        response = calls.clear_degraded(*self._clear_degraded_request(group, node, timeout))
        return tuple(response.cleared)

    def evict(
        self,
        group: str | None,
        job: str,
        *,
        reason: str = "",
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> tuple[_admin.Eviction, ...]:
        """Administrator: take ``job`` out of ``group`` now (``None``: the client's group;
        ``""``: every group where it holds or waits). A holder loses the lock (the group
        moves on to its next waiter), a waiter's pending Acquire ends ABORTED with
        ``reason``. One :class:`Eviction` per group it was taken out of.

        A job that neither holds nor waits is :class:`~tslice.common.errors.NotFound`.
        """
        calls = self._orchestrator("evict a job")
        return _admin.evictions(calls.evict(*self._evict_request(group, job, reason, timeout)))

    def drain(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _admin.DrainState:
        """Administrator: ``group`` grants no new turn (its holder keeps its own until it
        yields, waiters stay queued) until :meth:`resume`; survives a restart."""
        calls = self._orchestrator("drain a group")
        return _admin.drain_state(calls.drain(*self._drain_request(group, True, timeout)))

    def resume(
        self, group: str | None = None, *, timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT
    ) -> _admin.DrainState:
        """Administrator: a drained ``group`` grants turns again (the head of its queue)."""
        calls = self._orchestrator("resume a group")
        return _admin.drain_state(calls.drain(*self._drain_request(group, False, timeout)))

    def watch_events(
        self,
        group: str | None = None,
        *,
        kinds: Iterable[_types.EventKind] = (),
        timeout: float | None = None,
        stored: _types.StoredEvents | None = None,
    ) -> Iterator[_types.OrchestratorEvent]:
        """Stream orchestrator events (of ``group``, or of every group when ``None``;
        only ``kinds`` when given, filtered by the server). With ``stored``, the
        orchestrator's event history from ``stored.since`` comes first, oldest first,
        then the live events without a gap (unless ``stored`` says to stop there).

        Close the returned generator to end the stream. Not retried: a stream cut by
        an orchestrator restart ends with :class:`~tslice.common.errors.Unavailable`.
        """
        calls = self._orchestrator("watch events")
        stream = calls.watch_events(*self._watch_request(group, kinds, timeout, stored))
        stream.started()  # subscribed: no event published from here on is missed
        return _events.events(stream)

    def slice(
        self,
        *groups: str,
        job_id: str | None = None,
        timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
    ) -> _slice.SliceContext:
        """Hold ``groups`` (default: the default group) for a ``with`` block or a call.

        Two or more groups not held yet by an open slice of this client and job are
        taken in one :meth:`acquire_set` (all or nothing); from an orchestrator without
        it, one by one in sorted order, whatever order they are given in, so that two
        jobs taking the same two groups cannot deadlock (the client remembers and does
        not ask again). They are yielded in reverse order on exit, also when the block
        raises. ``timeout`` bounds the acquisition of all of them together.
        """
        return _slice.SliceContext(
            self, groups=self._slice_groups(groups), job=self._job(job_id), timeout=timeout
        )

    #: The decorator spelling of :meth:`slice`: ``@client.sliced("trainer")``.
    sliced = slice

    def close(self) -> None:
        """Close the channel; idempotent. Groups still held stay held (yield first)
        until their lease runs out."""
        self._closed = True
        for keeper in self._leases.pop_all():
            keeper.stop()
        with self._guard:
            calls, self._calls = self._calls, None
        if calls is not None:
            calls.close()
            calls.transport.channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client(address={self.address!r}, job_id={self.job_id!r}, enabled={self.enabled})"

    # -- leases ----------------------------------------------------------------------------

    def _keep(
        self, calls: _services.OrchestratorCalls, job: str, group: str, epoch: int
    ) -> _lease.HoldKeeper | None:
        """Hold the lease of a new grant from a daemon thread; returns the keeper it replaces
        (to stop)."""
        options = _channel.CallOptions(job_id=job, group_id=group)
        keeper = _lease.HoldKeeper(
            self._lease(job, group, epoch), hold=lambda request: calls.hold(request, options)
        )
        return self._leases.swap((job, group), keeper)

    # -- slice plumbing (called by SliceContext) ------------------------------------

    def _key_lock(self, key: _base.HoldKey) -> threading.Lock:
        with self._guard:
            return self._key_locks.setdefault(key, threading.Lock())

    def _enter_slice(
        self, groups: tuple[str, ...], job: str, timeout: _config.Timeout
    ) -> dict[str, _types.AcquireResult]:
        if self._noop():
            return dict.fromkeys(groups, _base.NOOP_ACQUIRE)
        clock = self._slice_clock(timeout)
        results: dict[str, _types.AcquireResult] = {}
        try:
            rest = groups
            if self._holds.wants_set(groups):
                rest = self._hold_set(groups, job, clock, results)
            for group in rest:
                results[group] = self._hold(job, group, clock)
        except BaseException:
            self._exit_slice(tuple(results), job, raise_errors=False)
            raise
        return {group: results[group] for group in groups}

    def _hold_set(
        self,
        groups: tuple[str, ...],
        job: str,
        clock: _slice.SliceClock,
        results: dict[str, _types.AcquireResult],
    ) -> tuple[str, ...]:
        """Hold the groups of a slice not held yet in one AcquireSet, into ``results``;
        returns those left to take one by one (all of them without AcquireSet)."""
        with contextlib.ExitStack() as locked:
            # Every key lock of the set, in one order: a set is held all or nothing.
            for group in sorted(groups):
                locked.enter_context(self._key_lock((job, group)))
            wanted = self._holds.join(groups, job, results)
            if len(wanted) < 2:
                return wanted
            wait = clock.remaining(job=job, group=",".join(wanted))
            try:
                granted = self.acquire_set(wanted, job_id=job, timeout=wait)
            except errors.RPCError as err:
                if not self._holds.set_refused(err):
                    raise
                return wanted
            self._holds.record_set(job, granted, results)
            return ()

    def _hold(self, job: str, group: str, clock: _slice.SliceClock) -> _types.AcquireResult:
        key = (job, group)
        # Serialises acquire/yield transitions of one (job, group) across threads, so
        # a slice never runs while another thread's exit is yielding the same group.
        with self._key_lock(key):
            held = self._holds.held(key)
            if held is None:
                wait = clock.remaining(job=job, group=group)
                held = self.acquire(group, job_id=job, timeout=wait)
                self._holds.record(key, held)
            return held

    def _exit_slice(self, groups: tuple[str, ...], job: str, *, raise_errors: bool) -> None:
        if not self.enabled:
            return
        failures: list[tuple[str, BaseException]] = []
        for group in reversed(groups):
            key = (job, group)
            with self._key_lock(key):
                if not self._holds.drop(key):
                    continue
                try:
                    self.yield_(group, job_id=job)
                except Exception as exc:
                    failures.append((group, exc))
        _slice.released(failures, job, raise_errors=raise_errors)
