"""``python -m tslice ...`` servers whose log lines a test can wait for (the servers' own
word that something happened: no sleeps, no polling)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

#: How long a server may take to report a line a test waits for, seconds.
WAIT_S = 60.0


class LoggedServer:
    def __init__(
        self, args: Sequence[str], log_path: pathlib.Path, *, env: Mapping[str, str] | None = None
    ) -> None:
        self.log_path = log_path
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._ended = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tslice", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, name=f"{args[0]}-log", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log_path.open("w", encoding="utf-8") as log:
            for line in self.proc.stdout:
                log.write(line)
                with self._changed:
                    self._lines.append(line)
                    self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, *, since: int = 0) -> re.Match[str]:
        """The first line matching ``pattern`` (from line ``since`` on: see :meth:`mark`);
        raises with the log if the server exits, or has not written it within ``WAIT_S``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + WAIT_S
        with self._changed:
            index = since
            while True:
                for line in self._lines[index:]:
                    match = regex.search(line)
                    if match:
                        return match
                index = len(self._lines)
                left = deadline - time.monotonic()
                if self._ended or left <= 0 or not self._changed.wait(left):
                    raise AssertionError(f"no log line matched {pattern!r}:\n{self.logs()}")

    def mark(self) -> int:
        """How many lines it has written: ``wait_for(since=...)`` looks at the later ones."""
        with self._changed:
            return len(self._lines)

    def logs(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM) without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """Stop it gracefully (killed if it takes longer than 15 s) and wait."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(timeout=15)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@contextlib.contextmanager
def frozen(servers: Iterable[LoggedServer]) -> Iterator[None]:
    """``servers`` stopped (SIGSTOP) inside the block: agents frozen from before a switch
    starts answer none of its calls, so the switch is still in flight when the block acts
    (kills a leader, cordons a node), however long that takes."""
    stopped = list(servers)
    for server in stopped:
        server.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for server in stopped:
            server.proc.send_signal(signal.SIGCONT)
