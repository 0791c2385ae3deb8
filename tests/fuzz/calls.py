"""Calling a real server with a fuzzed request, and what every answer must look like.

Each call has a deadline; a call that reaches it is a hang unless the RPC is one that
waits by design (and then only within the wait the request itself asks for). Every
status is one a client can act on (never UNKNOWN or INTERNAL, which say that the server
failed), and every status message is short: a server never echoes unbounded input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tslice.common import validation

Code = grpc.StatusCode

#: What a server may answer to a request it refuses (api.md, security.md).
EXPECTED = frozenset(
    {
        Code.OK,
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.PERMISSION_DENIED,
        Code.RESOURCE_EXHAUSTED,
        Code.ABORTED,
        Code.ALREADY_EXISTS,
        Code.OUT_OF_RANGE,
    }
)
#: Deadline of a call that should answer at once (a loaded 2-core CI machine included).
PROMPT_S = 10.0
#: Health must answer within this after every example (issue 10: "within a second").
HEALTH_S = 1.0
#: This client's own message limits: high, so that what is tested is the servers' own
#: (4 MB received: RESOURCE_EXHAUSTED from gRPC).
MAX_CLIENT_MESSAGE = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_CLIENT_MESSAGE),
    ("grpc.max_receive_message_length", MAX_CLIENT_MESSAGE),
)


@dataclasses.dataclass(frozen=True)
class Answer:
    """How one call ended: its status, message and the replies it got."""

    method: str
    code: grpc.StatusCode
    details: str
    replies: tuple[Any, ...] = ()

    def check(self, allowed: Iterable[grpc.StatusCode] = EXPECTED) -> None:
        allowed = frozenset(allowed)
        assert self.code in allowed, (
            f"{self.method} ended {self.code.name}: {self.details[:500]!r}"
            f" (expected one of {sorted(c.name for c in allowed)})"
        )
        _check_message(self.method, self.details)
        for reply in self.replies:
            # Replies on a multiplexed stream carry their own status (Session, GrantStream).
            fields = getattr(getattr(type(reply), "DESCRIPTOR", None), "fields_by_name", {})
            if "status_code" in fields:
                code = _BY_NUMBER.get(reply.status_code)
                assert code in allowed, f"{self.method} replied {reply.status_code}: {reply}"
                _check_message(self.method, reply.status_message)


_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def _check_message(method: str, details: str) -> None:
    assert len(details) <= validation.MAX_MESSAGE, (
        f"{method}: a status message of {len(details)} characters "
        f"(at most {validation.MAX_MESSAGE}): {details[:200]!r}…"
    )


def _ended(method: str, err: grpc.RpcError, replies: Sequence[Any] = ()) -> Answer:
    return Answer(method, err.code(), err.details() or "", tuple(replies))


def unary(
    method: Callable[..., Any], name: str, request: Any, *, timeout: float = PROMPT_S
) -> Answer:
    """Call a unary method once."""
    try:
        reply = method(request, timeout=timeout)
    except grpc.RpcError as err:
        return _ended(name, err)
    return Answer(name, Code.OK, "", (reply,))


def first_reply(
    method: Callable[..., Any], name: str, request: Any, *, timeout: float = PROMPT_S
) -> Answer:
    """A server stream that stays open by design: its first reply (or its end), then
    the call is cancelled."""
    call = method(request, timeout=timeout)
    try:
        reply = next(call)
    except StopIteration:
        return Answer(name, call.code(), call.details() or "")
    except grpc.RpcError as err:
        return _ended(name, err)
    finally:
        call.cancel()
    return Answer(name, Code.OK, "", (reply,))


def subscribed(
    method: Callable[..., Any], name: str, request: Any, *, timeout: float = PROMPT_S
) -> Answer:
    """A stream that sends headers once it is set up (WatchEvents): refused, or set up
    (OK); then cancelled."""
    call = method(request, timeout=timeout)
    call.initial_metadata()
    call.cancel()
    code = call.code()
    if code == Code.CANCELLED:  # our cancel: the stream was up
        return Answer(name, Code.OK, "")
    return Answer(name, code, call.details() or "")


def exchange(
    method: Callable[..., Any], name: str, requests: Sequence[Any], *, timeout: float = PROMPT_S
) -> Answer:
    """A bidirectional stream: send ``requests``, half-close, read every reply to its end."""
    call = method(iter(requests), timeout=timeout)
    replies: list[Any] = []
    try:
        for reply in call:
            replies.append(reply)
    except grpc.RpcError as err:
        return _ended(name, err, replies)
    return Answer(name, call.code(), call.details() or "", tuple(replies))


def assert_healthy(channel: grpc.Channel, service: str = "") -> None:
    """The server answers its health check within :data:`HEALTH_S`, SERVING."""
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_S
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
