"""HA mode's gRPC side: who leads, and followers that redirect (no client library here).

Several orchestrator replicas run; the one holding the Lease (``kube.lease``) leads and
serves the orchestrator service. A follower answers every call of that service
UNAVAILABLE, with a message naming the leader and the leader's ``host:port`` in the
trailing metadata :data:`LEADER_METADATA_KEY` (empty while no leader is known), so a
client retries there (``tslice.client`` follows it; one Service address in front of
every replica works too). Reads are redirected like writes: a follower holds no group
state, so what it would answer could only be stale. Health (``grpc.health.v1``) and
reflection are served by every replica: the kubelet's probes pass on followers (rolling
updates proceed), and the orchestrator service's own health name is SERVING on the
leader only.

The servicer of the current term is swapped in and out behind :func:`forwarding` (gRPC
servicers are registered once per server, a leader's groups live for one term).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

_Context = grpc.aio.ServicerContext[Any, Any]

#: Trailing metadata of a follower's refusal: the leader's ``host:port`` ("" if unknown).
LEADER_METADATA_KEY = "x-tslice-leader"


@dataclasses.dataclass(frozen=True)
class HaSettings:
    """``tslice orchestrator --kubernetes --ha``: leader election and where state lives."""

    #: This replica's name in the Lease (the pod name): unique per replica.
    identity: str
    #: Where clients reach this replica (``host:port``, the pod IP): told to callers of a
    #: follower while this replica leads.
    address: str
    lease_name: str = "tslice-orchestrator"
    #: Namespace of the Lease and of the state ConfigMaps.
    namespace: str = "timeslice-system"
    #: A leader that has not renewed for this long is replaced, seconds (the Lease's
    #: ``leaseDurationSeconds``: whole seconds).
    lease_duration_s: int = 15
    #: How often the leader renews and a follower looks at the Lease, seconds.
    renew_interval_s: float = 2.0

    @property
    def renew_deadline_s(self) -> float:
        """A leader that could not renew for this long stops leading (before a follower,
        which waits the whole duration on its own clock, may take over)."""
        return self.lease_duration_s * 2 / 3


class Leadership:
    """This replica's role now: the current term's servicer while it leads, else none."""

    def __init__(self, service: str, identity: str) -> None:
        self.service = service
        self.identity = identity
        self.servicer: Any = None
        #: The leader's address as last seen in the Lease (None: no leader known).
        self.leader_address: str | None = None
        self.leader_identity: str | None = None
        #: Why this replica stopped leading, while the Lease still names it (None: it
        #: was just elected, or never led).
        self.stepped_down: str | None = None

    @property
    def leading(self) -> bool:
        return self.servicer is not None

    def elected(self) -> None:
        """This replica won the Lease: it reads the state before it leads."""
        self.stepped_down = None

    def lead(self, servicer: Any) -> None:
        self.servicer = servicer

    def follow(self, why: str | None = None) -> None:
        """Not leading (any more); ``why`` it stopped, if it led."""
        self.servicer = None
        if why is not None:
            self.stepped_down = why

    def saw_leader(self, identity: str | None, address: str | None) -> None:
        self.leader_identity, self.leader_address = identity, address

    def refusal(self, method: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        """What a follower answers a call of ``method``: the message and the trailers."""
        name = method.rsplit("/", 1)[-1]
        address = self.leader_address or ""
        if address and self.leader_identity != self.identity:
            where = f"the leader is {self.leader_identity} at {address}"
            fix = f"call {address} (tslice clients follow the {LEADER_METADATA_KEY} trailer)"
        elif address and self.stepped_down is not None:
            # The Lease, as last read, still names this replica (the API server may be out
            # of reach): no other leader is known yet.
            where = f"it stopped leading ({self.stepped_down}) and no new leader is known yet"
            fix = "retry in a few seconds"
            address = ""
        elif address:
            where = "it was just elected leader and is reading the state"
            fix = "retry in a moment"
            address = ""  # not a redirect: the client backs off instead of calling again at once
        else:
            where = "no leader is elected yet (the Lease is free or expiring)"
            fix = "retry in a few seconds"
        message = (
            f"{name}: this orchestrator replica ({self.identity}) is a follower; {where}: {fix}"
        )
        return message, ((LEADER_METADATA_KEY, address),)

    async def abort(self, context: _Context, method: str) -> None:
        message, trailers = self.refusal(method)
        await context.abort(grpc.StatusCode.UNAVAILABLE, message, trailers)


class FollowerGate(grpc.aio.ServerInterceptor):
    """Refuses every call of the orchestrator service while this replica does not lead."""

    def __init__(self, leadership: Leadership) -> None:
        self._leadership = leadership
        self._prefix = f"/{leadership.service}/"

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: Any
    ) -> Any:
        method = str(details.method)
        if self._leadership.leading or not method.startswith(self._prefix):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler, method, self._leadership)


def _refusing(handler: Any, method: str, leadership: Leadership) -> Any:
    """A handler of ``handler``'s kind that answers the follower's refusal."""
    if handler is None:
        return None

    async def refuse(request: Any, context: _Context) -> Any:
        await leadership.abort(context, method)

    async def refuse_stream(request: Any, context: _Context) -> AsyncIterator[Any]:
        if handler.request_streaming:
            await _first_request(request)
        await leadership.abort(context, method)
        yield  # pragma: no cover (abort raises): makes this an async generator

    streaming = handler.response_streaming
    options = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **options)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **options)
    if streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **options)
    return grpc.unary_unary_rpc_method_handler(refuse, **options)


#: How long a refused stream waits for its caller's first request, seconds.
_FIRST_REQUEST_S = 1.0


async def _first_request(requests: AsyncIterator[Any]) -> None:
    """Until the caller's first request has arrived (or a second went by). A grpc.aio
    client whose request stream ends before its first write completes reports INTERNAL
    "Internal error from Core" instead of our status (grpc/grpc#36066): the Session's
    first write is its call, so once that has arrived the refusal reaches the client."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(anext(aiter(requests)), _FIRST_REQUEST_S)


def forwarding(servicer_type: type[Any], methods: list[str], leadership: Leadership) -> Any:
    """A servicer whose every method runs the current term's servicer's (of
    ``servicer_type``); between terms (a call that passed the gate as leadership ended)
    it answers the follower's refusal."""
    attrs: dict[str, Any] = {}
    for name in methods:
        full = f"/{leadership.service}/{name}"
        if inspect.isasyncgenfunction(getattr(servicer_type, name)):
            attrs[name] = _forward_stream(name, full, leadership)
        else:
            attrs[name] = _forward_call(name, full, leadership)
    return type("ForwardingServicer", (), attrs)()


def _forward_call(name: str, full: str, leadership: Leadership) -> Callable[..., Any]:
    async def call(self: Any, request: Any, context: _Context) -> Any:
        current = leadership.servicer
        if current is None:
            await leadership.abort(context, full)
        return await getattr(current, name)(request, context)

    return call


def _forward_stream(name: str, full: str, leadership: Leadership) -> Callable[..., Any]:
    async def stream(self: Any, request: Any, context: _Context) -> AsyncIterator[Any]:
        current = leadership.servicer
        if current is None:
            await leadership.abort(context, full)
        async for reply in getattr(current, name)(request, context):
            yield reply

    return stream
