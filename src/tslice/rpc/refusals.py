"""How a server says no: one refusal type for the orchestrator and the agent.

Every request a server rejects is answered with a gRPC status code and a message a
user can act on, and nothing was changed. Decisions (pure code: the agent's job
rules, the orchestrator's lock) raise :class:`Refused`; the servicer turns it into
the RPC's status with :func:`abort` (or :func:`checked` / :func:`answered` around a
check or a call), or into the ``status_code``/``status_message`` of a reply on a
multiplexed stream with :func:`status_number`. Every message sent is cut to a
bounded length. Code that reacts to a refusal branches on ``code``, never on the
message text.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc

from tslice.common import validation

_T = TypeVar("_T")
log = logging.getLogger(__name__)


class Code(enum.Enum):
    """The status of a refusal (names match ``grpc.StatusCode``)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    ABORTED = "ABORTED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"
    #: A deadline the request carries itself (``timeout_ms``) passed.
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"

    @property
    def grpc(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.value]


class Refused(Exception):
    """The request is rejected and nothing was changed."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_number(code: Code) -> int:
    """The google.rpc.Code number of ``code`` (for replies on multiplexed streams)."""
    number: int = code.grpc.value[0]
    return number


def checked_id(kind: str, value: str) -> str:
    """``value`` if it is a well-formed id (see ``tslice.common.validation``), else refused
    with INVALID_ARGUMENT naming the field."""
    try:
        return validation.check_id(kind, value)
    except validation.InvalidIdError as err:
        raise Refused(Code.INVALID_ARGUMENT, str(err)) from None


async def abort(context: grpc.aio.ServicerContext[Any, Any], refused: Refused) -> NoReturn:
    """End the RPC with the refusal's status and its message, cut to a bounded length.

    A caller already gone (cancelled, or its deadline passed as the refusal came) can no
    longer be told: sending the status fails in gRPC's core, which would log it as a
    server error with a traceback. The handler ends as cancelled instead, as gRPC ends
    one whose caller left."""
    try:
        await context.abort(refused.code.grpc, validation.bounded(refused.message))
    except grpc.aio.AbortError:
        raise  # (how abort ends the handler)
    except Exception as err:  # (gRPC's core error for a call that is over: private type)
        log.debug("the caller left before it was told %r: %s", refused.message, err)
        raise asyncio.CancelledError("the caller left before it was refused") from err
    raise AssertionError("context.abort returned")  # pragma: no cover


async def checked(
    context: grpc.aio.ServicerContext[Any, Any],
    check: Callable[..., _T],
    *args: Any,
) -> _T:
    """``check(*args)``, its refusal sent as the RPC's status."""
    try:
        return check(*args)
    except Refused as refused:
        await abort(context, refused)


async def answered(context: grpc.aio.ServicerContext[Any, Any], call: Awaitable[_T]) -> _T:
    """The result of ``call``, its refusal sent as the RPC's status."""
    try:
        return await call
    except Refused as refused:
        await abort(context, refused)
