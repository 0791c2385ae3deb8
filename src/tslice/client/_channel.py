"""The one wrapper every RPC of the client passes through.

Deadlines, metadata (``x-tslice-job-id``, ``x-tslice-client-version``), retry, the
bound on the first connection and the translation of gRPC status codes into
:mod:`tslice.common.errors` live here and nowhere else. The per-service classes with
one typed method per RPC sit above, in :mod:`tslice.client._services`.

Calls go to the server's current address (:mod:`tslice.client._failover`: several
orchestrator addresses, a follower's redirect to the leader); a redirected unary call
is re-issued there at once, whatever its method (it did not run on the follower).

The sync transport issues unary calls through ``.future()`` and waits on the
future: unlike a plain blocking call that wait is interruptible, and on Ctrl-C
the call is cancelled so that the orchestrator drops the waiter at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Protocol, TypeAlias, TypeVar

import grpc
import grpc.aio

from tslice.client import _address, _config, _failover, _retry, _streams
from tslice.common import errors, version
from tslice.security import tls

Req = TypeVar("Req")
Rep = TypeVar("Rep")
T = TypeVar("T")
_Req_contra = TypeVar("_Req_contra", contravariant=True)
_Rep_co = TypeVar("_Rep_co", covariant=True)

#: The job side's TLS settings, as a TLS-mismatch hint names them.
_TLS_SETTINGS = (
    f"the client (${tls.TLS_CA_ENV}, ${tls.TLS_CERT_ENV}/${tls.TLS_KEY_ENV}, "
    f"${tls.TLS_SERVER_NAME_ENV})"
)

JOB_ID_HEADER = "x-tslice-job-id"
CLIENT_VERSION_HEADER = "x-tslice-client-version"

ChannelOption: TypeAlias = _config.ChannelOption
Metadata: TypeAlias = tuple[tuple[str, str], ...]

#: Channel options applied under the caller's (the caller's win on the same key).
DEFAULT_CHANNEL_OPTIONS: tuple[ChannelOption, ...] = (
    # A blocked Acquire sends no data for minutes; keepalive notices a dead peer
    # (host gone, network cut). 60 s stays above what default servers tolerate: the
    # client sends at most 2 pings without data, one strike, no GOAWAY.
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    # The channel's own reconnect back-off starts at 1 s and grows to 120 s; after
    # an orchestrator restart our retries would keep failing fast until it fires.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


def channel_options(user: Sequence[ChannelOption] | None) -> list[ChannelOption]:
    """Our defaults merged under ``user`` (same key: the user's value wins)."""
    given = list(user or ())
    keys = {key for key, _ in given}
    return [item for item in DEFAULT_CHANNEL_OPTIONS if item[0] not in keys] + given


@dataclasses.dataclass(frozen=True)
class Method:
    """One RPC of the wire contract and whether re-issuing it is safe."""

    service: str
    name: str
    #: Safe to re-issue after UNAVAILABLE (idempotent, or the server dedups it).
    retryable: bool = False
    #: Codes that, answering a re-issued attempt, mean an earlier attempt took effect
    #: (its reply was lost with the connection); the call then returns its ``settled``.
    settled_codes: frozenset[grpc.StatusCode] = frozenset()


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """Per-call settings for one RPC."""

    #: Deadline of the whole call, retries included, in seconds (``None`` = none).
    timeout: float | None = None
    #: Sent as ``x-tslice-job-id`` so that server logs name the caller.
    job_id: str | None = None
    #: Lets NOT_FOUND become :class:`~tslice.common.errors.UnknownGroup`.
    group_id: str | None = None
    #: ``None`` = the transport's policy.
    retry: _retry.RetryPolicy | None = None


NO_OPTIONS = CallOptions()


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A server a transport talks to: where it is, what errors call it, and the bounds
    on reaching it (see :class:`_Transport`)."""

    #: The gRPC target (``host:port``, ``unix:/path``...), named in errors.
    target: str
    #: What errors call the server ("the orchestrator").
    peer: str = "the server"
    retry: _retry.RetryPolicy = _retry.DEFAULT_RETRY
    #: Bound on the first connection, in seconds (``None``: as long as a call may wait).
    connect_timeout: float | None = None
    #: Laid over :data:`DEFAULT_CHANNEL_OPTIONS`.
    channel_options: tuple[ChannelOption, ...] = ()
    #: TLS and bearer token (default: ``$TSLICE_TLS_*``, ``$TSLICE_TOKEN*``).
    security: tls.ClientSecurity = dataclasses.field(default_factory=tls.ClientSecurity.from_env)

    @property
    def targets(self) -> tuple[str, ...]:
        """The addresses ``target`` names (several: orchestrator replicas)."""
        return _address.split_targets(self.target)

    def channel(self) -> grpc.Channel:
        options = channel_options(self.channel_options)
        return _failover.FailoverChannel(
            _failover.Targets(self.targets), lambda target: self.security.channel(target, options)
        )

    def aio_channel(self) -> grpc.aio.Channel:
        """Create it inside the event loop that will use it."""
        options = channel_options(self.channel_options)
        return _failover.AioFailoverChannel(
            _failover.Targets(self.targets),
            lambda target: self.security.aio_channel(target, options),
        )


# -- what the transports call: generated stub methods, or anything shaped like them --------


class Outcome(Protocol[_Rep_co]):
    """A sync call in flight (``grpc.Future``)."""

    def result(self) -> _Rep_co: ...

    def cancel(self) -> object: ...


class SyncUnary(Protocol[_Req_contra, _Rep_co]):
    """A sync unary method of a generated stub (or a stand-in with its ``future()``)."""

    def future(
        self,
        request: _Req_contra,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Outcome[_Rep_co]: ...


class AsyncUnary(Protocol[_Req_contra, _Rep_co]):
    """An async unary method of a generated stub (or a stand-in called the same way)."""

    def __call__(
        self,
        request: _Req_contra,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Awaitable[_Rep_co]: ...


# -- transports ---------------------------------------------------------------------------------

# The first connection is proven by any answer to a health check (every server has
# the method or answers UNIMPLEMENTED); wait_for_ready makes it wait out refusals.
_PROBE = _streams.HealthCheckRequest()
_NOT_CONNECTED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


def _last_probe_s(budget: float) -> float:
    """The end of the connect budget kept for a last probe without wait_for_ready: it
    fails at once, saying why (refused, no such host), where the waiting one cannot."""
    return min(0.2, budget / 4)


class _Transport:
    """What the sync and async transports share: metadata, attempt planning, and the
    bound on the first connection.

    Until the channel has been ready once, a call first waits for it, at most
    ``connect_timeout`` (and never past the call's deadline): an address where nothing
    answers then fails with a clear :class:`~tslice.common.errors.Unavailable` instead
    of being retried silently. Once connected, UNAVAILABLE is retried as the method
    allows (an orchestrator restart is ridden out).

    A call first goes out once, with nothing planned: only a failure builds the retry
    bookkeeping (:class:`~tslice.client._retry.Attempts`), so that a hand-over's calls
    cost no more than the call itself.
    """

    def __init__(self, endpoint: Endpoint, channel: object) -> None:
        self.endpoint = endpoint
        self._connected = endpoint.connect_timeout is None
        #: Where calls go (None: a channel given by the caller, one address).
        self._targets, _ = _failover.current_target(channel)
        #: Metadata by job id, when it never changes (no token: a token file may rotate).
        self._metadata: dict[str | None, Metadata] = {}
        self._static_metadata = endpoint.security.token is None

    def where(self) -> str:
        """The address the next call goes to ("" for a caller's channel)."""
        return self._targets.current if self._targets is not None else ""

    def redirected(self, used: str, err: grpc.RpcError, redirects: int) -> bool:
        """After a call to ``used`` failed: True if a follower redirected it (re-issue it
        at once); any other UNAVAILABLE moves on to the next address."""
        if self._targets is None:
            return False
        return self._targets.after_error(used, err) and redirects < _failover.MAX_REDIRECTS

    def stream_failed(self, used: str, err: grpc.RpcError) -> None:
        """A stream opened at ``used`` failed: a redirect, or on to the next address."""
        if self._targets is not None:
            self._targets.after_error(used, err)

    def probe_slices(self, budget: float) -> Iterator[float]:
        """The waits of the first connection's probes (see ``_failover.probe_waits``)."""
        return _failover.probe_waits(self._targets, budget - _last_probe_s(budget))

    def probe_failed(self, used: str, err: grpc.RpcError) -> bool:
        """Whether a probe of ``used`` found no server (then on to the next address)."""
        if err.code() not in _NOT_CONNECTED:
            return False
        if self._targets is not None and not self._targets.after_error(used, err):
            self._targets.skip(used)
        return True

    def unconnected(self, budget: float, last: grpc.RpcError | None) -> None:
        """After the probes: raise unless the last one found a server after all."""
        if last is not None and last.code() in _NOT_CONNECTED:
            raise self.not_connected(budget, last) from last

    def connect_budget(self, call_timeout: float | None) -> float | None:
        """How long to wait for the first connection (None: no need, it happened)."""
        bound = self.endpoint.connect_timeout
        if self._connected or bound is None:
            return None
        return bound if call_timeout is None else min(call_timeout, bound)

    def connected(self) -> None:
        self._connected = True

    def not_connected(self, waited_s: float, last: grpc.RpcError) -> errors.Unavailable:
        """The error of a first connection that did not happen; ``last`` says why."""
        reason = (
            last.details()
            if last.code() == grpc.StatusCode.UNAVAILABLE
            else "the connection was not completed"
        )
        server = self.endpoint
        # A reason that shows TLS on one side only says so (else the general hint).
        hint = tls.mismatch_hint(reason or "", server.security, settings=_TLS_SETTINGS)
        return errors.Unavailable(
            grpc.StatusCode.UNAVAILABLE,
            f"failed to connect to {server.peer} at {server.target} within {waited_s:.3g} s "
            f"({reason}): is it running, and is the address right? "
            f"{hint or server.security.connect_hint()} (${_config.CONNECT_TIMEOUT_ENV} waits "
            "longer)",
        )

    def metadata(self, options: CallOptions) -> Metadata:
        cached = self._metadata.get(options.job_id)
        if cached is not None:
            return cached
        items = [(CLIENT_VERSION_HEADER, version.VERSION), *self.endpoint.security.metadata()]
        if options.job_id:
            items.append((JOB_ID_HEADER, options.job_id))
        if self._static_metadata:
            self._metadata[options.job_id] = tuple(items)
        return tuple(items)

    def attempts(self, method: Method, options: CallOptions, since: float) -> _retry.Attempts:
        return _retry.Attempts(
            method=method.name,
            target=self.endpoint.target,
            retryable=method.retryable,
            settled_codes=method.settled_codes,
            policy=options.retry or self.endpoint.retry,
            timeout=options.timeout,
            group_id=options.group_id,
            since=since,
        )


#: What a re-issued call returns when its answer says an earlier attempt took effect
#: (``Method.settled_codes``), given the request and that answer; it raises the answer
#: when it finds the earlier attempt did not take effect after all.
SyncSettled = Callable[[Req, errors.RPCError], Rep]
AsyncSettled = Callable[[Req, errors.RPCError], Awaitable[Rep]]


def _settled_error(method: Method, attempts: _retry.Attempts) -> errors.RPCError:
    assert attempts.settled is not None, f"{method.name}: no settled answer"
    return attempts.settled


class SyncTransport(_Transport):
    """Runs RPCs on a ``grpc.Channel`` (blocking)."""

    def __init__(
        self,
        channel: grpc.Channel,
        endpoint: Endpoint,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(endpoint, channel)
        self.channel = channel
        self._sleep = sleep
        self._probe = _streams.health_check(channel)

    def connect(self, call_timeout: float | None) -> None:
        """Wait for the first connection (see :class:`_Transport`)."""
        budget = self.connect_budget(call_timeout)
        if budget is None:
            return
        for wait_s in self.probe_slices(budget):
            used = self.where()
            try:
                wait(self._probe.future(_PROBE, timeout=wait_s, wait_for_ready=True))
            except grpc.RpcError as err:
                if self.probe_failed(used, err):
                    continue
            break  # an answer, if only a refusal, proves the connection
        else:
            self.unconnected(budget, self._last_error(_last_probe_s(budget)))
        self.connected()

    def _last_error(self, timeout: float) -> grpc.RpcError | None:
        try:
            wait(self._probe.future(_PROBE, timeout=timeout))
        except grpc.RpcError as err:
            return err
        return None

    def unary(
        self,
        method: Method,
        call: SyncUnary[Req, Rep],
        request: Req,
        options: CallOptions,
        *,
        settled: SyncSettled[Req, Rep] | None = None,
    ) -> Rep:
        """One call of ``method``: at once once connected, retried after a failure."""
        if not self._connected:
            return self._retried(
                method, call, request, options, settled=settled, since=time.monotonic()
            )
        since, used = time.monotonic(), self.where()
        metadata = self._metadata.get(options.job_id) or self.metadata(options)
        try:
            return wait(call.future(request, timeout=options.timeout, metadata=metadata))
        except grpc.RpcError as err:
            return self._retried(
                method, call, request, options, settled=settled, since=since, failed=(used, err)
            )

    def _retried(
        self,
        method: Method,
        call: SyncUnary[Req, Rep],
        request: Req,
        options: CallOptions,
        *,
        settled: SyncSettled[Req, Rep] | None,
        since: float,
        failed: tuple[str, grpc.RpcError] | None = None,
    ) -> Rep:
        """The call after its first attempt ``failed`` (None: none made: not connected)."""
        attempts = self.attempts(method, options, since)
        metadata = self.metadata(options)
        if failed is None:
            self.connect(attempts.attempt_timeout())
        redirects = 0
        while True:
            if failed is not None:
                used, err = failed
                if self.redirected(used, err, redirects):
                    redirects += 1
                elif (delay := attempts.after_error(err)) is None:
                    assert settled is not None, f"{method.name} settles with no answer"
                    return settled(request, _settled_error(method, attempts))
                else:
                    self._sleep(delay)
            used = self.where()
            try:
                response = wait(
                    call.future(request, timeout=attempts.attempt_timeout(), metadata=metadata)
                )
            except grpc.RpcError as err:
                failed = (used, err)
                continue
            attempts.succeeded()
            return response

    def unary_stream(
        self,
        method: Method,
        call: grpc.UnaryStreamMultiCallable[Req, Rep],
        request: Req,
        options: CallOptions,
    ) -> _streams.SyncStream[Rep]:
        # Streams are never retried: only the caller knows how to resume one.
        self.connect(options.timeout)
        stream = call(request, timeout=options.timeout, metadata=self.metadata(options))
        return _streams.SyncStream(stream, group_id=options.group_id)

    def stream_stream(
        self,
        method: Method,
        call: grpc.StreamStreamMultiCallable[Req, Rep],
        requests: Iterable[Req],
        options: CallOptions,
    ) -> _streams.SyncStream[Rep]:
        self.connect(options.timeout)
        stream = call(iter(requests), timeout=options.timeout, metadata=self.metadata(options))
        return _streams.SyncStream(stream, group_id=options.group_id)


def wait(future: Outcome[Rep]) -> Rep:
    """The result of a sync call in flight; an interrupt or a failure cancels it."""
    try:
        return future.result()
    except BaseException:
        # Interrupted (Ctrl-C) or failed: make sure the server sees the caller leave.
        future.cancel()
        raise


class AsyncTransport(_Transport):
    """Runs RPCs on a ``grpc.aio.Channel``; differs from :class:`SyncTransport` only in awaiting."""

    def __init__(self, channel: grpc.aio.Channel, endpoint: Endpoint) -> None:
        super().__init__(endpoint, channel)
        self.channel = channel
        self._probe = _streams.health_check(channel)

    async def connect(self, call_timeout: float | None) -> None:
        """Wait for the first connection (see :class:`_Transport`)."""
        budget = self.connect_budget(call_timeout)
        if budget is None:
            return
        for wait_s in self.probe_slices(budget):
            used = self.where()
            try:
                await self._probe(_PROBE, timeout=wait_s, wait_for_ready=True)
            except grpc.RpcError as err:
                if self.probe_failed(used, err):
                    continue
            break  # an answer, if only a refusal, proves the connection
        else:
            self.unconnected(budget, await self._last_error(_last_probe_s(budget)))
        self.connected()

    async def _last_error(self, timeout: float) -> grpc.RpcError | None:
        try:
            await self._probe(_PROBE, timeout=timeout)
        except grpc.RpcError as err:
            return err
        return None

    async def unary(
        self,
        method: Method,
        call: AsyncUnary[Req, Rep],
        request: Req,
        options: CallOptions,
        *,
        settled: AsyncSettled[Req, Rep] | None = None,
    ) -> Rep:
        """See :meth:`SyncTransport.unary`."""
        if not self._connected:
            return await self._retried(
                method, call, request, options, settled=settled, since=time.monotonic()
            )
        since, used = time.monotonic(), self.where()
        metadata = self._metadata.get(options.job_id) or self.metadata(options)
        try:
            return await call(request, timeout=options.timeout, metadata=metadata)
        except grpc.RpcError as err:
            failed = (used, err)
        return await self._retried(
            method, call, request, options, settled=settled, since=since, failed=failed
        )

    async def _retried(
        self,
        method: Method,
        call: AsyncUnary[Req, Rep],
        request: Req,
        options: CallOptions,
        *,
        settled: AsyncSettled[Req, Rep] | None,
        since: float,
        failed: tuple[str, grpc.RpcError] | None = None,
    ) -> Rep:
        """See :meth:`SyncTransport._retried`."""
        attempts = self.attempts(method, options, since)
        metadata = self.metadata(options)
        if failed is None:
            await self.connect(attempts.attempt_timeout())
        redirects = 0
        while True:
            if failed is not None:
                used, err = failed
                if self.redirected(used, err, redirects):
                    redirects += 1
                elif (delay := attempts.after_error(err)) is None:
                    assert settled is not None, f"{method.name} settles with no answer"
                    return await settled(request, _settled_error(method, attempts))
                else:
                    await asyncio.sleep(delay)
            used = self.where()
            try:
                response = await call(
                    request, timeout=attempts.attempt_timeout(), metadata=metadata
                )
            except grpc.RpcError as err:
                failed = (used, err)
                continue
            attempts.succeeded()
            return response

    def unary_stream(
        self,
        method: Method,
        call: grpc.aio.UnaryStreamMultiCallable[Req, Rep],
        request: Req,
        options: CallOptions,
    ) -> _streams.AsyncStream[Rep]:
        return _streams.AsyncStream(
            lambda: call(request, timeout=options.timeout, metadata=self.metadata(options)),
            connect=lambda: self.connect(options.timeout),
            group_id=options.group_id,
        )

    def stream_stream(
        self,
        method: Method,
        call: grpc.aio.StreamStreamMultiCallable[Req, Rep],
        requests: AsyncIterator[Req] | Iterator[Req],
        options: CallOptions,
    ) -> _streams.AsyncStream[Rep]:
        return _streams.AsyncStream(
            lambda: call(requests, timeout=options.timeout, metadata=self.metadata(options)),
            connect=lambda: self.connect(options.timeout),
            group_id=options.group_id,
        )
