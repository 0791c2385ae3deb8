"""What every tslice server process does the same way: run until SIGTERM/SIGINT, and
publish its address in a ready file once it accepts calls."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import signal
from collections.abc import Awaitable, Callable

#: ``serve(ready=..., stop=...)`` of the orchestrator or the agent, bound to its config.
Serve = Callable[[Callable[[str], None], asyncio.Event], Awaitable[None]]


def write_ready_file(path: pathlib.Path, address: str) -> None:
    """Atomically publish ``{"address", "pid"}`` (tmp + rename): waiters never read half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"address": address, "pid": os.getpid()}))
    os.replace(tmp, path)


def run_until_signalled(serve: Serve, *, ready_file: pathlib.Path | None = None) -> None:
    """Run ``serve`` in a fresh event loop; SIGTERM/SIGINT set its stop event."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)

        def ready(address: str) -> None:
            if ready_file is not None:
                write_ready_file(ready_file, address)

        await serve(ready, stop)

    asyncio.run(main())
