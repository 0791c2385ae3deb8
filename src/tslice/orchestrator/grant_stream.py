"""Grants to one agent over its ``GrantStream`` (see :mod:`tslice.common.multiplex`).

The Grant is on every hand-over's path; on one long-lived stream per agent it costs
about half a unary call. An agent without the RPC (llm-d's, or an older tslice) gets
unary Grants from its first refusal on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.common import multiplex

Broken = multiplex.Broken
Unsupported = multiplex.Unsupported


class GrantStream:
    def __init__(self, open_call: Callable[[], Any], *, name: str) -> None:
        self._caller: multiplex.Caller[pb.GrantStreamRequest, pb.GrantStreamResponse] = (
            multiplex.Caller(open_call, reply_id=lambda r: r.request_id, name=f"agent {name}")
        )

    @property
    def supported(self) -> bool | None:
        return self._caller.supported

    async def grant(
        self,
        request: pb.GrantRequest,
        *,
        timeout_s: float,
        issued: Callable[[], None] | None = None,
    ) -> pb.GrantStreamResponse:
        """The agent's reply; raise Unsupported, Broken or TimeoutError."""
        return await self._caller.call(
            lambda rid: pb.GrantStreamRequest(request_id=rid, grant=request),
            timeout_s=timeout_s,
            issued=issued,
        )

    async def close(self) -> None:
        await self._caller.close()
