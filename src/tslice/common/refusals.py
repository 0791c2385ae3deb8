"""How a server says no: one refusal type for the orchestrator and the agent.

Every request a server rejects is answered with a gRPC status code and a message a
user can act on, and nothing was changed. Decisions (pure code: the agent's job
rules, the orchestrator's lock) raise :class:`Refused`; the servicer turns it into
the RPC's status with :func:`abort`, or into the ``status_code``/``status_message``
of a reply on a multiplexed stream with :func:`status_number`. Code that reacts to
a refusal branches on ``code``, never on the message text.
"""

from __future__ import annotations

import enum
from typing import NoReturn

import grpc


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


async def abort(context: grpc.aio.ServicerContext, refused: Refused) -> NoReturn:  # type: ignore[type-arg]
    """End the RPC with the refusal's status and message."""
    await context.abort(refused.code.grpc, refused.message)
    raise AssertionError("context.abort returned")  # pragma: no cover
