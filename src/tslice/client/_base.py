"""Everything :class:`~tslice.client.Client` and :class:`~tslice.client.AsyncClient`
share that does no I/O: the constructor and configuration, id resolution, request
building (:class:`AcquireCall`, :class:`AcquireSetCall`, :class:`YieldCall`), deadline
arithmetic, the no-op answers and the mapping of replies to results. The registry of
lease keepers and lost leases is :class:`tslice.client._lease.Keepers`; the
per-(job, group) hold counts behind ``slice()`` are :class:`tslice.client._slice.Holds`.

The two clients then differ only in the lines that make a call (``await`` or
not), as in httpx.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Generic, NoReturn, TypeVar

import grpc

from tslice.api.timeslice_orchestrator.v1alpha1 import orchestrator_pb2 as opb
from tslice.client import _channel, _config, _lease, _retry, _slice, _types
from tslice.common import errors
from tslice.security import tls

log = logging.getLogger("tslice.client")

NOOP_ACQUIRE = _types.AcquireResult(
    success=True, waited_ms=0, context_restored=False, grant_epoch=0
)
# Nobody waits and nothing is snapshotted: exactly what snapshot_deferred means.
NOOP_YIELD = _types.YieldResult(success=True, pending_waiters=0, snapshot_deferred=True)

# Once per process: a training script may build many clients.
_noop_announced: set[str] = set()
_noop_lock = threading.Lock()


def _announce_noop_once(reason: str) -> None:
    """Say on stderr, once, that acquire/yield do nothing and how to change that.

    stderr rather than a log record: a script that configured no logging would show
    nothing, and a job that silently runs alone is exactly what must not go unnoticed.
    """
    with _noop_lock:
        if _noop_announced:
            return
        _noop_announced.add(reason)
    print(
        f"tslice: time-slicing is off: {reason}; acquire/yield return at once "
        f"(set ${_config.DISABLED_ENV}=1 if that is intended)",
        file=sys.stderr,
        flush=True,
    )


_NO_JOB = "a job id is required: this client was made with job_id=None, so pass job_id= to the call"
_NO_GROUP = (
    "a group is required: pass it to the call, default_group= to the client, "
    f"or set ${_config.GROUP_ENV[0]}"
)

#: How many ids a client remembers as checked (one that names many jobs checks the rest).
_CHECKED_IDS_KEPT = 256

HoldKey = _lease.HoldKey
K = TypeVar("K", bound=_lease.Keeper)


@dataclasses.dataclass(frozen=True)
class AcquireCall:
    """One acquire, resolved and checked, ready to send."""

    job: str
    group: str
    request: opb.AcquireRequest
    options: _channel.CallOptions
    started: float

    @property
    def wanted(self) -> str:
        """What the job waits for, in an error's words."""
        return f"group {self.group!r}"


@dataclasses.dataclass(frozen=True)
class AcquireSetCall:
    """One AcquireSet, resolved and checked: sent unless ``answer`` is known (no-op mode)."""

    job: str
    groups: tuple[str, ...]
    request: opb.AcquireSetRequest
    options: _channel.CallOptions
    started: float
    answer: dict[str, _types.AcquireResult] | None = None

    @property
    def group(self) -> str:
        """The groups as one id-like label (``AcquireTimeout.group_id``)."""
        return ",".join(self.groups)

    @property
    def wanted(self) -> str:
        return f"groups {', '.join(map(repr, self.groups))} together"


@dataclasses.dataclass(frozen=True)
class YieldCall(Generic[K]):
    """One yield, resolved: sent unless ``answer`` is already known (no-op mode, or a
    lost lease: ``keeper`` is then the one to stop)."""

    job: str
    group: str
    request: opb.YieldRequest
    options: _channel.CallOptions
    answer: _types.YieldResult | None
    #: The group's lease keeper, told that the job is releasing.
    keeper: K | None

    def failed(self) -> None:
        """The Yield failed: the keeper holds the lease again."""
        if self.keeper is not None:
            self.keeper.resume()


class BaseClient(Generic[K]):
    """Configuration and bookkeeping shared by the sync and async clients."""

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
        *,
        job_id: _config.JobId = _config.USE_CLIENT_DEFAULT,
        default_group: str | None = None,
        timeout: float | None = None,
        call_timeout: float = _config.DEFAULT_CALL_TIMEOUT_S,
        channel_options: Sequence[_config.ChannelOption] | None = None,
        footprint_bytes: int | None = None,
        retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY,
        lease_s: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        connect_timeout: _config.Timeout = _config.USE_CLIENT_DEFAULT,
        security: tls.ClientSecurity | None = None,
    ) -> None:
        lease = _config.resolve_lease(lease_s)
        #: Acquire's lease_ms: 0 = no lease (the lock is kept even if this process dies).
        self._lease_ms = 0 if lease is None else max(1, round(lease * 1000))
        self._config = _config.resolve(
            address=address,
            job_id=job_id,
            default_group=default_group,
            timeout=timeout,
            call_timeout=call_timeout,
            footprint_bytes=footprint_bytes,
            retry=retry,
            channel_options=channel_options,
            connect_timeout=connect_timeout,
            security=security,
        )
        self._closed = False
        #: Ids a call named that were found well-formed (every kind of id has one rule):
        #: a job's calls name the same few again and again.
        self._checked_ids: set[str] = set()
        # Guards what the sync client's threads share (its channel, its key locks).
        self._guard = threading.Lock()
        self._holds = _slice.Holds()
        self._leases: _lease.Keepers[K] = _lease.Keepers()
        self._init_io()

    def __reduce__(self) -> NoReturn:
        # Ray (and multiprocessing) pickle what an actor receives or closes over; without
        # this, the error is "cannot pickle '_thread.lock' object", deep in the client.
        raise TypeError(
            f"{type(self).__name__} cannot be pickled: it owns this process's gRPC channel and "
            "threads; create it in the process that uses it (in a Ray actor: in __init__, e.g. "
            "tslice.rl.ray.phases(), with tslice.rl.ray.env_vars() passed through runtime_env)"
        )

    def _init_io(self) -> None:
        """Set up what the client's I/O needs (channel created on first use...)."""
        raise NotImplementedError

    # -- read-only facts --------------------------------------------------------

    @property
    def config(self) -> _config.ClientConfig:
        """The resolved configuration (arguments, then environment)."""
        return self._config

    @property
    def enabled(self) -> bool:
        """False in no-op mode (no orchestrator configured, or ``TSLICE_DISABLED=1``)."""
        return self._config.enabled

    @property
    def lease_s(self) -> float | None:
        """The holder lease sent with every Acquire (None: no lease)."""
        return self._lease_ms / 1000 if self._lease_ms else None

    @property
    def lost_leases(self) -> dict[str, str]:
        """Groups whose lock this client lost while holding them (group -> why).

        The lease expired (no Hold stream reached the orchestrator for ``lease_s``) or
        the grant was taken away. ``yield_`` of such a group returns success; the
        entry stays until the group is acquired again.
        """
        return self._leases.lost()

    @property
    def _keepers(self) -> dict[HoldKey, K]:
        """The lease keeper of each grant held."""
        return self._leases.by_key

    @property
    def address(self) -> str | None:
        return self._config.address

    @property
    def job_id(self) -> str | None:
        return self._config.job_id

    @property
    def default_group(self) -> str | None:
        return self._config.default_group

    def _endpoint(self) -> _channel.Endpoint:
        """The orchestrator, for the channel created at the first call."""
        assert self._config.address is not None, "no-op mode opens no channel"
        return _channel.Endpoint(
            target=self._config.address,
            peer="the orchestrator",
            retry=self._config.retry,
            connect_timeout=self._config.connect_timeout,
            channel_options=self._config.channel_options,
            security=self._config.security,
        )

    # -- resolution ---------------------------------------------------------------

    def _job(self, job_id: str | None) -> str:
        """The job a call is about."""
        if job_id is not None and job_id in self._checked_ids:
            return job_id
        return self._id("job_id", job_id, self._config.job_id, "the job_id argument", _NO_JOB)

    def _group(self, group: str | None) -> str:
        """The group a call is about."""
        if group is not None and group in self._checked_ids:
            return group
        default = self._config.default_group
        return self._id("group_id", group, default, "the group argument", _NO_GROUP)

    def _id(
        self, kind: str, given: str | None, default: str | None, source: str, missing: str
    ) -> str:
        """``given`` (checked), else the client's ``default``; in no-op mode a missing one
        is fine ("")."""
        if given is not None:
            checked = _config.check_id(kind, given, source=source)
            if len(self._checked_ids) < _CHECKED_IDS_KEPT:
                self._checked_ids.add(checked)
            return checked
        if default is not None:
            return default
        if not self.enabled:
            return ""
        raise errors.ConfigError(missing)

    def _slice_groups(self, groups: Iterable[str]) -> tuple[str, ...]:
        """Groups of a slice, de-duplicated and sorted.

        Every client takes several groups in the same (sorted) order, so two jobs
        that both want "sampler" and "trainer" can never each hold one and wait
        for the other.
        """
        given = tuple(groups)
        if not given:
            return (self._group(None),)
        return tuple(sorted({self._group(group) for group in given}))

    def _noop(self) -> bool:
        """True in no-op mode; the first time, unless asked for, says so on stderr."""
        if self.enabled:
            return False
        if not self._config.disabled_on_purpose:
            _announce_noop_once(self._config.noop_reason)
        return True

    def _require_enabled(self, what: str) -> None:
        if self._closed:
            raise errors.TsliceError(f"cannot {what}: the client is closed")
        if not self.enabled:
            raise errors.ConfigError(f"cannot {what} in no-op mode: {self._config.noop_reason}")

    # -- deadlines ------------------------------------------------------------------

    def _acquire_timeout(self, timeout: _config.Timeout) -> float | None:
        if timeout is _config.USE_CLIENT_DEFAULT:
            return self._config.timeout
        return _config.check_timeout("timeout", timeout)

    def _call_timeout(self, timeout: _config.Timeout) -> float | None:
        if timeout is _config.USE_CLIENT_DEFAULT:
            return self._config.call_timeout
        return _config.check_timeout("timeout", timeout)

    def _slice_clock(self, timeout: _config.Timeout) -> _slice.SliceClock:
        return _slice.SliceClock(self._acquire_timeout(timeout))

    # -- requests and replies ---------------------------------------------------------

    def _prepare_acquire(
        self,
        group: str | None,
        job_id: str | None,
        timeout: _config.Timeout,
        footprint_bytes: int | None,
    ) -> AcquireCall | None:
        """The acquire to send, checked; ``None`` in no-op mode (answer NOOP_ACQUIRE)."""
        job, group_id = self._job(job_id), self._group(group)
        if footprint_bytes is None:
            footprint = self._config.footprint_bytes
        else:
            footprint = _checked_footprint(footprint_bytes)
        request = opb.AcquireRequest(
            job_id=job, group_id=group_id, footprint_bytes=footprint, lease_ms=self._lease_ms
        )
        if timeout is _config.USE_CLIENT_DEFAULT:
            wait = self._config.timeout
        else:
            wait = _config.check_timeout("timeout", timeout)
        if self._config.address is None and self._noop():
            return None
        options = _channel.CallOptions(timeout=wait, job_id=job or None, group_id=group_id or None)
        return AcquireCall(job, group_id, request, options, started=time.monotonic())

    @staticmethod
    def _acquired(response: opb.AcquireResponse) -> _types.AcquireResult:
        return _types.AcquireResult(
            success=response.success,
            waited_ms=response.waited_ms,
            context_restored=response.context_restored,
            grant_epoch=response.grant_epoch,
        )

    @staticmethod
    def _yielded(response: opb.YieldResponse) -> _types.YieldResult:
        return _types.YieldResult(
            success=response.success,
            pending_waiters=response.pending_waiters,
            snapshot_deferred=response.snapshot_deferred,
        )

    def _prepare_acquire_set(
        self,
        groups: Iterable[str],
        job_id: str | None,
        timeout: _config.Timeout,
        footprint_bytes: int | None,
    ) -> AcquireSetCall:
        """The AcquireSet to send, checked (its groups each once, in the order given)."""
        if isinstance(groups, str):
            raise TypeError(
                f"groups must be a collection of group ids, not one string ({groups!r}): "
                f"acquire_set([{groups!r}, ...]), or acquire({groups!r}) for one group"
            )
        job = self._job(job_id)
        given = tuple(_config.check_id("group_id", g, source="the groups argument") for g in groups)
        if not given:
            raise ValueError("groups is empty: name the groups to acquire together")
        group_ids = tuple(dict.fromkeys(given))
        footprint = (
            self._config.footprint_bytes
            if footprint_bytes is None
            else _checked_footprint(footprint_bytes)
        )
        request = opb.AcquireSetRequest(
            job_id=job, group_ids=group_ids, footprint_bytes=footprint, lease_ms=self._lease_ms
        )
        wait = self._acquire_timeout(timeout)
        noop = dict.fromkeys(group_ids, NOOP_ACQUIRE) if self._noop() else None
        # The groups as the call's group: NOT_FOUND then is UnknownGroup (the server names it).
        options = self._options(job, ",".join(group_ids), wait)
        return AcquireSetCall(job, group_ids, request, options, time.monotonic(), answer=noop)

    @contextlib.contextmanager
    def _acquire_set_errors(self, call: AcquireSetCall) -> Iterator[None]:
        """Acquire's errors, and UNIMPLEMENTED (no AcquireSet) with what to do instead;
        the client then remembers it (``slice()`` asks no more)."""
        try:
            with self._acquire_deadline(call):
                yield
        except errors.RPCError as err:
            if err.status != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._holds.sets_supported = False
            log.info("the orchestrator has no AcquireSet: slices take their groups one by one")
            raise errors.RPCError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"the orchestrator at {self._config.address} has no AcquireSet (an llm-d "
                "orchestrator or an older tslice): acquire the groups one by one in sorted "
                f"order, or use slice(), which does so by itself ({err.message})",
            ) from err

    @staticmethod
    def _set_results(
        call: AcquireSetCall, response: opb.AcquireSetResponse
    ) -> dict[str, _types.AcquireResult]:
        """Each group's grant (in the order asked), checked against the request."""
        grants = {grant.group_id: grant for grant in response.grants}
        if not response.success or sorted(grants) != sorted(call.groups):
            raise errors.RPCError(
                grpc.StatusCode.UNKNOWN,
                f"the orchestrator answered AcquireSet({call.job!r}, {list(call.groups)!r}) "
                f"with success={response.success} and grants for {sorted(grants)!r}",
            )
        return {
            group: _types.AcquireResult(
                success=True,
                waited_ms=response.waited_ms,
                context_restored=grants[group].context_restored,
                grant_epoch=grants[group].grant_epoch,
            )
            for group in call.groups
        }

    @staticmethod
    def _timed_out(call: AcquireCall | AcquireSetCall) -> errors.AcquireTimeout:
        """An acquire that ran out of time (the job left the queue)."""
        waited_ms = int((time.monotonic() - call.started) * 1000)
        return errors.AcquireTimeout(
            job_id=call.job,
            group_id=call.group,
            waited_ms=waited_ms,
            message=(
                f"job {call.job!r} was not granted {call.wanted} within "
                f"{waited_ms} ms; it is no longer queued"
            ),
        )

    @classmethod
    @contextlib.contextmanager
    def _acquire_deadline(cls, call: AcquireCall | AcquireSetCall) -> Iterator[None]:
        """An acquire that ran out of time is an AcquireTimeout (the job left the queue)."""
        try:
            yield
        except errors.DeadlineExceeded as err:
            raise cls._timed_out(call) from err

    def _prepare_yield(
        self, group: str | None, job_id: str | None, timeout: _config.Timeout
    ) -> YieldCall[K]:
        """The yield to send; its keeper (if any) is told the job is releasing."""
        job, group_id = self._job(job_id), self._group(group)
        request = opb.YieldRequest(job_id=job, group_id=group_id)
        if timeout is _config.USE_CLIENT_DEFAULT:
            wait: float | None = self._config.call_timeout
        else:
            wait = _config.check_timeout("timeout", timeout)
        options = _channel.CallOptions(timeout=wait, job_id=job or None, group_id=group_id or None)
        if self._config.address is None:  # no-op mode (not `enabled`: a property less)
            return YieldCall(job, group_id, request, options, answer=NOOP_YIELD, keeper=None)
        leases = self._leases
        if leases.was_lost(group_id):
            # Released already (idempotent): success without a call; its keeper is done.
            lost = _types.YieldResult(success=True, pending_waiters=0, snapshot_deferred=False)
            keeper = leases.pop((job, group_id))
            return YieldCall(job, group_id, request, options, answer=lost, keeper=keeper)
        keeper = leases.get((job, group_id))
        if keeper is not None:
            keeper.releasing()
        return YieldCall(job, group_id, request, options, answer=None, keeper=keeper)

    @staticmethod
    def _options(job: str | None, group: str | None, timeout: float | None) -> _channel.CallOptions:
        return _channel.CallOptions(timeout=timeout, job_id=job or None, group_id=group or None)

    def _about_group(
        self, group: str | None, timeout: _config.Timeout
    ) -> tuple[str, _channel.CallOptions]:
        """The group a call is about (checked) and the call's options."""
        group_id = self._group(group)
        return group_id, self._options(self.job_id, group_id, self._call_timeout(timeout))

    def _status_request(
        self, group: str | None, timeout: _config.Timeout
    ) -> tuple[opb.GetGroupStatusRequest, _channel.CallOptions]:
        group_id, options = self._about_group(group, timeout)
        return opb.GetGroupStatusRequest(group_id=group_id), options

    def _list_request(
        self, timeout: _config.Timeout
    ) -> tuple[opb.ListGroupsRequest, _channel.CallOptions]:
        return opb.ListGroupsRequest(), self._options(
            self.job_id, None, self._call_timeout(timeout)
        )

    def _clear_degraded_request(
        self, group: str | None, node: str | None, timeout: _config.Timeout
    ) -> tuple[opb.ClearDegradedRequest, _channel.CallOptions]:
        group_id, options = self._about_group(group, timeout)
        return opb.ClearDegradedRequest(group_id=group_id, node=node or ""), options

    def _evict_request(
        self, group: str | None, job: str, reason: str, timeout: _config.Timeout
    ) -> tuple[opb.EvictRequest, _channel.CallOptions]:
        """``group`` None: the client's group; ``""``: every group (Evict's wire rule)."""
        job_id = _config.check_id("job_id", job, source="the job argument")
        if group == "":
            options = self._options(job_id, None, self._call_timeout(timeout))
            return opb.EvictRequest(group_id="", job_id=job_id, reason=reason), options
        group_id, options = self._about_group(group, timeout)
        return opb.EvictRequest(group_id=group_id, job_id=job_id, reason=reason), options

    def _drain_request(
        self, group: str | None, drain: bool, timeout: _config.Timeout
    ) -> tuple[opb.DrainRequest, _channel.CallOptions]:
        group_id, options = self._about_group(group, timeout)
        return opb.DrainRequest(group_id=group_id, drain=drain), options

    def _watch_request(
        self,
        group: str | None,
        kinds: Iterable[_types.EventKind],
        timeout: float | None,
        stored: _types.StoredEvents | None = None,
    ) -> tuple[opb.WatchEventsRequest, _channel.CallOptions]:
        group_id = "" if group is None else self._group(group)
        request = opb.WatchEventsRequest(group_id=group_id, kinds=_types.event_kinds(kinds))
        if stored is not None:
            stored.fill(request)
        return request, self._options(
            self.job_id, group_id, _config.check_timeout("timeout", timeout)
        )

    # -- leases ---------------------------------------------------------------------------

    def _lease(self, job: str, group: str, epoch: int) -> _lease.Lease:
        """The lease of a new grant, for its keeper."""
        leases = self._leases
        return _lease.Lease(
            job=job,
            group=group,
            epoch=epoch,
            lease_ms=self._lease_ms,
            on_lost=lambda reason: leases.lose(job, group, reason),
        )


def _checked_footprint(footprint_bytes: int) -> int:
    if footprint_bytes < 0:
        raise ValueError(f"footprint_bytes must be >= 0, got {footprint_bytes!r}")
    return footprint_bytes
