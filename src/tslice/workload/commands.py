"""Runs the agent's snapshot/restore commands through a workload's adapter.

Kept apart from the connection (:mod:`tslice.workload.channel`): the connection
decides when a command runs and where its answer goes; this module decides how it
runs. Awaitable adapter methods run on the event loop that was running when the
workload registered (engines such as vLLM's ``AsyncLLM`` are bound to it), or on
a private loop thread when there was none, and give up at the agent's deadline.
Every command ends as a ``CommandResult``: an adapter's exception becomes
``ok=false`` with ``"<ExcType>: <message>"``, as llm-d's library reports it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Sequence

from tslice.api.snapshot_agent.v1alpha1 import snapshot_agent_pb2 as pb
from tslice.workload.adapters import base, callbacks

log = logging.getLogger(__name__)


class CommandRunner:
    """Executes commands one at a time for one workload (called from its worker thread)."""

    def __init__(
        self,
        *,
        job_id: str,
        adapter: base.WorkloadAdapter,
        capabilities: base.Capabilities,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.job_id = job_id
        self.adapter = adapter
        self.capabilities = capabilities
        self._loop = loop
        self._tracker = base.ResidencyTracker(declared=capabilities.tags)
        self._private_loop: asyncio.AbstractEventLoop | None = None
        self._private_loop_thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def state(self) -> base.AdapterState:
        """What the workload holds on the device now (the adapter's view, else tracked)."""
        reported = self.adapter.state()
        return reported if reported is not None else self._tracker.state()

    def run(self, command: pb.AgentCommand, received: float) -> pb.CommandResult:
        """Run a snapshot or restore command; never raises."""
        started = time.monotonic()
        # The agent's clock started when it sent the command, not when our worker got to it.
        deadline = received + command.deadline_ms / 1000 if command.deadline_ms > 0 else None
        kind = command.WhichOneof("command")
        try:
            if kind == "snapshot":
                tags: Sequence[str] = tuple(command.snapshot.tags)
                mode = self._mode(command.snapshot.mode)
                measured = self._settle(self.adapter.snapshot(mode, tags), deadline)
                self._tracker.snapshot_done(tags)
            else:
                tags = tuple(command.restore.tags)
                measured = self._settle(self.adapter.restore(tags), deadline)
                self._tracker.restore_done(tags)
        except Exception as exc:
            log.warning(
                "command failed",
                exc_info=True,
                extra={"job_id": self.job_id, "command_id": command.command_id, "kind": kind},
            )
            return pb.CommandResult(
                command_id=command.command_id, ok=False, error=f"{type(exc).__name__}: {exc}"
            )
        result = pb.CommandResult(
            command_id=command.command_id,
            ok=True,
            device_bytes=measured.device_bytes if measured else 0,
            host_bytes=measured.host_bytes if measured else 0,
        )
        log.info(
            "command done",
            extra={
                "job_id": self.job_id,
                "command_id": command.command_id,
                "kind": kind,
                "tags": list(tags),
                "elapsed_s": round(time.monotonic() - started, 3),
                "device_bytes": result.device_bytes,
            },
        )
        return result

    def close(self) -> None:
        """Stop the private loop thread, if one was started. Idempotent."""
        with self._lock:
            loop, thread = self._private_loop, self._private_loop_thread
            self._private_loop = self._private_loop_thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if not thread.is_alive():
            loop.close()

    def _mode(self, value: int) -> base.SuspendMode:
        if value == pb.SUSPEND_MODE_UNSPECIFIED:
            # The agent always resolves the mode; be lenient with one that does not.
            return self.capabilities.default_mode or base.SuspendMode.OFFLOAD
        return base.SuspendMode.parse(value)

    def _settle(self, outcome: object, deadline: float | None) -> base.AdapterResult | None:
        if not inspect.isawaitable(outcome):
            return callbacks.coerce_result(outcome)
        loop = self._loop if self._loop is not None else self._ensure_private_loop()
        runner = _awaited(outcome)
        try:
            future = asyncio.run_coroutine_threadsafe(runner, loop)
        except RuntimeError as exc:  # the captured loop has been closed
            runner.close()
            close = getattr(outcome, "close", None)
            if callable(close):
                close()
            raise RuntimeError(
                f"the event loop captured at register_workload() is gone ({exc}); "
                "register from a loop that outlives the workload, or from no loop at all"
            ) from exc
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            return callbacks.coerce_result(future.result(timeout=remaining))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                "gave up at the agent's deadline; the operation was cancelled"
            ) from None

    def _ensure_private_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._private_loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name=f"tslice-workload-{self.job_id}-loop", daemon=True
                )
                thread.start()
                self._private_loop, self._private_loop_thread = loop, thread
            return self._private_loop


async def _awaited(awaitable: Awaitable[object]) -> object:
    return await awaitable
