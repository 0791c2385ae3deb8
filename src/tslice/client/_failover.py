"""Several orchestrator addresses, and the leader's redirect: which one calls go to.

In Kubernetes HA mode one orchestrator replica leads; a follower answers every call of
the orchestrator service with UNAVAILABLE and the leader's ``host:port`` in the trailing
metadata :data:`LEADER_METADATA_KEY` (empty while no leader is known). A client is given
one address (a Service) or a list (``a:50051,b:50051``); its channel is a
:class:`FailoverChannel` (:class:`AioFailoverChannel`) over one gRPC channel per address,
and every call goes to :attr:`Targets.current`:

- a redirect makes the leader's address current (added to the list if new); the call
  did not run on the follower, so the transport re-issues it there at once, whatever the
  method (:mod:`tslice.client._channel`);
- any other UNAVAILABLE (nothing listens, the connection broke, no leader known yet)
  moves on to the next address of the list; the call is then retried as its method
  allows (:mod:`tslice.client._retry`), within its deadline.

Streams (the Session carrying Acquire and Yield, Hold, WatchEvents) are watched as they
are read: a follower's refusal or a broken stream switches the address before the
stream's callers see the error, so the Session's Acquire, re-issued by the transport on
a new stream, reaches the leader (the orchestrator keeps a re-issued Acquire's place or
recognises its holder: it is never granted twice). Switches are compare-and-set against
the address the failed call used, so many calls failing together move on once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Final

import grpc
import grpc.aio

from tslice.client import _address
from tslice.common import errors

log = logging.getLogger("tslice.client")

#: Trailing metadata of a follower's refusal: the leader's ``host:port`` ("" if unknown).
LEADER_METADATA_KEY: Final = "x-tslice-leader"
#: Addresses learnt from redirects beyond the given ones are kept up to this many in all.
_MAX_TARGETS = 32
_SOURCE = f"the {LEADER_METADATA_KEY} trailer"
#: Redirects followed at once by one call (more: a loop of followers; retried as usual).
MAX_REDIRECTS: Final = 8
#: With several addresses, how long the first connection waits for one before the next.
PROBE_SLICE_S: Final = 0.5


def leader_hint(err: grpc.RpcError) -> str | None:
    """The leader's address a follower's refusal names, or None."""
    try:
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return None
        trailers: Any = err.trailing_metadata() or ()
    except (AttributeError, TypeError, ValueError):  # an RpcError that is no call
        return None
    for key, value in trailers:
        if key == LEADER_METADATA_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            return text.strip() or None
    return None


class Targets:
    """The addresses and the current one (thread-safe, no I/O)."""

    def __init__(self, targets: Sequence[str]) -> None:
        if not targets:
            raise ValueError("at least one target is needed")
        self._targets = list(targets)
        self._given = len(self._targets)
        #: Where calls go now (an attribute, not a property: read on every call; it is
        #: only replaced whole, under the guard).
        self.current = self._targets[0]
        self._guard = threading.Lock()

    @property
    def several(self) -> bool:
        """Whether there is another address to move on to."""
        return len(self._targets) > 1

    def after_error(self, used: str, err: grpc.RpcError) -> bool:
        """A call to ``used`` failed with ``err``: follow a redirect, or move on from
        ``used`` on another UNAVAILABLE. True: ``err`` redirected the call elsewhere (it
        did not run; re-issue it at once)."""
        try:
            code = err.code()
        except (AttributeError, TypeError):
            return False
        if code != grpc.StatusCode.UNAVAILABLE:
            return False
        hint = leader_hint(err)
        leader = self._checked(hint) if hint else None
        if leader is not None and leader != used:
            self._follow(used, leader)
            return True
        self.skip(used)
        return False

    def skip(self, used: str) -> None:
        """Move on from ``used`` to the next address, unless another call already did."""
        with self._guard:
            if self.current != used or len(self._targets) < 2:
                return
            at = self._targets.index(used) if used in self._targets else -1
            self.current = self._targets[(at + 1) % len(self._targets)]
            now = self.current
        log.info("orchestrator %s did not answer; trying %s", used, now)

    def _follow(self, used: str, leader: str) -> None:
        with self._guard:
            if leader not in self._targets:
                if len(self._targets) >= _MAX_TARGETS:
                    del self._targets[self._given]  # the oldest learnt one
                self._targets.append(leader)
            self.current = leader
        log.info("orchestrator %s is a follower; following the leader at %s", used, leader)

    @staticmethod
    def _checked(hint: str) -> str | None:
        try:
            return _address.grpc_target(
                hint, default_port=_address.ORCHESTRATOR_PORT, source=_SOURCE
            )
        except errors.ConfigError as err:
            log.warning("ignoring a redirect: %s", err)
            return None


def probe_waits(targets: Targets | None, seconds: float) -> Iterator[float]:
    """How long each probe of a first connection waits: all of ``seconds`` for one
    address, else slices of it, one address after another, until they are spent."""
    several = targets is not None and targets.several
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        yield min(left, PROBE_SLICE_S) if several else left
        if not several:
            return


# -- the channels ---------------------------------------------------------------------------


class _Multicallable:
    """A stub's method on whichever channel is current at each call."""

    def __init__(
        self,
        pick: Callable[[], tuple[str, Any]],
        kind: str,
        args: tuple[Any, ...],
        options: dict[str, Any],
        watch: Callable[[str, Any], Any] | None,
    ) -> None:
        self._pick = pick
        self._kind = kind
        self._args = args
        self._options = options
        #: Wraps the call of a streaming method (None: unary, errors seen by the transport).
        self._watch = watch
        self._made: dict[str, Any] = {}

    def _target(self) -> tuple[str, Any]:
        target, channel = self._pick()
        made = self._made.get(target)
        if made is None:
            made = getattr(channel, self._kind)(*self._args, **self._options)
            self._made[target] = made
        return target, made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target, made = self._target()
        call = made(*args, **kwargs)
        return call if self._watch is None else self._watch(target, call)

    def future(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()[1].future(*args, **kwargs)

    def with_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()[1].with_call(*args, **kwargs)


class _Watched:
    """A streaming call whose failure is shown to :class:`Targets` before its reader."""

    def __init__(self, targets: Targets, used: str, call: Any) -> None:
        self._targets = targets
        self._used = used
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    def _failed(self, err: grpc.RpcError) -> None:
        self._targets.after_error(self._used, err)


class _SyncWatched(_Watched):
    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except grpc.RpcError as err:
            self._failed(err)
            raise


class _AioWatched(_Watched):
    def __aiter__(self) -> AsyncIterator[Any]:
        return self._replies()

    async def _replies(self) -> AsyncIterator[Any]:
        try:
            async for reply in self._call:
                yield reply
        except grpc.RpcError as err:
            self._failed(err)
            raise

    async def read(self) -> Any:
        try:
            return await self._call.read()
        except grpc.RpcError as err:
            self._failed(err)
            raise


class _Channels:
    """One channel per address, made on first use."""

    def __init__(self, targets: Targets, make: Callable[[str], Any]) -> None:
        self.targets = targets
        self._make = make
        self._open: dict[str, Any] = {}
        self._closed = False
        self._guard = threading.Lock()

    def pick(self) -> tuple[str, Any]:
        target = self.targets.current
        with self._guard:
            channel = self._open.get(target)
            if channel is None:
                if self._closed:
                    # A call after close() fails as on a closed gRPC channel (one of ours
                    # where there is one); it never opens a channel nobody would close.
                    if not self._open:
                        raise ValueError("Cannot invoke RPC on closed channel!")
                    return target, next(iter(self._open.values()))
                channel = self._open[target] = self._make(target)
        return target, channel

    def take_all(self) -> list[Any]:
        """The channels to close; the calls made later fail on them."""
        with self._guard:
            self._closed = True
            return list(self._open.values())

    def method(
        self,
        kind: str,
        args: tuple[Any, ...],
        options: dict[str, Any],
        watched: type[_Watched] | None,
    ) -> _Multicallable:
        targets = self.targets
        watch = None if watched is None else (lambda used, call: watched(targets, used, call))
        return _Multicallable(self.pick, kind, args, options, watch)


class _Methods:
    """The four method factories of both channels (streams watched by ``_watched``)."""

    _channels: _Channels
    _watched: type[_Watched]

    @property
    def targets(self) -> Targets:
        return self._channels.targets

    def _method(self, kind: str, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        watched = self._watched if kind.endswith("_stream") else None
        return self._channels.method(kind, args, options, watched)

    # (method, request_serializer, response_deserializer) as the stubs pass them.
    def unary_unary(self, method: str, *args: Any, **options: Any) -> Any:
        return self._method("unary_unary", (method, *args), options)

    def unary_stream(self, method: str, *args: Any, **options: Any) -> Any:
        return self._method("unary_stream", (method, *args), options)

    def stream_unary(self, method: str, *args: Any, **options: Any) -> Any:
        return self._method("stream_unary", (method, *args), options)

    def stream_stream(self, method: str, *args: Any, **options: Any) -> Any:
        return self._method("stream_stream", (method, *args), options)


class FailoverChannel(_Methods, grpc.Channel):
    """A ``grpc.Channel`` over the addresses of :class:`Targets` (see the module docstring)."""

    _watched = _SyncWatched

    def __init__(self, targets: Targets, make: Callable[[str], grpc.Channel]) -> None:
        self._channels = _Channels(targets, make)

    def subscribe(
        self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False
    ) -> None:
        self._channels.pick()[1].subscribe(callback, try_to_connect=try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._channels.pick()[1].unsubscribe(callback)

    def close(self) -> None:
        for channel in self._channels.take_all():
            channel.close()


class AioFailoverChannel(_Methods, grpc.aio.Channel):
    """The ``grpc.aio.Channel`` twin of :class:`FailoverChannel`."""

    _watched = _AioWatched

    def __init__(self, targets: Targets, make: Callable[[str], grpc.aio.Channel]) -> None:
        self._channels = _Channels(targets, make)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        state: grpc.ChannelConnectivity = self._channels.pick()[1].get_state(try_to_connect)
        return state

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channels.pick()[1].wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self._channels.pick()[1].channel_ready()

    async def close(self, grace: float | None = None) -> None:
        for channel in self._channels.take_all():
            await channel.close(grace)

    async def __aenter__(self) -> AioFailoverChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


def unwatched(channel: object, kind: str, method: str, *args: Any) -> Any:
    """The ``kind`` method factory's result for ``method`` on ``channel``, its streams
    not watched: their caller reports how they fail (a stream read on every hand-over
    saves a wrapper per message)."""
    if isinstance(channel, (FailoverChannel, AioFailoverChannel)):
        return channel._channels.method(kind, (method, *args), {}, None)
    return getattr(channel, kind)(method, *args)


def current_target(channel: object) -> tuple[Targets | None, str]:
    """The failover state of a transport's channel and where its next call goes (a plain
    channel: None and "")."""
    if isinstance(channel, (FailoverChannel, AioFailoverChannel)):
        return channel.targets, channel.targets.current
    return None, ""
