"""A real terminal for CLI tests (tmux: send keys, read the screen), a slow link (a TCP
proxy that delays every byte), and terminal screenshots for the docs."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from tests import debian_tools


class Tmux:
    """One tmux server of its own (its own socket), one session ``width`` x ``height``."""

    def __init__(
        self, command: Sequence[str], *, env: Mapping[str, str], width: int, height: int
    ) -> None:
        self._tmux = debian_tools.binary("tmux", "tmux")
        self._socket = f"tslice-test-{os.getpid()}-{time.monotonic_ns()}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        # The shell survives a Ctrl-C meant for the command (a trap, not an ignored
        # signal, which the command would inherit) and shows its exit code.
        line = (
            f"trap true INT; env {exports} {shlex.join(command)}; echo command-exit=$?; sleep 600"
        )
        self._run(
            "-f", "/dev/null", "new-session", "-d", "-s", "t", "-x", str(width),
            "-y", str(height), "sh", "-c", line,
        )  # fmt: skip

    def _run(self, *args: str) -> str:
        done = subprocess.run(
            [self._tmux, "-L", self._socket, *args],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return done.stdout

    def screen(self, *, escapes: bool = False) -> str:
        """The visible screen; wrapped lines joined (-J), so a line that did not fit the
        width shows as one line longer than it."""
        return self._run("capture-pane", "-p", "-J", *(["-e"] if escapes else []), "-t", "t")

    def keys(self, *keys: str) -> None:
        self._run("send-keys", "-t", "t", *keys)

    def wait_for(self, check: Callable[[str], bool], *, timeout: float = 30.0) -> str:
        """The screen, once ``check`` holds for it (read every 0.1 s; the screen is what
        is waited on)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if check(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"the screen never showed what was expected:\n{text}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(
            [self._tmux, "-L", self._socket, "kill-server"],
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip


class SlowLink:
    """127.0.0.1:port forwarding to ``target`` with ``delay_s`` added to every byte, each
    way (latency, not a throughput cap), in a thread of its own."""

    def __init__(self, target: str, *, delay_s: float) -> None:
        host, port = target.rsplit(":", 1)
        self._target, self._delay = (host, int(port)), delay_s
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.address = f"127.0.0.1:{self._port}"

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0)
        )
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        self._loop.run_until_complete(server.wait_closed())

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
            )
        except asyncio.CancelledError:
            pass  # the link is closing: the connection ends with it (nothing to report)
        finally:
            for end in (writer, up_writer):
                end.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(due - self._loop.time(), 0))  # the link's latency
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        try:
            while True:
                data = await reader.read(65536)
                await queue.put((self._loop.time() + self._delay, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

    def close(self) -> None:
        async def shutdown() -> None:
            mine = asyncio.current_task()
            left = [t for t in asyncio.all_tasks() if t is not mine]
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def keep_screen(ansi: str, name: str, *, width: int) -> None:
    """Save a terminal screen (with its colours) as a PNG in $TSLICE_SCREENSHOTS: rich draws
    it as SVG, headless chromium takes the picture."""
    where = os.environ.get("TSLICE_SCREENSHOTS")
    if not where:
        return
    from rich.console import Console
    from rich.text import Text

    from tests.timeline import chromium

    lines_kept = ansi.rstrip().splitlines()
    while lines_kept and not re.sub(r"\x1b\[[0-9;]*m", "", lines_kept[-1]).strip():
        lines_kept.pop()
    ansi = "\n".join(lines_kept)
    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=width, force_terminal=True, file=sink)
        console.print(Text.from_ansi(ansi.rstrip("\n")))
    folder = pathlib.Path(where)
    folder.mkdir(parents=True, exist_ok=True)
    page = folder / f"{name}.html"
    svg = console.export_svg(title="tslice watch")
    page.write_text(f"<html><body style='margin:0'>{svg}</body></html>", encoding="utf-8")
    lines = ansi.count("\n") + 1
    chromium.screenshot(page, folder / f"{name}.png", width=width * 12 + 40, height=lines * 25 + 90)
    page.unlink()
