"""Small real backends for tests: one that blocks until released, one that fails transiently."""

from __future__ import annotations

import asyncio
from typing import ClassVar

from tslice.agent.backends import base
from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb


class GatedBackend(base.Backend):
    """Snapshot/restore block until :meth:`release`; ``started`` fires when one begins."""

    name: ClassVar[str] = "gated"

    def __init__(self, *, recovers_to: pb.JobState | None = None) -> None:
        self.gate = asyncio.Event()
        self.started = asyncio.Event()
        self.recovers_to = recovers_to
        self.calls: list[str] = []

    def release(self) -> None:
        self.gate.set()

    async def _pass(self, what: str) -> base.OpResult:
        self.calls.append(what)
        self.started.set()
        await self.gate.wait()
        return base.OpResult(device_bytes=100, host_bytes=100 if what == "snapshot" else 0)

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        return await self._pass("snapshot")

    async def restore(self, job: base.JobContext) -> base.OpResult:
        return await self._pass("restore")

    async def recover(self, job: base.JobContext) -> pb.JobState | None:
        return self.recovers_to


class FlakyBackend(base.Backend):
    """Raises TransientBackendError ``failures`` times per call kind, then succeeds."""

    name: ClassVar[str] = "flaky"

    def __init__(self, *, failures: int) -> None:
        self.failures = failures
        self.attempts = 0

    async def _maybe_fail(self) -> None:
        self.attempts += 1
        if self.attempts <= self.failures:
            raise base.TransientBackendError("device busy", retry_after=0.01)

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        await self._maybe_fail()
        return base.OpResult(device_bytes=1, host_bytes=1)

    async def restore(self, job: base.JobContext) -> base.OpResult:
        await self._maybe_fail()
        return base.OpResult(device_bytes=1)


class BrokenBackend(base.Backend):
    """Snapshot and restore raise ``error``; health fails unless ``healthy``."""

    name: ClassVar[str] = "broken"

    def __init__(self, *, error: Exception, healthy: bool = True) -> None:
        self.error = error
        self.healthy = healthy

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        raise self.error

    async def restore(self, job: base.JobContext) -> base.OpResult:
        raise self.error

    async def check_health(self) -> None:
        if not self.healthy:
            raise base.BackendUnavailableError("no device")


class PickyBackend(base.Backend):
    """``validate`` raises ``refusal`` (when set); operations succeed instantly."""

    name: ClassVar[str] = "picky"

    def __init__(self) -> None:
        self.refusal: Exception | None = None

    async def validate(self, job: base.JobContext) -> None:
        if self.refusal is not None:
            raise self.refusal

    async def snapshot(self, job: base.JobContext, mode: pb.SuspendMode) -> base.OpResult:
        return base.OpResult()

    async def restore(self, job: base.JobContext) -> base.OpResult:
        return base.OpResult()
