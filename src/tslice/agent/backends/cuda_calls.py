"""Blocking driver calls off the event loop, each on a thread of its own, tracked per PID.

Why not ``asyncio.to_thread``: a checkpoint driver call cannot be interrupted, and some
hang (``cuCheckpointProcessGetState`` on a process in a bad state, cuda-checkpoint #30).
In the loop's default pool a hung call holds a worker for ever, and enough of them
starve NVML, which shares that pool; and when the caller's deadline passes, the call
goes on while nothing remembers it, so a later operation (``recover()`` after ResetJob)
would call into the same process while the old call still runs, which the driver
contract forbids. Here each call runs on its own daemon thread (a hung one never blocks
another, nor the agent's exit), and the PID stays in :meth:`DriverCalls.in_flight`
until that thread returns, whatever happened to the caller.

The bindings release the GIL during a driver call only from cuda-bindings 12.9.1 /
13.0.0 (tslice[gpu] requires that); with an older one a long checkpoint would freeze
the whole agent, event loop included.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DriverCalls:
    """Runs blocking calls for PIDs on daemon threads and remembers the unfinished ones."""

    def __init__(self, *, name: str = "tslice-cuda") -> None:
        self._name = name
        self._lock = threading.Lock()
        self._running: dict[int, str] = {}

    def in_flight(self) -> dict[int, str]:
        """PID → operation of every call whose thread has not returned yet."""
        with self._lock:
            return dict(self._running)

    async def run(self, pid: int, op: str, func: Callable[[], T]) -> T:
        """``func()`` on a new thread; the PID is busy until the thread returns.

        Cancelling the await (a deadline) leaves the thread running: its result is
        dropped and the PID is released only when it ends.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def deliver(result: T | None, error: BaseException | None) -> None:
            if future.done():
                return  # the caller gave up (deadline): nobody wants the result
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def work() -> None:
            result: T | None = None
            error: BaseException | None = None
            try:
                result = func()
            except BaseException as exc:  # handed to the awaiting coroutine
                error = exc
            finally:
                with self._lock:
                    if self._running.get(pid) == op:
                        del self._running[pid]
            # RuntimeError: the loop is closed (the agent stopped meanwhile).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deliver, result, error)

        with self._lock:
            self._running[pid] = op
        thread = threading.Thread(target=work, name=f"{self._name}-{op}-{pid}", daemon=True)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._running.pop(pid, None)
            raise
        return await future
