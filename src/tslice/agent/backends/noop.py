"""The no-op backend: moves nothing, reports 0 bytes; for tests and dry runs."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


class NoopBackend(base.Backend):
    """Every operation succeeds after ``delay_s`` seconds (default 0) and moves 0 bytes."""

    name: ClassVar[str] = "noop"
    #: Simulated states hold no host memory: never counted against the host budget.
    holds_host_memory: ClassVar[bool] = False

    def __init__(self, *, delay_s: float = 0.0) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0 (got {delay_s})")
        self.delay_s = float(delay_s)

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return base.OpResult()

    async def restore(self, job: base.JobContext) -> base.OpResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return base.OpResult()

    async def activate(self, job: base.JobContext) -> base.OpResult:
        return base.OpResult()
